"""Which schedules exist, the layouts each accepts, and the generator that builds each."""

from __future__ import annotations

from pipezero.config import ScheduleKind

# Schedules that place V > 1 chunks on a rank, and how many they need.
NEEDS_V: dict[ScheduleKind, str] = {
    ScheduleKind.INTERLEAVED_1F1B: ">=2",
    ScheduleKind.LOOPED_BFS: ">=2",
    ScheduleKind.ZB_V: "==2",
    ScheduleKind.DUALPIPE_V: "==2",
}

# Schedules whose backward is split into B (input gradient) and W (weight gradient).
SPLIT_BACKWARD = frozenset({ScheduleKind.ZB_H1, ScheduleKind.ZB_H2, ScheduleKind.ZB_V, ScheduleKind.DUALPIPE_V})


def check_layout(kind: ScheduleKind, pp: int, microbatches: int, virtual_stages: int) -> None:
    """Raise ValueError naming the allowed values when `kind` cannot run (pp, M, V)."""
    v, m = virtual_stages, microbatches
    rule = NEEDS_V.get(kind)
    if rule is None and v != 1:
        raise ValueError(f"--schedule {kind.value} runs one stage chunk a rank: use --virtual-stages 1 "
                         f"(or interleaved-1f1b / looped-bfs for V > 1)")
    if rule == ">=2" and v < 2:
        raise ValueError(f"--schedule {kind.value} needs --virtual-stages >= 2 (got {v})")
    if rule == "==2" and v != 2:
        raise ValueError(f"--schedule {kind.value} places exactly two chunks a rank in a V: use --virtual-stages 2")
    if kind is ScheduleKind.INTERLEAVED_1F1B and m % (m // round_size(pp, m)):
        rounds = m // round_size(pp, m)
        ok = [x for x in range(max(1, m - pp), m + pp + 1) if x % max(1, x // pp) == 0]
        raise ValueError(f"--schedule interleaved-1f1b runs M micro-batches in max(1, M // --pp) = {rounds} equal "
                         f"rounds: --microbatches {m} is not a multiple of {rounds} (try one of {ok})")
    if kind is ScheduleKind.DUALPIPE_V and m < 2 * pp and pp > 1:
        raise ValueError(f"--schedule {kind.value} needs --microbatches >= 2 x --pp = {2 * pp} (got {m})")


def round_size(pp: int, microbatches: int) -> int:
    """Interleaved 1F1B's micro-batches a round: P in Megatron; M // max(1, M // P) in general, the
    rule torch.distributed.pipelining's ScheduleInterleaved1F1B uses (M < P: all M in one round)."""
    return microbatches // max(1, microbatches // pp)
