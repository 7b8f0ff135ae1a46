"""The rank spawner the distributed tests use, shared with the benches: its one home is
bench/rank_spawner.py, so a bench runs without tests/ (or pytest) on its path. Here every rank's
every training run is also held to its program (tests/training.py `hold_every_run`): a layout
test that calls `train` itself is checked as `train_cases` checks its own."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from rank_spawner import PRELOAD, TEARDOWN_GRACE_S, rank_context, run_ranks as spawn  # noqa: E402

__all__ = ["PRELOAD", "TEARDOWN_GRACE_S", "rank_context", "run_ranks"]


class _Held:
    """`fn` run on a rank whose `pipezero.engine.train` is held to its program (picklable: the
    spawner sends it to each rank)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, rank: int, world: int, *args: Any) -> Any:
        from training import hold_every_run

        hold_every_run()
        return self.fn(rank, world, *args)


def run_ranks(fn: Callable, world: int, *args: Any, **kwargs: Any) -> list:
    """bench/rank_spawner.py `run_ranks`, every `train` of every rank held to its program."""
    return spawn(_Held(fn), world, *args, **kwargs)
