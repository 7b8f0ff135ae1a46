"""Checkpoint write and read time, size, and resharding between ZeRO stages.

    python bench/checkpoint_io.py [--preset base] [--dp 2]

On D ranks (P = 1), for each ZeRO stage: build the stage, save a checkpoint (every rank writes its
own shard ranges through torch.distributed.checkpoint, then the ranks hash the files between them
and rank 0 commits), then load it into every other ZeRO stage (a reshard of the optimizer state
and parameters) and check that the loaded parameters equal the saved ones. Reports seconds, MB/s
and the bytes each rank wrote. Writes bench/results/checkpoint_io/checkpoint_io.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # rank_spawner.py

from rank_spawner import run_ranks  # noqa: E402


def measure(rank: int, world: int, preset: str, root: str) -> list[dict]:
    import torch
    import torch.distributed as dist

    from pipezero.checkpoint.state import load, save
    from pipezero.checkpoint.store import Team, latest
    from pipezero.settings import build_config
    from pipezero.stage import build_stage

    def cfg(zero: int, out: str):
        return build_config(None, {"model.preset": preset, "parallel.dp": world, "parallel.zero": zero,
                                   "run.out": out, "run.progress": False, "run.keep_checkpoints": 1})

    rows = []
    for zero in (0, 1, 3):
        out = f"{root}/z{zero}"
        c = cfg(zero, out)
        stage = build_stage(c, rank)
        with torch.no_grad():  # non-trivial optimizer state, different from a fresh stage's
            for st in stage.zero.opt.states:
                st.exp_avg.fill_(0.5)
                st.exp_avg_sq.fill_(0.25)
        stage.zero.gather_all()
        saved = {n: q.detach().clone() for m in stage.chunks.values() for n, q in m.named_parameters()}
        stage.zero.release_all()
        dist.barrier()
        t0 = time.perf_counter()
        path = save(c, stage.zero, 1, 0)
        dist.barrier()
        write_s = time.perf_counter() - t0
        mine = sum(f.stat().st_size for f in path.glob(f"__{rank}_*.distcp"))
        total = sum(f.stat().st_size for f in path.iterdir())
        del stage
        gc.collect()  # ZeRO hooks make reference cycles: free the stage before building the next
        for target in (0, 1, 3):
            c2 = cfg(target, out)
            fresh = build_stage(c2, rank)
            dist.barrier()
            t0 = time.perf_counter()
            load(latest(Path(out) / "checkpoints", Team.current(1)), c2, fresh.zero)
            dist.barrier()
            read_s = time.perf_counter() - t0
            fresh.zero.gather_all()
            same = all(torch.equal(q, saved[n]) for m in fresh.chunks.values() for n, q in m.named_parameters())
            moments = all(bool((st.exp_avg == 0.5).all()) for st in fresh.zero.opt.states)
            fresh.zero.release_all()
            del fresh
            gc.collect()
            rows.append({"saved_zero": zero, "loaded_zero": target, "write_s": write_s, "read_s": read_s,
                         "checkpoint_bytes": total, "bytes_written_by_rank": mine, "params_equal": same,
                         "moments_equal": moments})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="base")
    ap.add_argument("--dp", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))  # freed stages leave the process (launch.py)
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as root:
        per_rank = run_ranks(measure, args.dp, args.preset, root, timeout=1800)
    rows = per_rank[0]
    for r, rank_rows in enumerate(per_rank):
        for row, other in zip(rows, rank_rows):
            row.setdefault("bytes_written_per_rank", []).append(other["bytes_written_by_rank"])
            row["params_equal"] &= other["params_equal"]
            row["moments_equal"] &= other["moments_equal"]
    print(f"{args.preset}, D={args.dp}, P=1: checkpoint = parameters + 2 AdamW moments, fp32")
    print(f"{'saved':>6} {'loaded':>7} {'size MB':>8} {'write s':>8} {'MB/s':>7} {'read s':>7} {'MB/s':>7} "
          f"{'per-rank MB':>14} {'equal':>6}")
    for r in rows:
        mb = r["checkpoint_bytes"] / 1e6
        per = "/".join(f"{b / 1e6:.0f}" for b in r["bytes_written_per_rank"])
        print(f"{r['saved_zero']:>6} {r['loaded_zero']:>7} {mb:>8.0f} {r['write_s']:>8.2f} {mb / r['write_s']:>7.0f} "
              f"{r['read_s']:>7.2f} {mb / r['read_s']:>7.0f} {per:>14} {str(r['params_equal'] and r['moments_equal']):>6}")
    out = Path(__file__).parent / "results" / "checkpoint_io" / "checkpoint_io.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "dp": args.dp, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
