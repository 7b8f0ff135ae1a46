"""`pipezero train`, with every gradient bucket's launch and completion on the trace (a bench probe).

    python bench/launch_times.py [--exchange-rs] train --trace ... (the arguments of `python -m pipezero.cli`)

Why: a traced step shows how long a rank blocked on ZeRO's collectives, not when each bucket's
reduction started and ended on the wire, which is what says whether the exposed time is a bucket
launched late (the backward produced it last) or bytes the link could not move in time. This wraps
`Coordinator.reduce` (zero/coordinator.py; nothing in pipezero changes) to add, on the collectives
row, a span `launch` while a bucket's collective is started and a zero-length `done` when gloo
completes it (the work's future). gloo's reduce-scatter work has no future and its is_completed()
stays False even after wait() (torch 2.13), so ZeRO-2/3 buckets get `launch` spans only; their waits
show the rest. bench/cluster_overlap.py `--launches` runs the ranks through it and reads them back
(`launch_timeline`).

`--exchange-rs` (an experiment, not a pipezero option): ZeRO-2/3's gradient reduce-scatter becomes
parallel/hierarchical.py's `start_exchange` (each rank sends every other its slice, then sums the D
slices when waited for), which sends (D - 1) / D of a bucket a rank where gloo's reduce-scatter sends an
all-reduce's bytes; the shard each rank keeps is the same (tests/test_hierarchical.py). The
two-level reductions themselves are pipezero's `--hierarchical`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def instrument(exchange_rs: bool = False) -> None:
    from pipezero.zero.coordinator import Coordinator

    original = Coordinator.reduce

    def reduce(self: Any, b: Any) -> None:
        t0 = time.time()
        original(self, b)
        tracer, step = self.tracer, self.tracer.step
        if not tracer.enabled or b.reduction is None or b.reduction.work is None:
            return
        name = f"bucket {b.padded * 4 / 2**20:.2f} MiB"
        tracer._record((name, "launch", "collectives", t0, time.time(), step))

        def done(_: Any = None) -> None:
            now = time.time()
            tracer._record((name, "done", "collectives", now, now, step))

        try:  # on gloo's thread, once the collective has ended
            b.reduction.work.get_future().add_done_callback(done)
        except (RuntimeError, AttributeError):  # gloo's reduce-scatter: no future (nor a two-level one)
            pass

    Coordinator.reduce = reduce  # type: ignore[method-assign]
    if exchange_rs:
        import pipezero.zero.coordinator as coordinator

        from pipezero.parallel.hierarchical import start_exchange

        coordinator.reduce_scatter = start_exchange  # type: ignore[assignment]


if __name__ == "__main__":
    argv = sys.argv[1:]
    instrument(exchange_rs="--exchange-rs" in argv)
    from pipezero.cli import main

    sys.exit(main([a for a in argv if a != "--exchange-rs"]))
