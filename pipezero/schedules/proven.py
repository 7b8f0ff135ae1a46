"""A layout's schedule with its proof, made once: the one way a run, `verify`, `simulate --zero` and
the lowering obtain a schedule they may play.

Proving is three steps, written here once for every place that assembles a plan: generate the
per-rank action lists (registry.py), play them at F=B=W=1 (check.py: every action once on its own
rank, dependencies in order, no deadlock; the play also gives the bubble and peak activations the
run reports beside its measurements), and derive from that play the order in which every rank
posts its transfers, proven free of cycles where a rank pair's transfers run in posting order
(posting.py). The lowering (lowering.py) places its instructions around those posts, so it takes
them from here rather than deriving them again.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipezero.config import ScheduleKind
from pipezero.schedules.actions import Schedule
from pipezero.schedules.check import SimResult, simulate
from pipezero.schedules.posting import Post, plans, verify
from pipezero.schedules.registry import build_schedule


@dataclass(frozen=True)
class ProvenSchedule:
    schedule: Schedule
    predicted: SimResult  # the play at F=B=W=1 that proved it complete and deadlock-free
    posts: list[list[list[Post]]]  # per rank, per action (and once after the last): transfers posted before it


def prove(schedule: Schedule) -> ProvenSchedule:
    """`schedule` played and its posting order proven; ScheduleError says why not."""
    predicted = simulate(schedule)
    posts = plans(schedule, predicted)
    verify(schedule, posts)
    return ProvenSchedule(schedule, predicted, posts)


def proven_layout(kind: ScheduleKind, pp: int, microbatches: int, virtual_stages: int) -> ProvenSchedule:
    """The schedule `kind` for (P, M, V), proven; a layout the schedule cannot run raises ValueError
    naming the allowed values."""
    return prove(build_schedule(kind, pp, microbatches, virtual_stages))
