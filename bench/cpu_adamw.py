"""AdamW's step on the CPU, the work `--offload optimizer` moves off the device: parameters updated a
second by pipezero's ShardedAdamW (zero/adamw.py: torch's fused kernel over flat fp32 shards, two
lists of views a step, the decayed ranges and the rest) beside torch.optim.AdamW, foreach and fused,
on the same parameters, in the same run, one thread and all threads; and the host-to-host copy of
one bucket, the CPU stand-in for offload's copies between device and host (without a GPU there is
no PCIe to time).

    python bench/cpu_adamw.py [--buckets 4] [--bucket-mb 25] [--repeats 7]
        [--json bench/results/cpu_adamw/cpu_adamw.json]

The parameters are `--buckets` flat fp32 buckets of `--bucket-mb` MiB (train's default bucket);
torch's AdamW gets the same elements as separate tensors of `--tensor-mib` each (a model's
parameters: torch steps a list of them). Each measurement is the median over `--repeats` steps after
one warm-up step (the least is kept too), and the optimizers take turns step by step, so a machine shared with other work
slows them alike. The planner's default CPU AdamW rate (memory/offload.py) is this bench's
all-threads ShardedAdamW figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NORM_GAINS = 4096  # elements at a bucket's end outside weight decay (norm gains, as a block's)


def sharded_step(buckets: int, numel: int) -> Callable[[], None]:
    """One step of pipezero's ShardedAdamW over `buckets` flat shards of `numel` elements."""
    import torch

    from pipezero.config import OptimConfig
    from pipezero.zero.adamw import ShardedAdamW

    opt = ShardedAdamW(OptimConfig())
    params = [torch.randn(numel) for _ in range(buckets)]
    grads = [torch.randn(numel) for _ in range(buckets)]
    for _ in range(buckets):
        opt.add_shard(numel, [(0, numel - NORM_GAINS)])
    return lambda: opt.step(params, grads, 1e-4)


def torch_step(buckets: int, numel: int, tensor_numel: int, fused: bool) -> Callable[[], None]:
    """One step of torch.optim.AdamW (fused, else foreach) over the same elements as tensors of
    `tensor_numel`, decayed but for one group of norm-gain-sized tensors a bucket."""
    import torch

    total = buckets * numel
    sizes = [tensor_numel] * (total // tensor_numel) + ([total % tensor_numel] if total % tensor_numel else [])
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    gains = [torch.nn.Parameter(torch.randn(NORM_GAINS)) for _ in range(buckets)]
    for p in gains:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([{"params": params}, {"params": gains, "weight_decay": 0.0}], lr=1e-4,
                            fused=fused, foreach=None if fused else True)
    return opt.step


def copy_step(numel: int) -> Callable[[], None]:
    """One host-to-host copy of a bucket (`numel` fp32 elements) into a buffer kept for it."""
    import torch

    src, dst = torch.randn(numel), torch.empty(numel)
    return lambda: dst.copy_(src)


def timed(steps: dict[str, Callable[[], None]], repeats: int) -> dict[str, tuple[float, float]]:
    """(median, least) seconds a call of each of `steps`, taking turns (one warm-up call each first):
    on a machine others share, the least is the step with the fewest interruptions."""
    for f in steps.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats):
        for k, f in steps.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def measure(args: argparse.Namespace, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    numel = int(args.bucket_mb * 2**20 / 4)  # fp32 elements a bucket, as schedules/bucket_plan.py counts them
    tensor_numel = int(args.tensor_mib * 2**20 / 4)
    total = args.buckets * numel
    steps = {"pipezero ShardedAdamW (fused, flat shards)": sharded_step(args.buckets, numel),
             "torch.optim.AdamW fused": torch_step(args.buckets, numel, tensor_numel, True),
             "torch.optim.AdamW foreach": torch_step(args.buckets, numel, tensor_numel, False)}
    secs = timed(steps, args.repeats)
    rates = {k: total / s[0] for k, s in secs.items()}  # from the median step
    ours = rates["pipezero ShardedAdamW (fused, flat shards)"]
    copy_s, copy_best = timed({"copy": copy_step(numel)}, args.repeats * 3)["copy"]
    return {"threads": threads, "params": total,
            "adamw": {k: {"step_s": secs[k][0], "params_per_s": rates[k], "best_step_s": secs[k][1],
                          "best_params_per_s": total / secs[k][1]} for k in steps},
            "ratio_vs_torch_fused": ours / rates["torch.optim.AdamW fused"],
            "ratio_vs_torch_foreach": ours / rates["torch.optim.AdamW foreach"],
            # read and written: a copy moves 2 x 4 bytes an element through memory; quoted as the
            # bucket's bytes a second (what a copy to or from the device would carry)
            "bucket_copy": {"bytes": numel * 4, "s": copy_s, "gb_per_s": numel * 4 / copy_s / 1e9,
                            "best_gb_per_s": numel * 4 / copy_best / 1e9}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", type=int, default=4, help="flat fp32 buckets updated a step")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="MiB of fp32 a bucket (train's --bucket-mb)")
    ap.add_argument("--tensor-mib", type=float, default=4.0, help="MiB of fp32 a tensor torch's AdamW steps")
    ap.add_argument("--repeats", type=int, default=7, help="timed steps each (the median is kept)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "cpu_adamw" / "cpu_adamw.json"))
    args = ap.parse_args()
    import torch

    cores = os.cpu_count() or 1
    rows = [measure(args, 1)] + ([measure(args, cores)] if cores > 1 else [])
    for r in rows:
        print(f"{r['threads']} thread{'s' if r['threads'] > 1 else ''}, {r['params'] / 1e6:.1f}M params:")
        for k, v in r["adamw"].items():
            print(f"  {k:44s} {v['params_per_s'] / 1e6:8.1f} M params/s  ({v['step_s'] * 1e3:.1f} ms a step; "
                  f"best {v['best_params_per_s'] / 1e6:.1f} M/s)")
        print(f"  ShardedAdamW / torch fused {r['ratio_vs_torch_fused']:.2f}x, / torch foreach "
              f"{r['ratio_vs_torch_foreach']:.2f}x")
        c = r["bucket_copy"]
        print(f"  host->host copy of a {c['bytes'] / 2**20:.0f} MiB bucket: {c['gb_per_s']:.2f} GB/s ({c['s'] * 1e3:.1f} ms; "
              f"best {c['best_gb_per_s']:.2f} GB/s)")
    from pipezero.files import atomic_write_with

    out = {"machine": {"cores": cores, "torch": torch.__version__}, "buckets": args.buckets,
           "bucket_mb": args.bucket_mb, "tensor_mib": args.tensor_mib, "repeats": args.repeats, "runs": rows}
    atomic_write_with(args.json, lambda tmp: Path(tmp).write_text(json.dumps(out, indent=2) + "\n"))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
