"""Does `train --layout auto` pick the fastest layout, and is its prediction close?

    python bench/layout_auto.py [--preset tiny] [--nproc 4] [--steps 8] [--seq-len 128] [--rounds 2]
                                [--gpu-memory GIB] [--name layout_auto]

On this machine, `--nproc` CPU ranks: one `train --layout auto` run (its probe, its choice, its
prediction and its measured steps, with --memory-profile so its peak is measured against the limit
it was given), then at least six candidate layouts trained with explicit flags, the pick among
them (the pick again under the same conditions as the others) and its three runners-up. Every
run trains the same global batch; a run's step time is the median of its steps after the first
(what the run's own check compares). The candidates are trained `--rounds` times, round after round
(every layout once, then again), so that a slow minute of a shared host falls on every layout alike;
a layout's figure is the median of its rounds, its spread the lowest and highest. Printed: each layout's measured step and its ratio to the
fastest; the pick's predicted and measured step; the probe's share of a 100-step run. Written:
bench/results/layout_auto/<name>.json (a temporary file renamed into place). The host's cores may be shared
with other jobs: a ranking closer than the run-to-run spread (printed) is within the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipezero.files import atomic_write_json  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "layout_auto"


def candidates(world: int, layers: int) -> list[str]:
    """Layouts of `world` ranks, a global batch of 16, that a user might pick by hand (folklore:
    ZeRO-1 with PP, M a multiple of P, plain data parallelism)."""
    out = [f"--pp 1 --dp {world} --zero {z} --schedule 1f1b --microbatches 1 --micro-batch-size {16 // world}"
           for z in (0, 1, 2, 3)]
    out.append(f"--pp 1 --dp {world} --zero 1 --schedule 1f1b --microbatches {16 // world} --micro-batch-size 1")
    if world % 2 == 0 and layers >= 2:
        half = world // 2
        out += [f"--pp 2 --dp {half} --zero 0 --schedule 1f1b --microbatches {8 // half} --micro-batch-size 2",
                f"--pp 2 --dp {half} --zero 1 --schedule gpipe --microbatches {16 // half} --micro-batch-size 1"]
    if layers >= world:
        out.append(f"--pp {world} --dp 1 --zero 0 --schedule 1f1b --microbatches 8 --micro-batch-size 2")
    return out


def train(argv: list[str], out: Path, args: argparse.Namespace) -> tuple[dict, str, float]:
    """(summary.json, standard output, wall seconds) of one run of `pipezero train`."""
    cmd = [sys.executable, "-m", "pipezero.cli", "train", "--preset", args.preset, "--nproc", str(args.nproc),
           "--seq-len", str(args.seq_len), "--max-steps", str(args.steps), "--out", str(out), "--no-progress",
           "--sample-tokens", "0", "--no-save-final", "--data", args.data, "--tokenizer", "bytes", *argv]
    return run_summary(cmd, out, args.timeout, " ".join(argv))


def run_summary(cmd: list[str], out: Path, timeout: float, what: str) -> tuple[dict, str, float]:
    """(summary.json in `out`, standard output, wall seconds) of a pipezero command; its failure ends
    the bench with the end of its standard error."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          timeout=timeout)
    took = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"bench: {what} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text()), done.stdout, took


def steps_of(out: Path) -> list[float]:
    return [json.loads(x)["step_time_s"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def measured(out: Path) -> float:
    """The median step after the first, as the run's own check takes it."""
    times = steps_of(out)
    return statistics.median(times[1:] or times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--gpu-memory", type=float, default=None, help="the limit given to --layout auto (GiB a rank)")
    ap.add_argument("--data", default=None, help="documents to train on (default: a sample of the standard library)")
    ap.add_argument("--rounds", type=int, default=2, help="times each candidate is trained, round after round")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--name", default="layout_auto")
    args = ap.parse_args()
    from pipezero.config import ModelConfig
    from pipezero.models import apply_preset

    layers = apply_preset(ModelConfig(), args.preset).n_layers
    with tempfile.TemporaryDirectory() as tmp:
        if args.data is None:
            from pipezero.data import write_stdlib_sample

            args.data = str(write_stdlib_sample(Path(tmp) / "corpus"))
        limit = ["--gpu-memory", str(args.gpu_memory)] if args.gpu_memory else []
        summary, stdout, auto_wall = train(["--layout", "auto", "--global-batch", "16", "--memory-profile", *limit],
                                           Path(tmp) / "auto", args)
        choice = summary["layout_choice"]
        print("\n".join(line for line in stdout.splitlines() if line.startswith(("layout auto", "  "))))
        pick = choice["flags"]
        names = list(dict.fromkeys([pick, *(r["flags"] for r in choice["runners_up"]),
                                    *candidates(args.nproc, layers)]))
        predicted = {r["flags"]: r["predicted_step_s"] for r in [choice, *choice["runners_up"]]}
        runs: dict[str, list[dict]] = {flags: [] for flags in names}
        for r in range(args.rounds):
            for i, flags in enumerate(names):
                out = Path(tmp) / f"c{i}r{r}"
                _, _, wall = train(flags.split(), out, args)
                runs[flags].append({"step_s": measured(out), "steps_s": steps_of(out), "wall_s": wall})
                print(f"round {r + 1}: {runs[flags][-1]['step_s']:8.4f} s  {flags}"
                      f"{'   <- pick' if flags == pick else ''}", flush=True)
        rows = [{"flags": flags, "step_s": statistics.median(x["step_s"] for x in done),
                 "spread_s": [min(x["step_s"] for x in done), max(x["step_s"] for x in done)],
                 "rounds": done, "pick": flags == pick, "predicted_s": predicted.get(flags)}
                for flags, done in runs.items()]
        for row in sorted(rows, key=lambda row: row["step_s"]):
            guess = f", predicted {row['predicted_s']:.4f}" if row["predicted_s"] is not None else ""
            print(f"{row['step_s']:8.4f} s ({row['spread_s'][0]:.4f}-{row['spread_s'][1]:.4f}{guess})  {row['flags']}"
                  f"{'   <- pick' if row['pick'] else ''}")
    fastest = min(rows, key=lambda r: r["step_s"])
    pick_row = next(r for r in rows if r["pick"])
    probe_s = choice["costs"].get("probe_s", 0.0) + choice["search"]["seconds"]
    run_100 = probe_s + 100 * choice["measured_step_s"]
    result = {"args": vars(args), "choice": choice, "rows": rows,
              "pick_over_fastest": pick_row["step_s"] / fastest["step_s"],
              "pick_predicted_over_measured": choice["predicted_step_s"] / choice["measured_step_s"],
              "pick_as_candidate_predicted_over_measured": choice["predicted_step_s"] / pick_row["step_s"],
              "probe_and_search_s": probe_s, "probe_share_of_100_steps": probe_s / run_100,
              "peak_gib": {"predicted": choice["predicted_peak_gib"], "measured": choice["measured_peak_gib"],
                           "limit": choice["costs"]["limit_gib"]},
              "auto_run_wall_s": auto_wall}
    print(f"pick / fastest measured: {result['pick_over_fastest']:.3f} (fastest: {fastest['flags']})")
    print(f"pick predicted {choice['predicted_step_s']:.4f} s, measured {choice['measured_step_s']:.4f} s in its own "
          f"run ({result['pick_predicted_over_measured']:.2f}x), {pick_row['step_s']:.4f} s as a candidate")
    print(f"probe and search {probe_s:.2f} s: {result['probe_share_of_100_steps']:.1%} of a 100-step run")
    print(f"peak a rank: predicted {choice['predicted_peak_gib']:.3f} GiB, measured "
          f"{choice['measured_peak_gib'] if choice['measured_peak_gib'] is None else round(choice['measured_peak_gib'], 3)}"
          f" GiB, limit {choice['costs']['limit_gib']:.3g} GiB")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    atomic_write_json(path, result)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
