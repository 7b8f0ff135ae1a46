"""When each receive is posted: one policy shared by the executor and the checker-simulator.

A rank keeps its next `ahead` receives posted: the receive of its k-th receiving action is posted
when it begins the action after its (k - ahead)-th receiving action (at the start of the step for
the first `ahead`). Counting receives rather than actions matters for V-shape schedules, where long
runs of local work (the turn of the V, weight gradients) separate two receives. How many must be
posted depends on the schedule: with sends that block until received (NCCL), a producer that runs
several micro-batches ahead of its consumer (ZB-V's warm-up) needs that many receives waiting, or
the ranks deadlock. `check.receives_needed` finds the smallest safe number by simulation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipezero.schedules.actions import Action, Op


def receives(a: Action, rank_of_chunk: Mapping[int, int], n_chunks: int, rank: int) -> bool:
    """Does `a`, run on `rank`, take its input from another rank?"""
    if a.op is Op.F:
        return a.chunk > 0 and rank_of_chunk[a.chunk - 1] != rank
    if a.op in (Op.B, Op.BW):
        return a.chunk < n_chunks - 1 and rank_of_chunk[a.chunk + 1] != rank
    return False


def post_points(actions: Sequence[Action], rank_of_chunk: Mapping[int, int], n_chunks: int, rank: int,
                ahead: int) -> dict[int, int]:
    """Receiving action index -> index of the action at whose beginning its receive is posted."""
    if ahead < 1:
        raise ValueError(f"a rank must keep at least its next receive posted, not {ahead}")
    idx = [i for i, a in enumerate(actions) if receives(a, rank_of_chunk, n_chunks, rank)]
    return {j: (idx[k - ahead] + 1 if k >= ahead else 0) for k, j in enumerate(idx)}


def posts_by_action(actions: Sequence[Action], rank_of_chunk: Mapping[int, int], n_chunks: int, rank: int,
                    ahead: int) -> list[list[int]]:
    """For each action index i, the receiving actions whose receives are posted as i begins."""
    out: list[list[int]] = [[] for _ in actions]
    for j, i in post_points(actions, rank_of_chunk, n_chunks, rank, ahead).items():
        out[i].append(j)
    return out
