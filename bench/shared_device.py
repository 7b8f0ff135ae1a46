"""What the shared-GPU staging path costs: one layout trained with `--share-device off` and `on`,
alternately, in one process group of CPU ranks, and each step's time read from the runs' metrics.

On CPU ranks `on` copies every sent and received tensor into a buffer of its own and back
(parallel/staging.py), so the difference is the copies' cost, not a GPU's (where the copies cross
PCIe on a stream of their own, and gloo, not NCCL, carries the bytes either way).

    python bench/shared_device.py                       # P1 D2 ZeRO-2, small preset
    python bench/shared_device.py --pp 2 --dp 1 --zero 0 --json /tmp/s.json
    python bench/shared_device.py --collective-mb 25     # one all-reduce, direct beside staged

A step's time on a busy machine moves by more than the copies cost; `--collective-mb` isolates them:
an all-reduce of that many MB between 2 ranks, direct and staged alternately, many times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rank_spawner import run_ranks


def settings(args: argparse.Namespace, share: str, out: str) -> dict:
    return {"model.preset": args.preset, "data.seq_len": args.seq_len, "data.tokenizer": "bytes",
            "data.max_bytes": 2_000_000, "parallel.pp": args.pp, "parallel.dp": args.dp, "parallel.zero": args.zero,
            "parallel.microbatches": args.microbatches, "parallel.micro_batch_size": args.micro_batch_size,
            "run.device": "cpu", "run.share_device": share, "run.max_steps": args.steps, "run.out": out,
            "run.progress": False, "run.quiet": True, "run.eval_every": 0, "run.eval_batches": 1,
            "run.sample_tokens": 0, "run.save_final": False}


def train_both(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    from pipezero.engine import train
    from pipezero.settings import build_config

    for k in range(args.repeats):  # alternately, so a change in the machine's load falls on both
        for share in ("off", "on"):
            train(build_config(None, settings(args, share, f"{out}/{share}{k}")))


def time_all_reduce(rank: int, world: int, mb: float, repeats: int) -> dict[str, float]:
    import torch

    from pipezero.parallel.staging import Direct, Staged
    from pipezero.parallel.waits import wait_or_raise

    t = torch.ones(int(mb * 2**20) // 4)
    ways = {"off": Direct(), "on": Staged()}
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):
        for share, way in ways.items():
            t0 = time.perf_counter()
            wait_or_raise(way.all_reduce(t, None), 60, f"rank {rank}: all-reduce ({share})")
            times[share].append(time.perf_counter() - t0)
    return {share: statistics.median(ts) for share, ts in times.items()}


def step_times(folder: Path) -> list[float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_time_s"] for r in rows if "step_time_s" in r][1:]  # the first step allocates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--collective-mb", type=float, default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.collective_mb:
        got = run_ranks(time_all_reduce, 2, args.collective_mb, 20 * args.repeats, timeout=600)[0]
        print(f"all-reduce of {args.collective_mb:g} MB between 2 CPU ranks: median {got['off'] * 1e3:.1f} ms direct, "
              f"{got['on'] * 1e3:.1f} ms staged ({(got['on'] - got['off']) * 1e3:+.1f} ms, "
              f"{got['on'] / got['off']:.3f}x)")
        return 0
    with tempfile.TemporaryDirectory() as out:
        run_ranks(train_both, args.pp * args.dp, args, out, timeout=1800)
        times = {share: [t for k in range(args.repeats) for t in step_times(Path(out) / f"{share}{k}")]
                 for share in ("off", "on")}
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    report = {"layout": f"P{args.pp} D{args.dp} ZeRO-{args.zero} {args.preset} T={args.seq_len} "
                        f"{args.microbatches}x{args.micro_batch_size}", "step_s": {"off": off, "on": on},
              "extra_s": on - off, "ratio": on / off, "steps": times, "date": time.strftime("%Y-%m-%d")}
    print(f"{report['layout']}: median step {off * 1e3:.1f} ms direct, {on * 1e3:.1f} ms staged "
          f"({(on - off) * 1e3:+.1f} ms, {on / off:.3f}x) over {len(times['off'])} and {len(times['on'])} steps; "
          f"{time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
