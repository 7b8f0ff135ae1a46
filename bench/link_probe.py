"""Time a step's bytes across the emulated link with nothing else running (run under torchrun, 2 ranks).

    python bench/link_probe.py {dp,pp} TOTAL_BYTES PIECE_BYTES

`dp`: all-reduces of one PIECE-sized bucket (at D=2 a rank sends half of it and receives the other
half, then the same for the sum: one bucket's bytes sent a rank); `pp`: both ranks send pieces to
each other at once, as activations and gradients cross. Each rank sends TOTAL bytes; rank 0 prints
the best of three times as JSON, with `cpu_s`: the CPU-seconds the whole host spent in that
round (/proc/stat, every core, both ranks and the kernel's network path: on the emulated cluster the
veth, bridge and tbf work runs on the cores that also compute). bench/cluster_overlap.py and
cluster_placement.py start it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def host_cpu_s() -> float:
    """CPU-seconds the host has spent busy since boot (every core; idle and iowait excluded)."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def probe(kind: str, total: int, piece: int) -> tuple[float, float]:
    import torch
    import torch.distributed as dist

    other = 1 - dist.get_rank()
    buf = torch.ones(max(1, piece // 4))
    inbox = torch.empty_like(buf)
    best, cpu = float("inf"), 0.0
    for _ in range(3):
        dist.barrier()
        t0, c0 = time.perf_counter(), host_cpu_s()
        for _ in range(max(1, round(total / piece))):
            if kind == "dp":
                dist.all_reduce(buf)
            else:
                for w in [dist.isend(buf, other), dist.irecv(inbox, other)]:
                    w.wait()
        took = time.perf_counter() - t0
        if took < best:
            best, cpu = took, host_cpu_s() - c0
    return best, cpu


def main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    seconds, cpu_s = probe(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    if dist.get_rank() == 0:
        print(json.dumps({"seconds": seconds, "cpu_s": cpu_s}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo's threads can abort an orderly interpreter exit


if __name__ == "__main__":
    main()
