"""What a hand-off between ranks costs in wall time when ranks outnumber the host's cores.

    python bench/shared_core_handoff.py [--ranks 4] [--burn-ms 5,20]

Each of --ranks gloo ranks (bench/rank_spawner.py, on this host) burns --burn-ms of CPU an
iteration (its own thread's CPU clock), then either goes on (`alone`) or sends 128 KB to the next
rank and receives from the previous (`ring`, a pipeline's hand-off), alternately, twice each.
Printed: the slowest rank's wall time an iteration, every rank's CPU an iteration, and what the
host's cores would take for that CPU. Where `ring` takes longer than `alone` by more than its CPU,
the difference is waiting for a core after a partner's message arrived (a woken rank queues behind
the running ones), which the planner's model of ranks sharing cores (planner/search.py `share`)
does not price. Not yet a docs table: on this 2-core host under a load average of 13 (four other
jobs), ring took 1.5-1.9 times alone's wall time for 1.05-1.25 times its CPU in one run and 1.0-1.15
times in the next; it needs a quiet host to say how much a hand-off costs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_spawner import run_ranks  # noqa: E402


def burn(ms: float) -> None:
    """`ms` of this thread's CPU, spent."""
    until = time.thread_time() + ms / 1e3
    while time.thread_time() < until:
        pass


def iterate(rank: int, world: int, ms: float, iters: int, ring: bool) -> tuple[float, float]:
    """(wall seconds, this process's CPU-seconds) an iteration."""
    import torch
    import torch.distributed as dist

    out, inbox = torch.zeros(32768), torch.zeros(32768)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(iters):
        burn(ms)
        if ring:
            works = [dist.isend(out, (rank + 1) % world), dist.irecv(inbox, (rank - 1) % world)]
            for w in works:
                w.wait()
    dist.barrier()
    return (time.perf_counter() - t0) / iters, (time.process_time() - c0) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--burn-ms", default="5,20")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"{args.ranks} ranks on {cores} cores, load average {os.getloadavg()[0]:.1f}")
    for ms in (float(x) for x in args.burn_ms.split(",")):
        for ring in (False, True, False, True):
            got = run_ranks(iterate, args.ranks, ms, max(10, int(400 // ms)), ring)
            wall, cpu = max(g[0] for g in got), sum(g[1] for g in got)
            print(f"burn {ms:g} ms, {'ring ' if ring else 'alone'}: wall {wall * 1e3:7.1f} ms an iteration, CPU "
                  f"{cpu * 1e3:6.1f} ms (all ranks), {cpu / cores * 1e3:6.1f} ms on {cores} cores")


if __name__ == "__main__":
    main()
