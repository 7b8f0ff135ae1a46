"""torch's own sharding on pipezero's model, for side-by-side memory figures (run under torchrun).

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/torch_baselines.py --mode zero1

Modes: `ddp` (DistributedDataParallel + AdamW), `zero1` (DDP + ZeroRedundancyOptimizer(AdamW)),
`fsdp2` (fully_shard on every layer and the root, AdamW). Same layers, init, batches, fp32, one
micro-batch a step as bench/zero_memory.py; peak memory is measured from outside by that script.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "zero1", "fsdp2"], required=True)
    ap.add_argument("--preset", default="base")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    from pipezero.settings import build_config
    from pipezero.data import global_batch, load_corpus, microbatches_for_rank
    from pipezero.models import build_chunk, lm_loss

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = build_config(None, {"model.preset": args.preset, "data.seq_len": args.seq_len, "data.tokenizer": "bytes",
                              "parallel.dp": world, "parallel.microbatches": 1, "parallel.micro_batch_size": 1})
    model = build_chunk(cfg.model, 0, cfg.model.n_layers + 2, cfg.run.seed)
    if args.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        if args.mode == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                          foreach=False)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    corpus = load_corpus(cfg.data)
    denom = cfg.global_batch * cfg.data.seq_len
    for step in range(args.steps):
        ((x, y),) = microbatches_for_rank(global_batch(corpus.train, step, 0, cfg.global_batch, cfg.data.seq_len),
                                          rank, world, 1)
        lm_loss(model(x), y, denom).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
