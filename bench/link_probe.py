"""Time a step's bytes across the emulated link with nothing else running (run under torchrun, 2 ranks).

    python bench/link_probe.py {dp,pp} TOTAL_BYTES PIECE_BYTES

`dp`: all-reduces of one PIECE-sized bucket (at D=2 a rank sends half of it and receives the other
half, then the same for the sum: one bucket's bytes sent a rank); `pp`: both ranks send pieces to
each other at once, as activations and gradients cross. Each rank sends TOTAL bytes; rank 0 prints
the best of three times as JSON. bench/cluster_overlap.py and cluster_placement.py start it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def probe(kind: str, total: int, piece: int) -> float:
    import torch
    import torch.distributed as dist

    other = 1 - dist.get_rank()
    buf = torch.ones(max(1, piece // 4))
    inbox = torch.empty_like(buf)
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(max(1, round(total / piece))):
            if kind == "dp":
                dist.all_reduce(buf)
            else:
                for w in [dist.isend(buf, other), dist.irecv(inbox, other)]:
                    w.wait()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    seconds = probe(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    if dist.get_rank() == 0:
        print(json.dumps({"seconds": seconds}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort an orderly interpreter exit


if __name__ == "__main__":
    main()
