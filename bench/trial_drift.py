"""How many steps does a layout built inside a running job take to reach its steady step?

    python bench/trial_drift.py --rate 1gbit [--nodes 2 --per-node 2] [--steps 10] [--rounds 3]
        [--layouts "FLAGS;FLAGS;..."] [--name trial_drift]

(as root). On a fresh `pipezero cluster` of --nodes x --per-node ranks at --rate, one process group
builds each layout of --layouts in turn, trains --steps steps of it as `--layout auto`'s trials do
(planner/auto_trials.py: Trainer.set_up(trial=True), the run's data from step 0), drops it, and
builds the next: round after round (A B C A B C ...), so a layout is seen first in the process,
after another layout, and again after itself has run. Each step's time is the slowest rank's (a
MAX over the ranks after the rounds, so the measurement adds no collective between steps). Printed:
a row per (round, layout) with its set-up seconds and every step; the median of steps 2.. and 4..
of each layout per round; written: bench/results/trial_drift/<name>.json (temp file, renamed).
On a shared host compare shapes (how many steps until steady, which layout is faster in each
round) rather than absolute times; the load is printed beside them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from pipezero.files import atomic_write_json  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "trial_drift"
# the 1 Gbit near-ties of bench/results/layout_auto_cluster/layout_auto_cluster_trials.json, whose
# trials ranked them opposite to their own runs
LAYOUTS = ("--pp 4 --dp 1 --zero 0 --schedule gpipe --microbatches 4 --micro-batch-size 4;"
           "--pp 4 --dp 1 --zero 0 --schedule zb-h2 --microbatches 4 --micro-batch-size 4;"
           "--pp 2 --dp 2 --zero 1 --schedule 1f1b --microbatches 4 --micro-batch-size 2")


def on_rank(args: argparse.Namespace) -> None:
    """Every rank: the rounds of builds and steps; rank 0 writes what the slowest rank measured."""
    import torch
    import torch.distributed as dist

    from layout_auto_cluster import layout_of
    from pipezero.engine import Trainer
    from pipezero.planner.auto import layout_settings
    from pipezero.settings import build_config

    flags = args.layouts.split(";")
    quiet = {"run.max_steps": str(args.steps + 1), "run.eval_every": "0", "run.checkpoint_every": "0",
             "run.save_final": False, "run.sample_tokens": "0", "run.trace": False, "run.quiet": True,
             "run.progress": False, "run.memory_profile": False}
    rows = []
    for r in range(args.rounds):
        for i, f in enumerate(flags):
            out = Path(args.scratch) / f"r{r}l{i}"
            cfg = build_config(args.toml, {**layout_settings(layout_of(f)), **quiet, "run.out": str(out)}, {})
            t0 = time.perf_counter()
            trainer = Trainer.set_up(cfg, trial=True)
            set_up = time.perf_counter() - t0
            steps = [trainer.step(s)["step_time_s"] for s in range(args.steps)]
            trainer.stage.zero.settle("end of trial")
            trainer.stop_watch()
            del trainer
            gc.collect()
            rows.append((r, i, set_up, steps))
    flat = torch.tensor([x for _, _, s, st in rows for x in (s, *st)], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return
    n, got = args.steps + 1, flat.tolist()
    done = [{"round": r, "flags": flags[i], "set_up_s": got[k * n], "steps_s": got[k * n + 1:(k + 1) * n]}
            for k, (r, i, _, _) in enumerate(rows)]
    Path(args.json).write_text(json.dumps(done))


def table(done: list[dict], flags: list[str]) -> str:
    """A row per (round, layout): set-up, each step, medians of steps 2.. and 4.. (1-based)."""
    lines = []
    for d in done:
        st = d["steps_s"]
        lines.append(f"r{d['round'] + 1} L{flags.index(d['flags'])} set-up {d['set_up_s']:5.2f} s | "
                     + " ".join(f"{x:.3f}" for x in st)
                     + f" | med2.. {statistics.median(st[1:]):.3f} med4.. {statistics.median(st[3:]):.3f}"
                     + f" min {min(st[1:]):.3f}")
    lines += [f"L{i}: {f}" for i, f in enumerate(flags)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default=LAYOUTS, help="train flags of each layout, ';' between them")
    ap.add_argument("--name", default="trial_drift")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # inside the job
    ap.add_argument("--toml", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        on_rank(args)
        return
    from cluster_overlap import on_cluster, run_toml

    with tempfile.TemporaryDirectory() as tmp:
        toml = Path(tmp) / "run.toml"
        toml.write_text(run_toml(args.preset, args.seq_len, 1.0, model={"n_layers": args.layers}))
        got = Path(tmp) / "got.json"
        argv = [str(Path(__file__).resolve()), "--rank", "--toml", str(toml), "--scratch", tmp, "--json", str(got),
                "--steps", str(args.steps), "--rounds", str(args.rounds), "--layouts", args.layouts]
        load = os.getloadavg()
        on_cluster(args.nodes, args.per_node, args.rate, argv, timeout=1800)
        done = json.loads(got.read_text())
    flags = args.layouts.split(";")
    print(f"{args.rate}, {args.nodes} x {args.per_node} ranks; load before {load[0]:.2f}, after "
          f"{os.getloadavg()[0]:.2f}")
    print(table(done, flags))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    atomic_write_json(path, {"args": vars(args), "load": load, "runs": done})
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
