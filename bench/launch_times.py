"""`pipezero train`, with every gradient bucket's launch and completion on the trace (a bench probe).

    python bench/launch_times.py train --trace ... (the arguments of `python -m pipezero.cli`)

Why: a traced step shows how long a rank blocked on ZeRO's collectives, not when each bucket's
reduction started and ended on the wire, which is what says whether the exposed time is a bucket
launched late (the backward produced it last) or bytes the link could not move in time. This wraps
`ZeroDP._launch` (nothing in pipezero changes) to add, on the collectives row, a span `launch` while
a bucket's collective is started and a zero-length `done` when gloo completes it (the work's
future). gloo's reduce-scatter work has no future and its is_completed() stays False even after
wait() (torch 2.13), so ZeRO-2/3 buckets get `launch` spans only; their waits show the rest.
bench/cluster_overlap.py `--launches` runs the ranks through it and reads them back
(`launch_timeline`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def instrument() -> None:
    from pipezero.zero.sharded import ZeroDP

    original = ZeroDP._launch

    def launch(self: Any, b: Any) -> None:
        before, t0 = len(self._pending), time.time()
        original(self, b)
        tracer, step = self.tracer, self.tracer.step
        if not tracer.enabled or len(self._pending) == before or self._pending[-1].work is None:
            return
        name = f"bucket {b.padded * 4 / 2**20:.2f} MiB"
        tracer._record((name, "launch", "collectives", t0, time.time(), step))

        def done(_: Any = None) -> None:
            now = time.time()
            tracer._record((name, "done", "collectives", now, now, step))

        work = self._pending[-1].work
        try:  # on gloo's thread, once the collective has ended
            work.get_future().add_done_callback(done)
        except RuntimeError:  # gloo's reduce-scatter: no future, and is_completed() stays False
            pass

    ZeroDP._launch = launch  # type: ignore[method-assign]


if __name__ == "__main__":
    instrument()
    from pipezero.cli import main

    sys.exit(main(sys.argv[1:]))
