"""When each receive is posted: one policy shared by the executor and the checker-simulator.

A rank keeps its next `ahead` receives posted: the receive of its k-th receiving action is posted
when it begins the action after its (k - ahead)-th receiving action (at the start of the step for
the first `ahead`). Counting receives rather than actions matters for V-shape schedules, where long
runs of local work (the turn of the V, weight gradients) separate two receives. How many must be
posted depends on the schedule: with sends that block until received (NCCL), a producer that runs
several micro-batches ahead of its consumer (ZB-V's warm-up) needs that many receives waiting, or
the ranks deadlock. `check.receives_needed` finds the smallest safe number by simulation.

Receives are also posted in the order their sender sends them. NCCL ignores p2p tags, so a pair of
ranks matches sends to receives in posting order; in V-shape schedules (ZB-V, DualPipeV) a rank
consumes some transfers in another order than its neighbour produces them, and posting by need
alone would hand a tensor to the wrong micro-batch. Pulling a receive forward to keep sender order
only posts it earlier, which never makes a schedule deadlock that did not before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Transfer = tuple[int, bool, int]  # (consumer chunk, is a gradient, micro-batch)

from pipezero.schedules.actions import Action, Op


def receives(a: Action, rank_of_chunk: Mapping[int, int], n_chunks: int, rank: int) -> bool:
    """Does `a`, run on `rank`, take its input from another rank?"""
    if a.op is Op.F:
        return a.chunk > 0 and rank_of_chunk[a.chunk - 1] != rank
    if a.op in (Op.B, Op.BW):
        return a.chunk < n_chunks - 1 and rank_of_chunk[a.chunk + 1] != rank
    return False


def transfer_in(a: Action) -> Transfer:
    """The transfer a receiving action takes in."""
    return (a.chunk, a.op is not Op.F, a.mb)


def source(a: Action, rank_of_chunk: Mapping[int, int]) -> int:
    return rank_of_chunk[a.chunk - 1 if a.op is Op.F else a.chunk + 1]


def send_order(all_actions: Sequence[Sequence[Action]], rank_of_chunk: Mapping[int, int], n_chunks: int,
               rank: int) -> dict[Transfer, int]:
    """Every transfer into `rank` -> its position among the transfers its sender sends to `rank`.
    `all_actions[r]` is pipeline rank r's list and `rank_of_chunk` maps chunks to those ranks."""
    order: dict[Transfer, int] = {}
    for src, acts in enumerate(all_actions):
        n = 0
        for a in acts:
            if a.op is Op.F and a.chunk < n_chunks - 1:
                t: Transfer = (a.chunk + 1, False, a.mb)
            elif a.op in (Op.B, Op.BW) and a.chunk > 0:
                t = (a.chunk - 1, True, a.mb)
            else:
                continue
            if src != rank and rank_of_chunk[t[0]] == rank:
                order[t], n = n, n + 1
    return order


def post_points(actions: Sequence[Action], rank_of_chunk: Mapping[int, int], n_chunks: int, rank: int,
                ahead: int, order: Mapping[Transfer, int]) -> dict[int, int]:
    """Receiving action index -> index of the action at whose beginning its receive is posted:
    `ahead` receives ahead, and never after a receive its sender sends later (`send_order`)."""
    if ahead < 1:
        raise ValueError(f"a rank must keep at least its next receive posted, not {ahead}")
    idx = [i for i, a in enumerate(actions) if receives(a, rank_of_chunk, n_chunks, rank)]
    points = {j: (idx[k - ahead] + 1 if k >= ahead else 0) for k, j in enumerate(idx)}
    by_source: dict[int, list[int]] = {}
    for j in idx:
        by_source.setdefault(source(actions[j], rank_of_chunk), []).append(j)
    for js in by_source.values():
        js.sort(key=lambda j: order[transfer_in(actions[j])])
        earliest = len(actions)
        for j in reversed(js):  # a receive is posted no later than any its sender sends after it
            earliest = points[j] = min(points[j], earliest)
    return points


def posts_by_action(actions: Sequence[Action], rank_of_chunk: Mapping[int, int], n_chunks: int, rank: int,
                    ahead: int, order: Mapping[Transfer, int]) -> list[list[int]]:
    """For each action index i, the receiving actions whose receives are posted as i begins, in
    the order their senders send them."""
    out: list[list[int]] = [[] for _ in actions]
    for j, i in post_points(actions, rank_of_chunk, n_chunks, rank, ahead, order).items():
        out[i].append(j)
    for js in out:
        js.sort(key=lambda j: order[transfer_in(actions[j])])
    return out
