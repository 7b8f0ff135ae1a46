"""Tracing a real 4-rank run, and the simulator calibrated from that trace."""

import json
import subprocess
import sys

import pytest

from pipezero.sim.calibrate import calibrate, predict
from pipezero.config import ScheduleKind


@pytest.mark.slow
def test_trace_of_4_rank_1f1b_and_calibrated_bubble(text_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipezero.cli", "train", "--nproc", "4", "--pp", "4", "--dp", "1",
           "--schedule", "1f1b", "--microbatches", "8", "--data", str(text_dir), "--tokenizer", "bytes",
           "--seq-len", "64", "--max-steps", "5", "--trace", "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = json.loads((out / "trace.json").read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)}
    ops = {e["cat"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"F", "BW", "wait", "optim"} <= ops
    assert (out / "trace.png").read_bytes()[:4] == b"\x89PNG"
    cal = calibrate(out / "trace.json")
    _, simulated = predict(cal, ScheduleKind.ONE_F_ONE_B, 8, 1)
    assert abs(simulated - cal.measured_bubble) < 0.10, (simulated, cal.measured_bubble)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["measured_bubble"]) == 4 and len(summary["bytes_sent"]["p2p"]) == 4
    assert all(b > 0 for b in summary["bytes_sent"]["p2p"][:3])  # the last stage sends only gradients


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
