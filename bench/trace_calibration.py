"""Tracing's cost, and the simulator calibrated from a trace against the measured run.

    python bench/trace_calibration.py [--preset tiny] [--pp 4] [--microbatches 8] [--steps 12] [--repeats 2]

Runs the same `pipezero train --nproc P --pp P` job with tracing off and on, alternating, and
compares the mean step time (steps after the first). Then fits the cost model to the last trace
(`pipezero simulate --from-trace`) and prints the measured bubble beside the calibrated prediction.
Writes bench/results/trace_calibration/trace_calibration.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipezero.config import ScheduleKind  # noqa: E402
from pipezero.planner.calibrate import calibrate, predict_step  # noqa: E402


def run(args: argparse.Namespace, out: Path, trace: bool) -> float:
    cmd = [sys.executable, "-m", "pipezero.cli", "train", "--preset", args.preset, "--nproc", str(args.pp),
           "--pp", str(args.pp), "--dp", "1", "--schedule", args.schedule, "--microbatches", str(args.microbatches),
           "--max-steps", str(args.steps), "--tokenizer", "bytes", "--eval-every", "0", "--sample-tokens", "0",
           "--out", str(out), "--no-progress", "--no-save-final"] + (["--trace"] if trace else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    times = [json.loads(x)["step_time_s"] for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
    return statistics.fmean(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            off.append(run(args, Path(tmp) / f"off{i}", False))
            on.append(run(args, Path(tmp) / f"on{i}", True))
        cal = calibrate(Path(tmp) / f"on{args.repeats - 1}" / "trace.json")
    _, simulated = predict_step(cal, ScheduleKind(args.schedule), args.microbatches, 1)
    result = {"args": vars(args), "step_s_trace_off": off, "step_s_trace_on": on,
              "overhead": statistics.fmean(on) / statistics.fmean(off) - 1,
              "measured_bubble": cal.measured_bubble, "calibrated_bubble": simulated,
              "measured_step_s": cal.measured_step_s, "hop_s": cal.hop_s}
    print(f"{args.preset} P={args.pp} M={args.microbatches} {args.schedule}: step time trace off "
          f"{statistics.fmean(off) * 1e3:.1f} ms, on {statistics.fmean(on) * 1e3:.1f} ms "
          f"(overhead {result['overhead']:+.1%}; runs off {[round(x * 1e3, 1) for x in off]}, "
          f"on {[round(x * 1e3, 1) for x in on]} ms)")
    print(f"bubble measured {cal.measured_bubble:.1%}, simulator calibrated on the same trace {simulated:.1%} "
          f"(difference {abs(simulated - cal.measured_bubble) * 100:.1f} points)")
    out = Path(__file__).parent / "results" / "trace_calibration" / "trace_calibration.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
