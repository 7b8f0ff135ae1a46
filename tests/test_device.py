"""The GPU path's decisions that can be made without a GPU: where `--nproc` ranks run, what
`--compile` refuses, and that the device-only instruments stay silent on CPU."""

import pytest
import torch

from pipezero.config import Device, ScheduleKind, ShareDevice
from pipezero.config import ScheduleKind as K
from pipezero.settings import build_config
from pipezero.errors import ConfigError
from pipezero.parallel.device import (ComputeClock, PeakMemory, gpu_of, local_device, share_of_gpu, shares_device,
                                      sharing_line)
from pipezero.schedules.actions import Op
from pipezero.schedules.registry import build_schedule
from pipezero.schedules.registry import SPLIT_BACKWARD, default_virtual


@pytest.mark.parametrize("setting, share, ranks, gpus, device, warns", [
    (Device.AUTO, ShareDevice.AUTO, 4, 4, Device.CUDA, False),
    (Device.AUTO, ShareDevice.AUTO, 1, 1, Device.CUDA, False),
    (Device.AUTO, ShareDevice.AUTO, 4, 1, Device.CUDA, False),  # the quickstart on a one-GPU machine: shared
    (Device.CUDA, ShareDevice.AUTO, 4, 1, Device.CUDA, False),
    (Device.AUTO, ShareDevice.OFF, 4, 1, Device.CPU, True),  # not shared: CPU, said once
    (Device.AUTO, ShareDevice.AUTO, 4, 0, Device.CPU, False),  # no GPU at all: CPU is what auto means
    (Device.AUTO, ShareDevice.ON, 4, 0, Device.CPU, False),  # on CPU ranks: the staging path's test
    (Device.CPU, ShareDevice.AUTO, 4, 8, Device.CPU, False),
    (Device.CUDA, ShareDevice.OFF, 2, 2, Device.CUDA, False),
])
def test_local_device(setting, share, ranks, gpus, device, warns):
    got, warning = local_device(setting, ranks, gpus, share)
    assert got is device
    assert (warning is not None) is warns
    if warns:
        assert f"--nproc {gpus}" in warning and "CPU" in warning and "--share-device off" in warning


def test_explicit_cuda_with_too_few_gpus_and_no_sharing_is_refused_before_launch():
    with pytest.raises(ConfigError, match="--device cuda with 4 local ranks needs 4 GPUs, but torch sees 1: .*"
                                          "--share-device auto"):
        local_device(Device.CUDA, 4, 1, ShareDevice.OFF)


@pytest.mark.parametrize("share, kind, ranks, gpus, staged", [
    (ShareDevice.AUTO, "cuda", 4, 1, True), (ShareDevice.AUTO, "cuda", 2, 2, False),
    (ShareDevice.AUTO, "cpu", 4, 0, False), (ShareDevice.ON, "cpu", 2, 0, True),
    (ShareDevice.ON, "cuda", 2, 2, True), (ShareDevice.OFF, "cuda", 4, 1, False),
])
def test_which_ranks_stage_their_transfers(share, kind, ranks, gpus, staged):
    assert shares_device(share, kind, ranks, gpus) is staged


def test_ranks_sharing_gpus_take_contiguous_blocks_and_their_share_of_memory():
    assert [gpu_of(r, 4, 1) for r in range(4)] == [(0, 4)] * 4
    assert [gpu_of(r, 4, 2) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [gpu_of(r, 3, 2) for r in range(3)] == [(0, 2), (0, 2), (1, 1)]
    assert share_of_gpu(4, 1) == 0.25 and share_of_gpu(3, 2) == 0.5 and share_of_gpu(2, 2) == 1.0
    line = sharing_line("cuda", 4, 1)
    assert "4 ranks share 1 GPU (4 a GPU, each capped to 1/4" in line and "not a multi-GPU figure" in line


def test_the_fit_check_allows_a_sharing_rank_its_share(monkeypatch):
    """Four ranks on one 80 GiB GPU: each is allowed a quarter of the card, so the fit check refuses
    a layout that fits the whole card but not a quarter of it, naming the share it held it to."""
    from pipezero.memory import fit

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 80 * 2**30}))
    monkeypatch.setattr(fit, "alternatives", lambda *a: "...")  # the planner's search: tests/test_planner.py
    cfg = build_config(None, {"parallel.dp": 4, "model.preset": "base", "data.seq_len": 1024,  # ~36 GiB a rank
                              "parallel.micro_batch_size": 32, "parallel.microbatches": 1})
    assert fit.rank_limit_gib(cfg, 4) == (20.0, True)
    assert fit.rank_limit_gib(cfg, 1) == (80.0, True) and fit.limit_name(cfg, 1) is None
    fit.check_fit(cfg, *fit.rank_limit_gib(cfg, 1))
    with pytest.raises(ConfigError, match=r"the layout does not fit a rank's share of the GPU, 20 GiB \(1/4 of 80 GiB: "
                                          r"4 ranks share 1 GPU; --gpu-memory GIB checks another limit\): rank 0"):
        fit.check_fit(cfg, *fit.rank_limit_gib(cfg, 4), fit.limit_name(cfg, 4))
    cfg.run.share_device = ShareDevice.OFF
    assert fit.rank_limit_gib(cfg, 4) == (80.0, True)
    cfg.run.share_device, cfg.run.gpu_memory_gib = ShareDevice.AUTO, 50.0  # the flag replaces the share
    assert fit.rank_limit_gib(cfg, 4) == (50.0, True)
    assert fit.limit_name(cfg, 4) is None


def test_share_device_on_with_hierarchical_is_refused():
    with pytest.raises(ConfigError, match="--share-device on with --hierarchical: .* drop one of them"):
        build_config(None, {"run.share_device": "on", "run.device": "cpu", "parallel.dp": 2,
                            "parallel.hierarchical": True, "parallel.ranks_per_node": 1})


def test_share_device_on_with_one_rank_is_refused_and_verifys_reference_shares_nothing(tmp_path):
    """One rank has no peer to share a GPU with or stage a transfer for: `on` would be read by
    nothing. verify's one-process reference of a sharing layout therefore shares nothing itself."""
    from pathlib import Path

    from pipezero.verify import reference_config

    with pytest.raises(ConfigError, match="--share-device on with one rank: .* drop it"):
        build_config(None, {"run.share_device": "on", "run.device": "cpu"})
    layout = build_config(None, {"run.share_device": "on", "run.device": "cpu", "parallel.dp": 2})
    assert reference_config(layout, Path(tmp_path)).run.share_device is ShareDevice.OFF


def test_split_backward_schedules_are_the_ones_with_b_actions():
    found = set()
    for kind in ScheduleKind:
        v = default_virtual(kind)
        s = build_schedule(kind, 2, 4, v)
        if any(a.op is Op.B for acts in s.actions for a in acts):
            found.add(kind)
    assert found == SPLIT_BACKWARD


@pytest.mark.parametrize("kind", sorted(k.value for k in SPLIT_BACKWARD))
def test_compile_refuses_split_backward(kind):
    v = default_virtual(ScheduleKind(kind))
    with pytest.raises(ConfigError, match="--compile cannot run --schedule"):
        build_config(None, {"run.compile": True, "parallel.schedule": kind, "parallel.pp": 2,
                            "parallel.virtual_stages": v, "parallel.microbatches": 4})
    build_config(None, {"run.compile": True, "parallel.schedule": "1f1b", "parallel.pp": 2})


def test_gpu_instruments_record_nothing_on_cpu():
    clock = ComputeClock(torch.device("cpu"))
    clock.start()
    clock.stop()
    assert clock.busy_share() is None
    peaks = PeakMemory(torch.device("cpu"))
    peaks.mark("train")
    assert peaks.phases == {}


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_blocks_train_like_eager(tmp_path):
    """--compile changes kernels, not the model: the same losses to float tolerance, and the same
    parameter names (checkpoints never see it)."""
    from pipezero.engine import train

    def run(compiled: bool):
        cfg = build_config(None, {"model.n_layers": 2, "data.tokenizer": "bytes", "data.max_bytes": 300_000,
                                  "data.seq_len": 32, "parallel.microbatches": 2, "parallel.micro_batch_size": 2,
                                  "run.max_steps": 3, "run.compile": compiled, "run.out": str(tmp_path / str(compiled)),
                                  "run.progress": False, "run.eval_every": 0, "run.eval_batches": 1,
                                  "run.sample_tokens": 0, "run.threads": 1})
        return train(cfg, snapshot=True)

    eager, compiled = run(False), run(True)
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    assert set(compiled.params) == set(eager.params)


def test_a_staged_call_copies_into_buffers_of_its_own_and_back_once_when_waited_for():
    """On CPU the staging copies are plain copies, but into separate buffers: what gloo reads is a
    snapshot taken at the call, and the output lands in the caller's tensor only at the wait."""
    from datetime import timedelta

    from pipezero.parallel.staging import Staged, StagedWork

    class Done:  # a finished torch Work
        def __init__(self):
            self.timeouts = []

        def wait(self, timeout=None):
            self.timeouts.append(timeout)
            return True

    stage = Staged()
    t = torch.arange(6.0)
    host = stage.to_host(t)
    assert torch.equal(host, t) and host.data_ptr() != t.data_ptr()
    t.add_(1)  # the caller goes on: the snapshot does not move
    assert torch.equal(host, torch.arange(6.0))
    arrived, out, work = torch.full((6,), 7.0), torch.zeros(6), Done()
    staged = StagedWork(work, [(arrived, out)], stage)
    assert torch.equal(out, torch.zeros(6))  # nothing lands before the wait
    assert staged.wait(timedelta(seconds=5)) and torch.equal(out, arrived)
    out.zero_()
    assert staged.wait(timedelta(seconds=5)) and torch.equal(out, torch.zeros(6))  # copied back once
    assert work.timeouts == [timedelta(seconds=5)] * 2  # the caller's timeout reaches the backend's wait
    assert stage.counts() == {"copies_out": 1, "bytes_out": 24, "copies_back": 1, "bytes_back": 24}
    assert not stage.stream_ordered  # every staged wait blocks the CPU, bounded by --timeout


# Every transport call site in one 2-rank process group: pipeline sends and receives with the tied
# embedding's sum between the two ends (pp 2), and ZeRO's collectives (dp 2): ZeRO-0's all-reduce,
# ZeRO-2's reduce-scatter exchange and the gathers of updated weights after the step (ZeRO-1's
# too), ZeRO-3's quantized gathers and reductions, and every run's norm and loss all-reduce.
STAGED_CASES = [
    {"pp": 2, "dp": 1, "kind": K.ONE_F_ONE_B, "m": 3, "parallel.zero": 1, "model.tie_embeddings": True},
    {"pp": 1, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 0},
    {"pp": 1, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 2, "parallel.grad_reduce": "microbatch"},
    {"pp": 1, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 3, "parallel.quantize_weights": "int8",
     "parallel.quantize_grads": "int8"},
]


def train_direct_and_staged(rank: int, world: int, data: str, out: str, cases: list[dict]) -> list[dict]:
    """Each case trained twice in this process group, straight to gloo and with --share-device on
    (every tensor copied through staging buffers), with what the staged transport copied and what
    the rank sent."""
    from pipezero.engine import train
    from pipezero.parallel.staging import Staged
    from training import tiny_overrides, watch_program

    seen = watch_program()
    results = []
    for i, case in enumerate(cases):
        runs = {}
        for share in ("off", "on"):
            cfg = build_config(None, tiny_overrides(data, f"{out}/case{i}-{share}", **case,
                                                    **{"run.share_device": share, "run.max_steps": 2}))
            res = train(cfg, snapshot=True)
            stage = seen["stage"]
            t, p2p, tied = stage.zero.comm.transport, stage.executor.p2p, stage.zero.tied
            runs[share] = {"losses": res.losses, "grad_norms": res.grad_norms, "params": res.params,
                           "staged": isinstance(t, Staged), "counts": t.counts() if isinstance(t, Staged) else None,
                           "one_transport": p2p.transport is t and (tied is None or tied.transport is t),
                           "sent": p2p.bytes_sent + stage.zero.comm.bytes_sent}
        results.append(runs)
    return results


def resumed_staged(rank: int, world: int, data: str, out: str) -> dict:
    """ZeRO-0 at D=2 shared (--share-device on): two steps saved, then one more resumed from them,
    beside one fresh step; the staging copies each made. A resume gathers every bucket's weights and
    both AdamW moments from the shards."""
    from pipezero.engine import train
    from training import tiny_overrides, watch_program

    seen = watch_program()
    case = {"pp": 1, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 0, "run.share_device": "on"}
    copies = {}
    for name, extra in (("saved", {"run.max_steps": 2, "run.save_final": True}),
                        ("resumed", {"run.max_steps": 3, "run.resume": True}),
                        ("fresh", {"run.max_steps": 1})):
        folder = f"{out}/{'fresh' if name == 'fresh' else 'run'}"
        train(build_config(None, tiny_overrides(data, folder, **case, **extra)))
        copies[name] = seen["stage"].zero.comm.transport.counts()["copies_out"]
    return {"copies": copies, "buckets": len(seen["stage"].zero.all_buckets())}


@pytest.mark.distributed
def test_a_resume_of_ranks_sharing_a_device_gathers_through_the_host(text_dir, tmp_path):
    """The restored weights and moments travel like every other collective of a sharing rank, through
    the host (on a GPU, gloo cannot read the device's tensors): a resumed step stages the restore's
    three gathers a bucket beyond what a fresh step stages."""
    from ranks import run_ranks

    for r in run_ranks(resumed_staged, 2, str(text_dir), str(tmp_path)):
        assert r["copies"]["resumed"] - r["copies"]["fresh"] >= 3 * r["buckets"], r


@pytest.mark.distributed
def test_staged_transfers_train_bit_identically_to_direct_ones(text_dir, tmp_path):
    """The shared-GPU path forced on CPU ranks: every send, receive and collective copied into host
    buffers of its own and back trains the very same model, bit for bit, and the copies happened
    (every byte a rank sent left through a staging buffer)."""
    from ranks import run_ranks

    results = run_ranks(train_direct_and_staged, 2, str(text_dir), str(tmp_path), STAGED_CASES, timeout=600)
    for rank, per_case in enumerate(results):
        for case, runs in zip(STAGED_CASES, per_case):
            off, on = runs["off"], runs["on"]
            assert not off["staged"] and on["staged"] and on["one_transport"], (rank, case)
            assert on["losses"] == off["losses"] and on["grad_norms"] == off["grad_norms"], (rank, case)
            assert on["params"].keys() == off["params"].keys()
            assert all(torch.equal(on["params"][n], off["params"][n]) for n in off["params"]), (rank, case)
            c = on["counts"]
            assert c["copies_out"] > 0 and c["copies_back"] > 0, (rank, case, c)
            assert c["bytes_out"] >= on["sent"] > 0, (rank, case, c, on["sent"])
