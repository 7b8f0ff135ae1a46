"""The rank spawner the distributed tests use, shared with the benches: its one home is
bench/rank_spawner.py, so a bench runs without tests/ (or pytest) on its path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from rank_spawner import PRELOAD, TEARDOWN_GRACE_S, rank_context, run_ranks  # noqa: E402

__all__ = ["PRELOAD", "TEARDOWN_GRACE_S", "rank_context", "run_ranks"]
