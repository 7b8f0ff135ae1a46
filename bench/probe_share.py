"""How much of a run does `train --layout auto`'s probe take? Issue 44 asks under 10% of a 100-step run.

    python bench/probe_share.py [--presets tiny,small] [--nproc 4] [--steps 8] [--runs 2] [--name probe_share]

For each preset, `--runs` times: one `train --layout auto --nproc N --global-batch 16 --layout-trials 0`
run of --steps steps on this machine (bytes tokens from the built-in corpus, 128 tokens, one thread a
rank, as the other layout benches). Its summary.json says what the probe took inside the job
(`layout_choice.costs.probe_s`: the links, the cores, the block on every rank and rank 0's own
figures, the search excluded) and its measured step (the median after the first); printed and
written: probe_s / (100 x measured step), the share of a 100-step run, and the load average at each
run's start (a probe is wall time on a host others may share). The search's seconds are beside it.
Written: bench/results/probe_share/<name>.json (a temporary file renamed into place).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cluster_overlap import run_toml  # noqa: E402
from layout_auto import run_summary  # noqa: E402
from pipezero.files import atomic_write_json  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "probe_share"


def one_run(preset: str, args: argparse.Namespace, tmp: Path, i: int) -> dict:
    """One auto run's probe, search and measured step."""
    toml = tmp / f"{preset}.toml"
    toml.write_text(run_toml(preset, args.seq_len, args.bucket_mb))
    out = tmp / f"{preset}_{i}"
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "pipezero.cli", "train", "--config", str(toml), "--nproc", str(args.nproc),
           "--layout", "auto", "--global-batch", str(args.global_batch), "--layout-trials", "0",
           "--max-steps", str(args.steps), "--out", str(out), "--no-save-final"]
    summary, _, wall = run_summary(cmd, out, args.timeout, f"{preset} --layout auto")
    choice = summary["layout_choice"]
    probe_s = choice["costs"]["probe_s"]
    step_s = choice["measured_step_s"]
    return {"preset": preset, "flags": choice["flags"], "probe_s": probe_s, "search_s": choice["search"]["seconds"],
            "measured_step_s": step_s, "predicted_step_s": choice["predicted_step_s"],
            "share_of_100_steps": probe_s / (100 * step_s), "load_at_start": load, "wall_s": wall,
            "costs": choice["costs"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2, help="auto runs a preset, one after another")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--name", default="probe_share")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            for i in range(args.runs):
                row = one_run(preset, args, Path(tmp), i)
                rows.append(row)
                print(f"{preset} run {i + 1}: probe {row['probe_s']:.2f} s, search {row['search_s']:.2f} s, step "
                      f"{row['measured_step_s']:.3f} s measured ({row['predicted_step_s']:.3f} predicted): "
                      f"{row['share_of_100_steps']:.1%} of a 100-step run (load {row['load_at_start']:.1f}; "
                      f"pick {row['flags']})", flush=True)
    summary = {p: statistics.median(r["share_of_100_steps"] for r in rows if r["preset"] == p)
               for p in args.presets.split(",")}
    print("median share of a 100-step run: " + ", ".join(f"{p} {s:.1%}" for p, s in summary.items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    atomic_write_json(path, {"args": vars(args), "runs": rows, "median_share": summary})
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
