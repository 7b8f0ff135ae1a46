"""Tracing a real 4-rank run, the simulator calibrated from that trace, the tracer's bound, and the
TensorBoard view of metrics.jsonl."""

import json
import sys

import pytest
import torch

from pipezero.planner.calibrate import calibrate, predict_step
from pipezero.config import ScheduleKind


@pytest.mark.distributed
@pytest.mark.slow
def test_trace_of_4_rank_1f1b_calibrates(text_dir, tmp_path, capfd):
    """A real 4-rank run's trace: its rows, every rank's compute, and a calibration from it. How near
    the calibrated bubble comes to the measured one is a measured time, the machine's load in it
    (0.102 for 0.10 beside a loaded suite): bench/trace_calibration.py owns that figure, and
    test_calibration_of_a_trace_the_simulator_played_predicts_it_exactly holds the fitting itself."""
    from pipezero.cli import main

    out = tmp_path / "run"  # launched from this process: torchrun and the 4 ranks are processes of their own
    code = main(["train", "--nproc", "4", "--pp", "4", "--dp", "1", "--schedule", "1f1b", "--microbatches", "8",
                 "--data", str(text_dir), "--tokenizer", "bytes", "--seq-len", "64", "--max-steps", "5", "--trace",
                 "--out", str(out), "--no-progress"])
    assert code == 0, capfd.readouterr().err[-3000:]
    trace = json.loads((out / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    ops = {e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"F", "BW", "wait", "optim"} <= ops
    assert (out / "trace.png").read_bytes()[:4] == b"\x89PNG"
    cal = calibrate(out / "trace.json")
    assert cal.steps == 2 and sorted(cal.per_chunk) == [0, 1, 2, 3], cal  # the ring's 3 steps less its first
    assert all(f > 0 and b > 0 for f, b, _ in cal.per_chunk.values()) and 0 < cal.measured_bubble < 1, cal
    _, simulated = predict_step(cal, ScheduleKind.ONE_F_ONE_B, 8, 1)
    assert 0 < simulated < 1, simulated
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["measured_bubble"]) == 4 and len(summary["bytes_sent"]["p2p"]) == 4
    assert all(b > 0 for b in summary["bytes_sent"]["p2p"][:3])  # the last stage sends only gradients


def played_trace(kind: ScheduleKind, pp: int, m: int, v: int, per_chunk: list[tuple[float, float, float]],
                 hop_s: float, steps: int = 3) -> dict:
    """trace.json of a run whose every step played exactly as the simulator plays `kind` on these
    costs (seconds), one step after another, written as the tracer writes compute rows."""
    from pipezero.schedules.check import CostModel, simulate
    from pipezero.schedules.registry import build_schedule

    played = simulate(build_schedule(kind, pp, m, v), CostModel(comm=hop_s, per_chunk=tuple(per_chunk)))
    events = [{"ph": "X", "pid": e.rank, "tid": 0, "cat": e.action.op.value, "name": str(e.action),
               "args": {"step": step}, "ts": (step * 2 * played.step_time + e.start) * 1e6,
               "dur": (e.end - e.start) * 1e6}
              for step in range(1, steps + 1) for e in played.timeline]
    layout = {"pp": pp, "dp": 1, "schedule": kind.value, "microbatches": m, "virtual_stages": v}
    return {"traceEvents": events, "otherData": {"layout": layout}}


@pytest.mark.parametrize("kind, v", [(ScheduleKind.ONE_F_ONE_B, 1), (ScheduleKind.GPIPE, 1),
                                     (ScheduleKind.INTERLEAVED_1F1B, 2)])
def test_calibration_of_a_trace_the_simulator_played_predicts_it_exactly(kind, v, tmp_path):
    """The fit, apart from any machine: each chunk's F and fused backward, the hop, the measured step
    and bubble are read back from a trace the simulator played, and the prediction on the fitted
    costs is that trace's own step and bubble (uneven stages, so a wrong chunk or rank shows)."""
    pp, m = 4, 8
    # F, B, W by rank: uneven stages, a rank's chunks alike (the prediction spreads a rank's cost evenly)
    per_chunk = [(0.001 * (1 + c % pp), 0.001 * (1 + c % pp), 0.0015 * (1 + c % pp)) for c in range(pp * v)]
    (tmp_path / "trace.json").write_text(json.dumps(played_trace(kind, pp, m, v, per_chunk, hop_s=0.0004)))
    cal = calibrate(tmp_path / "trace.json")
    assert cal.steps == 2 and cal.hop_s == pytest.approx(0.0004)
    for c, (f, b, w) in enumerate(per_chunk):  # a fused backward is read as half B, half W
        assert cal.per_chunk[c] == pytest.approx((f, (b + w) / 2, (b + w) / 2)), c
    step, bubble = predict_step(cal, kind, m, v)
    assert step == pytest.approx(cal.measured_step_s) and bubble == pytest.approx(cal.measured_bubble), (step, bubble)
    assert 0.1 < bubble < 0.9


def test_tracer_keeps_a_ring_of_steps_or_only_the_chosen_ones():
    """A long traced run holds (and gathers at its end) a few steps' events, never all of them."""
    from pipezero.telemetry.trace import Tracer

    def run(tracer: Tracer, steps: int = 50, per_step: int = 7) -> list[int]:
        for step in range(1, steps + 1):
            tracer.step = step
            for i in range(per_step):
                with tracer.span(f"0F{i}", "F"):
                    pass
        return [e[5] for e in tracer.events]

    assert run(Tracer(enabled=True, keep_steps=2)) == [49] * 7 + [50] * 7
    assert run(Tracer(enabled=True, only_steps=frozenset({3, 10}))) == [3] * 7 + [10] * 7
    assert run(Tracer(enabled=False)) == []
    with pytest.raises(ValueError, match="at least one step"):
        Tracer(enabled=True, keep_steps=0)


def test_tensorboard_holds_the_metrics_jsonl_records(text_dir, tmp_path):
    """One process, 4 steps: every scalar read back from the event file equals metrics.jsonl."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipezero.settings import build_config
    from pipezero.engine import train
    from pipezero.telemetry.tensorboard import TAGS

    cfg = build_config(None, {"data.path": str(text_dir), "data.tokenizer": "bytes", "data.seq_len": 32,
                              "run.max_steps": 4, "run.eval_every": 2, "run.sample_tokens": 0, "run.progress": False,
                              "run.out": str(tmp_path), "run.tensorboard": True})
    train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(TAGS.values()) <= set(acc.Tags()["scalars"]) and "ranks/bubble/rank0" in acc.Tags()["scalars"]
    for key, tag in TAGS.items():
        logged = {e.step: e.value for e in acc.Scalars(tag)}
        want = {r["step"]: r[key] for r in lines if key in r}
        assert set(logged) == set(want) and want, key
        assert all(logged[s] == pytest.approx(v, rel=1e-6) for s, v in want.items()), key  # float32 in the file
    assert sorted({e.step for e in acc.Scalars("train/heldout_loss")}) == [2, 4]


def test_tensorboard_missing_is_one_clear_line(monkeypatch, capsys):
    from pipezero.cli import main

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    assert main(["train", "--tensorboard", "--max-steps", "1", "--tokenizer", "bytes", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "pipezero: error: --tensorboard needs the tensorboard package: pip install tensorboard"


def _traced_zero2(rank: int, world: int, data: str, out: str) -> None:
    from training import train_cases

    train_cases(rank, world, data, out, [{"pp": 1, "dp": 2, "kind": ScheduleKind.ONE_F_ONE_B, "m": 2,
                                          "parallel.zero": 2, "parallel.grad_reduce": "microbatch",
                                          "run.trace": True, "run.trace_steps": 1}])


@pytest.mark.distributed
def test_collective_waits_are_named_by_the_program_instructions_that_started_them(text_dir, tmp_path):
    """The runtime plays the compiled program: rank 0's traced waits on gradient reductions, in order,
    are the REDUCE_GRAD instructions of its program (compiled here, in the test process, as every
    rank compiles it), and every other collective wait names an UNSHARD or OPTIM_STEP."""
    import re

    from training import STEPS, tiny_overrides

    from pipezero.models import spec_of
    from ranks import run_ranks
    from pipezero.schedules.program import DataParallel, Kind, flat
    from pipezero.settings import build_config
    from pipezero.stage import plan_of

    run_ranks(_traced_zero2, 2, str(text_dir), str(tmp_path), timeout=300)
    trace = json.loads((tmp_path / "case0" / "trace.json").read_text())
    waits = [e["name"] for e in trace["traceEvents"]
             if e.get("ph") == "X" and e["pid"] == 0 and e["tid"] == 2 and e["args"]["step"] == STEPS]
    assert waits and all(re.match(r"(REDUCE_GRAD|UNSHARD)\(\d+\.\d+\): |OPTIM_STEP: ", w) for w in waits), waits

    cfg = build_config(None, tiny_overrides(str(text_dir), str(tmp_path / "x"), 1, 2, ScheduleKind.ONE_F_ONE_B, 2,
                                            **{"parallel.zero": 2, "parallel.grad_reduce": "microbatch"}))
    plan, _ = plan_of(cfg, spec_of(cfg.model))
    program, sizes = plan.program, plan.buckets.buckets(0)
    expected = [f"REDUCE_GRAD({i.chunk}.{i.bucket})" for i in flat(program.ranks[0])  # those inside BW too
                if isinstance(i, DataParallel) and i.kind is Kind.REDUCE_GRAD]
    assert len(sizes) > 2 and len(expected) == 2 * len(sizes)  # two backwards, each reducing every bucket
    assert [w.split(":")[0] for w in waits if w.startswith("REDUCE_GRAD")] == expected
