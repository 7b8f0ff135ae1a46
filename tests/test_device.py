"""The GPU path's decisions that can be made without a GPU: where `--nproc` ranks run, what
`--compile` refuses, and that the device-only instruments stay silent on CPU."""

import pytest
import torch

from pipezero.config import Device, ScheduleKind
from pipezero.settings import build_config
from pipezero.errors import ConfigError
from pipezero.parallel.device import ComputeClock, PeakMemory, local_device
from pipezero.schedules.actions import Op
from pipezero.schedules.registry import build_schedule
from pipezero.schedules.registry import SPLIT_BACKWARD, default_virtual


@pytest.mark.parametrize("setting, ranks, gpus, device, warns", [
    (Device.AUTO, 4, 4, Device.CUDA, False),
    (Device.AUTO, 1, 1, Device.CUDA, False),
    (Device.AUTO, 4, 1, Device.CPU, True),  # the quickstart on a one-GPU machine: CPU, said once
    (Device.AUTO, 4, 0, Device.CPU, False),  # no GPU at all: CPU is what auto means
    (Device.CPU, 4, 8, Device.CPU, False),
    (Device.CUDA, 2, 2, Device.CUDA, False),
])
def test_local_device(setting, ranks, gpus, device, warns):
    got, warning = local_device(setting, ranks, gpus)
    assert got is device
    assert (warning is not None) is warns
    if warns:
        assert f"--nproc {gpus}" in warning and "CPU" in warning


def test_explicit_cuda_with_too_few_gpus_is_refused_before_launch():
    with pytest.raises(ConfigError, match="--device cuda with 4 local ranks needs 4 GPUs, but torch sees 1"):
        local_device(Device.CUDA, 4, 1)


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
