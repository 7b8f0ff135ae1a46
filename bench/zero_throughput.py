"""Step time of each ZeRO stage beside torch's DistributedDataParallel, and how much of the
communication hides behind compute.

    python bench/zero_throughput.py [--preset small] [--dp 2] [--microbatches 4] [--steps 6]

All runs use the same model, batches and D ranks (one thread each) in one process group: torch DDP
(`DistributedDataParallel` + `torch.optim.AdamW`), then pipezero at ZeRO 0-3. For pipezero, the
exposed communication is the time a rank spent blocked on ZeRO collectives (traced), and the total is
the same collectives timed alone on idle ranks; hidden share = 1 - exposed / total.
Writes bench/results/zero_throughput/zero_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # rank_spawner.py

from rank_spawner import run_ranks  # noqa: E402


def config(args: argparse.Namespace, zero: int):
    from pipezero.settings import build_config

    return build_config(None, {
        "model.preset": args.preset, "data.seq_len": args.seq_len, "data.tokenizer": "bytes",
        "data.max_bytes": 3_000_000, "parallel.dp": args.dp, "parallel.zero": zero,
        "parallel.microbatches": args.microbatches, "parallel.micro_batch_size": args.micro_batch_size,
        "run.progress": False, "run.threads": 1, "run.trace": True, "run.save_final": False,
    })


def batches_for(cfg, rank: int, steps: int) -> list:
    from pipezero.data import global_batch, load_corpus, microbatches_for_rank

    corpus = load_corpus(cfg.data)
    return [microbatches_for_rank(global_batch(corpus.train, s, 0, cfg.global_batch, cfg.data.seq_len), rank,
                                  cfg.parallel.dp, cfg.parallel.microbatches) for s in range(steps)]


def time_ddp(args: argparse.Namespace, rank: int) -> list[float]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from pipezero.models import build_chunk, lm_loss

    cfg = config(args, 0)
    model = DistributedDataParallel(build_chunk(cfg.model, 0, cfg.model.n_layers + 2, 0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    denom = cfg.global_batch * cfg.data.seq_len
    times = []
    for mbs in batches_for(cfg, rank, args.steps):
        t0 = time.perf_counter()
        for i, (x, y) in enumerate(mbs):
            if i < len(mbs) - 1:
                with model.no_sync():  # accumulate locally, reduce with the last micro-batch
                    lm_loss(model(x), y, denom).backward()
            else:
                lm_loss(model(x), y, denom).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


def time_zero(args: argparse.Namespace, rank: int, zero: int) -> dict:
    from pipezero.stage import build_stage

    cfg = config(args, zero)
    stage = build_stage(cfg, rank)
    denom = cfg.global_batch * cfg.data.seq_len
    times, exposed = [], []
    for step, mbs in enumerate(batches_for(cfg, rank, args.steps)):
        stage.tracer.step = step
        stage.zero.begin_step()
        t0 = time.perf_counter()
        stage.executor.run(stage.program, mbs, denom, lambda loss: stage.zero.step(1e-4, 1.0, stage.groups.world))
        times.append(time.perf_counter() - t0)
        exposed.append(sum(e[4] - e[3] for e in stage.tracer.events if e[5] == step and e[2] == "collectives"))
    # The same collectives alone: every bucket reduced (and gathered back) with nothing else running.
    import torch.distributed as dist

    alone = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for b in stage.zero.all_buckets():
            g = b.flat.new_zeros(b.padded)
            if zero == 0 or zero == 1:
                dist.all_reduce(g, group=stage.groups.dp)
            else:
                out = g.new_empty(b.shard_size)
                dist.reduce_scatter_single(out, g, group=stage.groups.dp)
            if zero in (1, 2):
                dist.all_gather_single(g, g[b.shard].clone(), group=stage.groups.dp)
            if zero == 3:
                dist.all_gather_single(g, g[b.shard].clone(), group=stage.groups.dp)  # forward
                dist.all_gather_single(g, g[b.shard].clone(), group=stage.groups.dp)  # backward
        alone.append(time.perf_counter() - t0)
    return {"step_s": times[1:], "exposed_comm_s": exposed[1:], "comm_alone_s": min(alone)}


def bench_rank(rank: int, world: int, args: argparse.Namespace) -> dict:
    out = {"ddp": time_ddp(args, rank)}
    for zero in (0, 1, 2, 3):
        out[f"zero{zero}"] = time_zero(args, rank, zero)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    per_rank = run_ranks(bench_rank, args.dp, args, timeout=3000, threads=1)
    tokens = args.microbatches * args.micro_batch_size * args.seq_len * args.dp
    ddp = max(statistics.fmean(r["ddp"]) for r in per_rank)
    rows = {"ddp": {"step_s": ddp, "tokens_per_s": tokens / ddp}}
    print(f"{args.preset}, D={args.dp}, M={args.microbatches}, B={args.micro_batch_size}, T={args.seq_len}, "
          f"1 thread a rank")
    print(f"{'run':8}{'step s':>9}{'tok/s':>9}{'vs DDP':>8}{'exposed comm s':>16}{'comm alone s':>14}{'hidden':>8}")
    print(f"{'DDP':8}{ddp:9.3f}{tokens / ddp:9,.0f}{1.0:8.2f}")
    for zero in (0, 1, 2, 3):
        key = f"zero{zero}"
        step = max(statistics.fmean(r[key]["step_s"]) for r in per_rank)
        exposed = max(statistics.fmean(r[key]["exposed_comm_s"]) for r in per_rank)
        alone = max(r[key]["comm_alone_s"] for r in per_rank)
        hidden = max(0.0, 1 - exposed / alone) if alone else 0.0
        rows[key] = {"step_s": step, "tokens_per_s": tokens / step, "ddp_over_ours_time": ddp / step,
                     "exposed_comm_s": exposed, "comm_alone_s": alone, "hidden_share": hidden}
        print(f"{key:8}{step:9.3f}{tokens / step:9,.0f}{ddp / step:8.2f}{exposed:16.4f}{alone:14.4f}{hidden:8.1%}")
    out = Path(__file__).parent / "results" / "zero_throughput" / "zero_throughput.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "runs": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
