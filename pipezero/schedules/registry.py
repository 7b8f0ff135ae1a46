"""The one table of schedules: each one's generator, the chunks a rank it places, whether its
backward is split, and a line saying what it is for.

The CLI's help, `simulate --compare`, the planner, the calibrated what-if and the configuration's
layout checks all read this table, so a schedule added here is offered, checked and simulated
everywhere at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipezero.config import ScheduleKind
from pipezero.schedules import generators as g
from pipezero.schedules.actions import Schedule


@dataclass(frozen=True)
class ScheduleInfo:
    generator: Callable[[int, int, int], Schedule]  # (P, M, V) -> every rank's action list
    virtual: str  # chunks a rank: "1", ">=2" or "==2"
    split_backward: bool  # backward split into B (input gradient) and W (weight gradient)
    summary: str

    @property
    def default_virtual(self) -> int:
        """V when the user gives none: the fewest chunks a rank the schedule accepts."""
        return 1 if self.virtual == "1" else 2


SCHEDULES: dict[ScheduleKind, ScheduleInfo] = {
    ScheduleKind.GPIPE: ScheduleInfo(g.gpipe, "1", False, "all forwards, then all backwards, M activations held"),
    ScheduleKind.ONE_F_ONE_B: ScheduleInfo(g.one_f_one_b, "1", False,
                                           "one forward, one backward after a warm-up, P activations held"),
    ScheduleKind.INTERLEAVED_1F1B: ScheduleInfo(g.interleaved_1f1b, ">=2", False,
                                                "1F1B over V chunks a rank in rounds, bubble / V"),
    ScheduleKind.LOOPED_BFS: ScheduleInfo(g.looped_bfs, ">=2", False,
                                          "every micro-batch through a chunk before the next chunk"),
    ScheduleKind.ZB_H1: ScheduleInfo(g.zb_h1, "1", True, "1F1B's memory, weight gradients fill the bubble"),
    ScheduleKind.ZB_H2: ScheduleInfo(g.zb_h2, "1", True, "twice 1F1B's activations, no bubble at F=B=W"),
    ScheduleKind.ZB_V: ScheduleInfo(g.zb_v, "==2", True, "two chunks a rank in a V, no bubble at 1F1B's memory"),
    ScheduleKind.DUALPIPE_V: ScheduleInfo(g.dualpipe_v, "==2", True,
                                          "a V of two chunks, one micro-batch's forward beside another's backward"),
    ScheduleKind.V_HALF: ScheduleInfo(g.v_half, "==2", True,
                                      "a V of two chunks, half 1F1B's activations, less bubble than 1F1B at F=B=W"),
}

# Schedules whose backward is split into B (input gradient) and W (weight gradient).
SPLIT_BACKWARD = frozenset(k for k, info in SCHEDULES.items() if info.split_backward)


def default_virtual(kind: ScheduleKind, v: int | None = None) -> int:
    """`v` when given, else the fewest chunks a rank `kind` accepts."""
    return SCHEDULES[kind].default_virtual if v is None else v


def check_layout(kind: ScheduleKind, pp: int, microbatches: int, virtual_stages: int) -> None:
    """Raise ValueError naming the allowed values when `kind` cannot run (pp, M, V)."""
    v, m = virtual_stages, microbatches
    rule = SCHEDULES[kind].virtual
    if rule == "1" and v != 1:
        raise ValueError(f"--schedule {kind.value} runs one stage chunk a rank: use --virtual-stages 1 "
                         f"(or interleaved-1f1b / looped-bfs for V > 1)")
    if rule == ">=2" and v < 2:
        raise ValueError(f"--schedule {kind.value} needs --virtual-stages >= 2 (got {v})")
    if rule == "==2" and v != 2:
        raise ValueError(f"--schedule {kind.value} places exactly two chunks a rank in a V: use --virtual-stages 2")
    if kind is ScheduleKind.DUALPIPE_V and m < 2 * pp and pp > 1:
        raise ValueError(f"--schedule {kind.value} needs --microbatches >= 2 x --pp = {2 * pp} (got {m})")


def build_schedule(kind: ScheduleKind, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The action lists of `kind` for P ranks, M micro-batches, V chunks a rank; bad layouts raise
    ValueError naming the allowed values."""
    check_layout(kind, pp, microbatches, virtual_stages)
    return SCHEDULES[kind].generator(pp, microbatches, virtual_stages)


def help_text() -> str:
    """Every schedule with its line, for `--schedule`'s help."""
    return "; ".join(f"{k.value}: {info.summary}" for k, info in SCHEDULES.items())
