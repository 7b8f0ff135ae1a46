"""`pipezero train`, with every gradient bucket's launch and completion on the trace (a bench probe).

    python bench/launch_times.py [--exchange-rs | --two-level-rs] train --trace ... (the arguments of `python -m pipezero.cli`)

Why: a traced step shows how long a rank blocked on ZeRO's collectives, not when each bucket's
reduction started and ended on the wire, which is what says whether the exposed time is a bucket
launched late (the backward produced it last) or bytes the link could not move in time. This wraps
`ZeroDP._launch` (nothing in pipezero changes) to add, on the collectives row, a span `launch` while
a bucket's collective is started and a zero-length `done` when gloo completes it (the work's
future). gloo's reduce-scatter work has no future and its is_completed() stays False even after
wait() (torch 2.13), so ZeRO-2/3 buckets get `launch` spans only; their waits show the rest.
bench/cluster_overlap.py `--launches` runs the ranks through it and reads them back
(`launch_timeline`).

`--exchange-rs` (an experiment, not a pipezero option): ZeRO-2/3's gradient reduce-scatter becomes
parallel/hierarchical.py's `start_exchange` (all_to_all_single, then a sum of the D received slices
when waited for), which sends (D - 1) / D of a bucket a rank where gloo's reduce-scatter sends an
all-reduce's bytes; the shard each rank keeps is the same (tests/test_hierarchical.py).
`--two-level-rs` (P=1 only: every rank is in the one dp group, so all create the subgroups together
at the first reduction): the reduce-scatter becomes hierarchical.py's two-level one, the nodes being
torchrun's (LOCAL_WORLD_SIZE ranks each).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def two_level(ranks_per_node: int) -> Any:
    """A stand-in for collectives.reduce_scatter that runs hierarchical.py's two-level reduce-scatter
    over the group's nodes (its Hierarchy built at the first call, by every rank of the group)."""
    import torch.distributed as dist

    from pipezero.parallel.hierarchical import build_hierarchy, start_reduce_scatter

    made: dict[int, Any] = {}

    def reduce_scatter(out: Any, full: Any, group: Any) -> Any:
        if id(group) not in made:
            if dist.get_world_size(group) != dist.get_world_size():
                raise SystemExit("--two-level-rs needs P=1 (one dp group of every rank)")
            made[id(group)] = build_hierarchy([list(range(dist.get_world_size()))], ranks_per_node)
        return start_reduce_scatter(out, full, made[id(group)])

    return reduce_scatter


def instrument(exchange_rs: bool = False, two_level_rs: bool = False) -> None:
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
        except (RuntimeError, AttributeError):  # gloo's reduce-scatter: no future (nor a two-level one)
            pass

    ZeroDP._launch = launch  # type: ignore[method-assign]
    if exchange_rs:
        import pipezero.zero.sharded as sharded

        from pipezero.parallel.hierarchical import start_exchange

        sharded.reduce_scatter = start_exchange  # type: ignore[assignment]
    if two_level_rs:
        import os

        import pipezero.zero.sharded as sharded

        sharded.reduce_scatter = two_level(int(os.environ["LOCAL_WORLD_SIZE"]))  # type: ignore[assignment]


if __name__ == "__main__":
    argv = sys.argv[1:]
    instrument(exchange_rs="--exchange-rs" in argv, two_level_rs="--two-level-rs" in argv)
    from pipezero.cli import main

    sys.exit(main([a for a in argv if a not in ("--exchange-rs", "--two-level-rs")]))
