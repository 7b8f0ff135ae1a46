"""--offload optimizer: the host copies and host steps are the program's, and an offloaded run trains
the model its plain run trains, bit for bit (the same kernels on the same elements)."""

from __future__ import annotations

import pytest
import torch

from pipezero.config import GradReduce, Offload, ParallelConfig
from pipezero.config import ScheduleKind as K
from pipezero.schedules.compile import compile_plan
from pipezero.schedules.played import expected
from pipezero.schedules.program import DataParallel, Kind, OptimStep, flat
from pipezero.schedules.program_check import check_program
from pipezero.cli.simulate_zero import preset_model
from ranks import run_ranks
from training import V_OF, assert_same_training, train_cases


def offloaded_program(kind: K, zero: int, mode: GradReduce, pp: int = 2, dp: int = 2, m: int = 4, **extra):
    v = V_OF.get(kind, 1)
    model, _ = preset_model("tiny", pp * v)
    p = ParallelConfig(pp=pp, dp=dp, zero=zero, schedule=kind, microbatches=m, virtual_stages=v, bucket_mb=0.05,
                       grad_reduce=mode, offload=Offload.OPTIMIZER, **extra)
    return compile_plan(p, model)


@pytest.mark.parametrize("kind", list(K))
def test_every_bucket_goes_to_the_host_once_after_its_last_reduction_and_steps_there_once(kind):
    # per-micro-batch reduction changes only ZeRO-2/3's programs; two reductions in flight, one kind's
    extras = ({}, {"buckets_in_flight": 2}) if kind is K.ZB_V else ({},)
    for zero, mode in [(z, GradReduce.STEP) for z in range(4)] + [(z, GradReduce.MICROBATCH) for z in (2, 3)]:
        for extra in extras:
            plan = offloaded_program(kind, zero, mode, **extra)
            check_program(plan.program)
            for rank, instrs in enumerate(plan.program.ranks):
                seq = flat(instrs)
                step = next(i for i, x in enumerate(seq) if isinstance(x, OptimStep))
                ops = [(i, x) for i, x in enumerate(seq) if isinstance(x, DataParallel)]
                buckets = {(x.chunk, x.bucket) for _, x in ops if x.kind is Kind.REDUCE_GRAD}
                assert buckets, (kind, zero, rank)
                for c, k in buckets:
                    where = {kd: [i for i, x in ops if x.kind is kd and (x.chunk, x.bucket) == (c, k)]
                             for kd in (Kind.REDUCE_GRAD, Kind.OFFLOAD_GRAD, Kind.HOST_STEP, Kind.UNSHARD)}
                    (off,), (host,) = where[Kind.OFFLOAD_GRAD], where[Kind.HOST_STEP]
                    assert max(where[Kind.REDUCE_GRAD]) < off < step < host, (kind, zero, mode, rank, c, k)
                    after = [i for i in where[Kind.UNSHARD] if i > step]  # ZeRO-1/2 spread the update
                    assert all(host < i for i in after) and len(after) == (zero in (1, 2))
                # the record's rules see them: a start each, in the program's order
                events = [e.name for e in expected(instrs, plan.buckets) if e.event == "start" and e.group == "host"]
                assert len(events) == 2 * len(buckets)


def test_a_copy_waits_only_for_its_own_reduction_and_older_ones():
    """ZeRO-2 with one reduction in flight: a bucket's gradient goes to the host as soon as the next
    bucket's REDUCE_GRAD has waited for it, inside the backward, not at the step's end."""
    plan = offloaded_program(K.ONE_F_ONE_B, 2, GradReduce.STEP, buckets_in_flight=1)
    instrs = plan.program.ranks[0]
    listing = plan.program.listing(0)
    first = listing.index("OFFLOAD_GRAD")
    assert first < listing.index("OPTIM_STEP")
    seq = flat(instrs)
    step = next(i for i, x in enumerate(seq) if isinstance(x, OptimStep))
    early = [x for x in seq[:step] if isinstance(x, DataParallel) and x.kind is Kind.OFFLOAD_GRAD
             and not isinstance(seq[seq.index(x) + 1], OptimStep)]
    assert early, listing
    waits = [e for e in expected(instrs, plan.buckets) if e.event == "wait"]
    assert waits, listing


def test_a_program_without_offload_has_no_host_instructions():
    model, _ = preset_model("tiny", 2)
    p = ParallelConfig(pp=2, dp=2, zero=2, microbatches=4, bucket_mb=0.05)
    kinds = {x.kind for r in compile_plan(p, model).program.ranks for x in flat(r)}
    assert not kinds & {Kind.OFFLOAD_GRAD, Kind.HOST_STEP}


def train_offloaded(rank: int, world: int, data: str, out: str, cases: list[dict]) -> list[dict]:
    """Each case offloaded (and before it plain, where the case says `exact`: to compare bit for bit),
    in this process group; also where the offloaded run held AdamW's state."""
    from training import last_step, watch_program

    results = []
    for i, case in enumerate(cases):
        exact = case.pop("exact", False)
        plain = train_cases(rank, world, data, f"{out}/plain{i}", [case])[0] if exact else None
        (off,) = train_cases(rank, world, data, f"{out}/off{i}", [{**case, "parallel.offload": "optimizer"}])
        stage = watch_program()["stage"]
        off["host_bytes"] = stage.zero.host.host_bytes()
        off["activation_copies"] = [p.name for p in last_step(watch_program()) if p.group == "host"
                                    and p.name.startswith(("OFFLOAD_ACT", "RELOAD_ACT"))]
        off["device_moments"] = sum(s.exp_avg.numel() for s in stage.zero.opt.states if s.exp_avg.device.type != "cpu")
        off["plain"] = plain and (plain["losses"], plain["params"])
        results.append(off)
    return results


@pytest.mark.distributed
def test_offloaded_runs_equal_one_process_and_their_plain_runs_bit_for_bit(text_dir, tmp_path):
    """Four ranks (P=2 x D=2): every schedule (and its activations offloaded), ZeRO 0-3 spread over
    them, and the options that change
    what a bucket's gradient is when it goes to the host (per-micro-batch reduction, tied copies,
    layer-by-layer ZeRO-3), each equal to one process; and, bit for bit against the same layout
    without offload, runs whose numerics one process does not share (quantized and two-level
    reductions, bf16) and one of each ZeRO stage's."""
    # every schedule also with two micro-batches' activations in host memory between forward and backward
    cases = [{"pp": 2, "dp": 2, "kind": kind, "m": 4, "parallel.zero": n % 4, "parallel.offload_activations": 2}
             for n, kind in enumerate(K)]
    cases += [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": 2, "parallel.grad_reduce": "microbatch"},
              {"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": 1, "model.tie_embeddings": True},
              # layer by layer ZeRO-3 releases a weight's storage under the views its forward saved
              {"pp": 1, "dp": 4, "kind": K.GPIPE, "m": 3, "parallel.zero": 3, "parallel.zero3_keep_gathered": False,
               "parallel.offload_activations": 1}]
    for case in cases[:4]:
        case["exact"] = True
    exact_only = [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": 2, "parallel.quantize_grads": "int8"},
                  {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 0, "parallel.hierarchical": True,
                   "parallel.ranks_per_node": 2},
                  {"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": 3, "run.dtype": "bf16"}]
    results = run_ranks(train_offloaded, 4, str(text_dir), str(tmp_path),
                        cases + [{**c, "exact": True} for c in exact_only], timeout=600)
    for rank, per_rank in enumerate(results):
        assert sum(r["plain"] is not None for r in per_rank) == 4 + len(exact_only)
        for r in per_rank:
            assert r["device_moments"] == 0 and r["host_bytes"] > 0, (rank, r["case"])
            # each copy out has its copy back (train_cases held their places to the program)
            out = [n for n in r["activation_copies"] if n.startswith("OFFLOAD_ACT")]
            assert sorted(n.replace("OFFLOAD", "RELOAD") for n in out) == sorted(set(r["activation_copies"]) - set(out))
            assert len(out) <= r["case"].get("parallel.offload_activations", 0)
    for n, case in enumerate(cases):  # the first pipeline rank of every schedule holds a warm-up to offload
        if case.get("parallel.offload_activations"):
            assert results[0][n]["activation_copies"], case
            if r["plain"] is None:
                continue
            losses, params = r["plain"]
            assert r["losses"] == losses, (rank, r["case"])
            assert r["params"].keys() == params.keys()
            for name, w in r["params"].items():
                assert torch.equal(w, params[name]), (rank, r["case"], name)
    assert_same_training([per_rank[:len(cases)] for per_rank in results], str(text_dir), tmp_path)


def test_the_simulator_prices_the_host_copies_and_steps_and_nothing_else():
    from pipezero.schedules.program_sim import CommCost, simulate_program

    model, _ = preset_model("tiny", 2)
    plain = ParallelConfig(pp=2, dp=2, zero=2, microbatches=4, bucket_mb=0.05)
    off = ParallelConfig(pp=2, dp=2, zero=2, microbatches=4, bucket_mb=0.05, offload=Offload.OPTIMIZER)
    a, b = compile_plan(plain, model).program, compile_plan(off, model).program
    free = CommCost(bandwidth=1e6)
    assert simulate_program(b, comm=free).step_time == pytest.approx(simulate_program(a, comm=free).step_time)
    priced = simulate_program(b, comm=CommCost(bandwidth=1e6, host_bandwidth=1e5, host_step=1e-5))
    assert priced.step_time > simulate_program(a, comm=free).step_time
    host = [sp for sp in priced.timeline if sp.lane == "host"]
    assert {sp.kind for sp in host} == {Kind.OFFLOAD_GRAD, Kind.HOST_STEP}
    # a rank's HOST_STEPs run after its OPTIM_STEP and each after its own bucket's copy
    for sp in host:
        if sp.kind is Kind.HOST_STEP:
            label = sp.label.replace("HOST_STEP", "OFFLOAD_GRAD")
            (copy,) = [c for c in host if c.rank == sp.rank and c.label == label]
            assert copy.end <= sp.start


@pytest.mark.parametrize("kind", list(K))
def test_activation_copies_leave_after_their_forward_and_return_one_action_before_their_backward(kind):
    from pipezero.schedules.actions import Op
    from pipezero.schedules.program import ActivationCopy, Compute

    v = V_OF.get(kind, 1)
    model, _ = preset_model("tiny", 4 * v)
    p = ParallelConfig(pp=4, dp=1, schedule=kind, microbatches=8, virtual_stages=v, offload_activations=3)
    plan = compile_plan(p, model)
    check_program(plan.program)
    moved = 0
    for rank, instrs in enumerate(plan.program.ranks):
        computes = [i for i, x in enumerate(instrs) if isinstance(x, Compute)]
        copies = [(i, x) for i, x in enumerate(instrs) if isinstance(x, ActivationCopy)]
        assert len(copies) <= 2 * 3
        for i, x in copies:
            fwd = next(j for j in computes if instrs[j].action.op is Op.F and (instrs[j].action.chunk,
                                                                               instrs[j].action.mb) == (x.chunk, x.mb))
            back = next(j for j in computes if instrs[j].action.op in (Op.B, Op.BW)
                        and (instrs[j].action.chunk, instrs[j].action.mb) == (x.chunk, x.mb))
            between = [j for j in computes if fwd < j < back]
            assert len(between) >= 2, (rank, x)
            if x.to_host:  # right after its forward: nothing but copies between
                assert all(isinstance(instrs[j], ActivationCopy) for j in range(fwd + 1, i)), (rank, x)
            else:  # before the last action ahead of its backward, after the one before that
                assert between[-2] < i < between[-1], (rank, x)
        moved += len(copies) // 2
    assert moved, plan.program.listing(0)


@pytest.mark.parametrize("kind, m, n", [(K.GPIPE, 4, 2), (K.GPIPE, 4, 4)])
def test_the_memory_model_predicts_the_activation_bytes_a_run_holds_in_host_memory(kind, m, n, text_dir, tmp_path):
    """One process (a pipeline of one rank: GPipe holds every micro-batch to the backward): the most
    activation bytes the run held in host memory at once against the model's `host_activations`."""
    from pipezero.engine import train
    from pipezero.settings import build_config
    from pipezero.memory.model import predict
    from training import tiny_overrides

    cfg = build_config(None, tiny_overrides(str(text_dir), str(tmp_path / "run"), 1, 1, kind, m,
                                            **{"parallel.offload_activations": n, "run.max_steps": 1}))
    (predicted,) = predict(cfg)
    seen = []
    import pipezero.summary as summary

    finish = summary.finish_run

    def keep(cfg, stage, *args, **kwargs):
        seen.append(stage.executor.host_activation_peak)
        return finish(cfg, stage, *args, **kwargs)

    summary.finish_run = keep
    try:
        import pipezero.engine as engine
        engine_finish, engine.finish_run = getattr(engine, "finish_run", None), keep
        train(cfg)
    finally:
        summary.finish_run = finish
        if engine_finish is not None:
            engine.finish_run = engine_finish
    want = predicted.host_categories.get("host_activations", 0)
    assert seen and (seen[0] == want == 0 or abs(seen[0] / want - 1) <= 0.10), (seen, want)


@pytest.mark.parametrize("argv, needle", [
    (["train", "--preset", "tiny", "--offload-activations", "2"], "--offload-activations 2: no micro-batch"),
    (["train", "--preset", "tiny", "--pp", "2", "--nproc", "2", "--microbatches", "1", "--offload-activations", "1"],
     "--offload-activations 1: no micro-batch"),
    (["verify", "--offload-activations", "1"], "--offload-activations 1: no micro-batch"),
    (["simulate", "--zero", "1", "--pp", "1", "--offload-activations", "1"], "--offload-activations 1: no micro-batch"),
    (["simulate", "--zero", "1", "--pp", "2", "--microbatches", "1", "--offload-activations", "1"],
     "--offload-activations 1: no micro-batch of --pp 2 --schedule 1f1b --microbatches 1"),
])
def test_activations_offloaded_where_no_micro_batch_waits_are_refused_before_any_rank_starts(argv, needle, tmp_path,
                                                                                              capsys):
    """One pipeline rank under 1F1B runs each backward right after its forward (and M = 1 anywhere
    holds none across two other actions): nothing would ever be copied, the flag read by nothing."""
    from one_line import assert_one_line, run_main

    out = [] if argv[0] == "simulate" else ["--out", str(tmp_path / "run")]
    assert_one_line(*run_main([*argv, *out], capsys), needle)


def test_simulate_memory_shows_host_activations_where_only_some_ranks_offload(capsys):
    """On the last pipeline rank of 1F1B no micro-batch waits across two actions: its row has no
    host activations while the first rank's has (a KeyError once)."""
    from pipezero.cli import main

    assert main(["simulate", "--memory", "--preset", "tiny", "--pp", "4", "--offload-activations", "1"]) == 0
    out = capsys.readouterr().out
    assert "host_activations" in out and "Traceback" not in out


@pytest.mark.parametrize("argv, needle", [(["--preset", "nope"], "unknown preset 'nope'"),
                                          (["--microbatches", "1"], "--offload-activations 2: no micro-batch")])
def test_the_offload_bench_refuses_bad_arguments_before_its_ranks_start(argv, needle, monkeypatch, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import offload as bench

    monkeypatch.setattr(bench, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    monkeypatch.setattr(sys, "argv", ["offload.py", *argv])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and needle in capsys.readouterr().err
