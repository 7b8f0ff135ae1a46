"""ZeRO's gradient reductions flat (gloo) against `--hierarchical`, D=4 on 2 emulated nodes x 2 ranks.

    python bench/cluster_two_level_zero.py [--rates 100mbit,500mbit] [--reps 2] [--steps 6] [--zero 2]

(as root). P=1, D=4, the block-dominated model of bench/cluster_overlap.py (`--model`), each run
through bench/launch_times.py: plain, or with `--hierarchical` (parallel/hierarchical.py: at ZeRO-2/3
an exchange reduce-scatter inside the node, then across, a node's uplink carrying 0.5x the bucket
where gloo's carries 1.5x; at ZeRO-0/1 a two-level all-reduce, 1x against 1.5x). The two variants
alternate, --reps times each, so the host's load falls on both alike; a run's figure is its fastest
steady step (the first two left out) and its median. Writes bench/results/cluster_two_level_zero/<name>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster_overlap import RESULTS, on_cluster, run_toml  # noqa: E402

VARIANTS = {"flat (gloo)": [], "two-level (--hierarchical)": ["--hierarchical"]}


def run(flags: list[str], toml: Path, out: Path, steps: int, link: str, zero: int) -> dict:
    probe = str(Path(__file__).resolve().parent / "launch_times.py")
    on_cluster(2, 2, link, [probe, "train", *flags, "--config", str(toml), "--pp", "1", "--dp", "4", "--zero",
                            str(zero), "--max-steps", str(steps), "--out", str(out), "--no-save-final"])
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r["step_time_s"] for r in recs[2:]]
    return {"step_s": min(steady), "step_s_median": statistics.median(steady),
            "step_s_all": [r["step_time_s"] for r in recs], "losses": [r["loss"] for r in recs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="100mbit,500mbit")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--model", default="dim=256,n_layers=4,vocab_size=256")
    ap.add_argument("--mbs", type=int, default=8, help="rows a rank a step (one micro-batch)")
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--name", default="cluster_two_level_zero")
    args = ap.parse_args()
    model = {k: int(v) for k, v in (x.split("=") for x in args.model.split(",") if x)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        toml = Path(tmp) / "run.toml"
        toml.write_text(run_toml("tiny", 128, args.bucket_mb, model=model, micro_batch_size=args.mbs, microbatches=1))
        for link in args.rates.split(","):
            for rep in range(args.reps):
                for name, flags in VARIANTS.items():
                    got = run(flags, toml, Path(tmp) / f"{link}_{rep}_{len(flags)}", args.steps, link, args.zero)
                    rows.append({"link": link, "rep": rep, "variant": name, **got})
                    print(f"{link:>8} {name:>25}: fastest step {got['step_s']:.3f} s, median {got['step_s_median']:.3f} s",
                          flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {RESULTS / args.name}.json")


if __name__ == "__main__":
    main()
