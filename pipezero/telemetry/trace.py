"""Per-rank timed events and the Chrome / Perfetto trace they become.

A `Tracer` records complete events (name, category, row, start, end) on one rank; with tracing off
it records nothing and `span` costs one attribute check. Rows are the streams a user reasons about:
compute (F/B/W/BW and the optimizer), p2p (time blocked on activations and gradients) and
collectives (time blocked on ZeRO reductions and gathers). Times are wall-clock (`time.time`), so the
ranks of one machine line up; across machines they are as good as the clocks' agreement. On a GPU,
kernels run after the CPU has queued them, so a tracing rank synchronizes its device at the end of
every span (`sync`): spans then time the work itself, at the cost of the overlap tracing observes.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROWS = {"compute": 0, "p2p": 1, "collectives": 2}


Event = tuple[str, str, str, float, float, int]  # name, category, row, start, end, step


@dataclass
class Tracer:
    """Bounded: events are kept for the steps in `only_steps` if given, else for the newest
    `keep_steps` steps (a ring), so a long traced run holds, and gathers to rank 0 at its end, a
    few steps' events, not one per action of every step."""

    rank: int = 0
    enabled: bool = False
    # The optimizer step under way (1-based, the true step after a resume): the rank's one step
    # counter, which p2p's and ZeRO's messages name too, so no part counts steps of its own.
    step: int = 0
    sync: Callable[[], None] | None = None  # waits for queued device work (torch.cuda.synchronize)
    keep_steps: int = 3  # the ring: the newest steps kept (the trace's PNG shows the last one)
    only_steps: frozenset[int] | None = None  # trace exactly these steps instead (ring unused)
    _steps: deque[tuple[int, list[Event]]] = field(default_factory=deque, repr=False)

    def __post_init__(self) -> None:
        if self.keep_steps < 1:
            raise ValueError("a tracer keeps at least one step")

    @property
    def events(self) -> list[Event]:
        """The kept events, oldest step first."""
        return [e for _, evs in self._steps for e in evs]

    def _record(self, event: Event) -> None:
        if self.only_steps is not None and self.step not in self.only_steps:
            return
        if not self._steps or self._steps[-1][0] != self.step:
            self._steps.append((self.step, []))
            if self.only_steps is None and len(self._steps) > self.keep_steps:
                self._steps.popleft()
        self._steps[-1][1].append(event)

    @contextmanager
    def span(self, name: str, cat: str, row: str = "compute") -> Iterator[None]:
        if not self.enabled:
            yield
            return
        t0 = time.time()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self._record((name, cat, row, t0, time.time(), self.step))


def parse_action(name: str, cat: str) -> tuple[int, int]:
    """(chunk, micro-batch) of a compute event named like an action: `2BW5` with cat `BW`."""
    chunk, mb = name.split(cat)
    return int(chunk), int(mb)


def chrome_trace(per_rank: list[list[tuple]], layout: dict | None = None) -> dict[str, Any]:
    """One process row per rank, one thread row per stream; timestamps in microseconds from the
    earliest event."""
    t0 = min((e[3] for evs in per_rank for e in evs), default=0.0)
    out: list[dict[str, Any]] = []
    for rank, evs in enumerate(per_rank):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        for row, tid in ROWS.items():
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": row}})
        for name, cat, row, start, end, step in evs:
            out.append({"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": ROWS[row],
                        "ts": (start - t0) * 1e6, "dur": (end - start) * 1e6, "args": {"step": step}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"layout": layout or {}}}


def write_trace(path: Path, per_rank: list[list[tuple]], layout: dict, png: Path | None = None,
                step: int | None = None) -> None:
    from pipezero.files import atomic_write_bytes

    atomic_write_bytes(path, json.dumps(chrome_trace(per_rank, layout)).encode())
    if png is None:
        return
    from pipezero.telemetry.plot import draw_timeline

    shown = [[e for e in evs if step is None or e[5] == step] for evs in per_rank]
    t0 = min((e[3] for evs in shown for e in evs), default=0.0)
    bars = []
    for rank, evs in enumerate(shown):
        for name, cat, row, start, end, _ in evs:
            if row == "compute" and cat in ("F", "B", "W", "BW"):
                bars.append((rank, cat, parse_action(name, cat)[1], (start - t0) * 1e3, (end - t0) * 1e3))
    draw_timeline(bars, len(per_rank), f"measured step {step}" if step else "measured", png, time_unit="ms")


def load_trace(path: Path) -> tuple[dict, dict[int, list[dict[str, Any]]]]:
    """The run's layout and the complete events of a trace written by `write_trace`, by rank."""
    data = json.loads(Path(path).read_text())
    out: dict[int, list[dict[str, Any]]] = {}
    for e in data["traceEvents"]:
        if e.get("ph") == "X":
            out.setdefault(e["pid"], []).append(e)
    return data.get("otherData", {}).get("layout", {}), out
