"""In which order each rank posts its sends and receives, and why that order cannot deadlock.

NCCL ignores p2p tags and runs a rank's transfers with one peer on one stream, in posting order: a
transfer completes only when both ends have reached it at the head of their streams. Ranks that
post their transfers with a peer in different orders therefore swap tensors (no tag sorts them
out) or deadlock (each waits at the head of its stream for a transfer the other posted later).
1F1B's steady state is the classic case: both ranks send before they receive.

The plan: play the schedule once in the simulator and give every transfer the time its producer
finishes. Both ends post each transfer at that time: the sender right after producing it, the
receiver before its first action that starts at or after it. So every rank posts in one global
order (time, then transfer), and every wait points forward in that order: no cycle, whatever the
real timings turn out to be. `verify` checks exactly that on the graph of stream order, compute
order and the CPU waiting for each receive. Receiving at production time also posts receives as
early as the data can exist, which is what lets gloo overlap them with compute.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipezero.schedules.actions import Action, Op, Schedule
from pipezero.schedules.check import ScheduleError, SimResult, simulate

Transfer = tuple[int, bool, int]  # (consumer chunk, is a gradient, micro-batch)


@dataclass(frozen=True)
class Post:
    send: bool  # a send of this rank's output, or a receive of a peer's
    transfer: Transfer
    peer: int  # the other rank


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


def source(t: Transfer, rank_of_chunk: Mapping[int, int]) -> int:
    """The rank that sends transfer `t`: the previous chunk's for an activation, the next one's for
    a gradient."""
    chunk, grad, _ = t
    return rank_of_chunk[chunk + 1 if grad else chunk - 1]


def transfer_out(a: Action, n_chunks: int) -> Transfer | None:
    """What `a` produces for the next chunk (F) or the previous one (B, BW), if anything."""
    if a.op is Op.F and a.chunk < n_chunks - 1:
        return (a.chunk + 1, False, a.mb)
    if a.op in (Op.B, Op.BW) and a.chunk > 0:
        return (a.chunk - 1, True, a.mb)
    return None


def plans(s: Schedule, sim: SimResult | None = None) -> list[list[list[Post]]]:
    """Every rank's plan (`plans(s)[rank]`): for each of its actions, what it posts before running
    it, and one more list for after the last action (its final sends). Transfers within one rank
    (the V's turn) do not appear. `sim`: the schedule's simulation, if already played (any cost
    model gives a valid order)."""
    timeline = (sim or simulate(s)).timeline
    produced: dict[Transfer, float] = {}
    for e in timeline:
        t = transfer_out(e.action, s.n_chunks)
        if t is not None:
            produced[t] = e.end
    starts: list[list[float]] = [[] for _ in range(s.pp)]
    for e in timeline:
        starts[e.rank].append(e.start)
    return [_plan(s, r, produced, starts[r]) for r in range(s.pp)]


@lru_cache(maxsize=256)
def plans_of(s: Schedule) -> list[list[list[Post]]]:
    """`plans(s)`, made once a process for each schedule (equal schedules share it; callers only
    read it): the lowering of every ZeRO stage, D and reduction mode of one schedule, and the checker
    of each of those programs, post by the same plan."""
    return plans(s)


def _plan(s: Schedule, rank: int, produced: Mapping[Transfer, float], starts: Sequence[float]) -> list[list[Post]]:
    acts = s.actions[rank]  # `starts`: when each began in the simulation
    boundaries: list[list[tuple[float, Post]]] = [[] for _ in range(len(acts) + 1)]
    for i, a in enumerate(acts):
        if receives(a, s.rank_of_chunk, s.n_chunks, rank):
            t = transfer_in(a)
            peer = source(t, s.rank_of_chunk)
            k = bisect_left(starts, produced[t], 0, i)  # before its first action starting after; i at the latest
            boundaries[k].append((produced[t], Post(False, t, peer)))
        t_out = transfer_out(a, s.n_chunks)
        if t_out is not None and s.rank_of_chunk[t_out[0]] != rank:
            boundaries[i + 1].append((produced[t_out], Post(True, t_out, s.rank_of_chunk[t_out[0]])))
    return [[p for _, p in sorted(b, key=lambda tp: (tp[0], tp[1].transfer))] for b in boundaries]


def verify(s: Schedule, by_rank: Sequence[list[list[Post]]]) -> None:
    """Raise ScheduleError if the posting plans can deadlock where each rank pair's transfers run
    in posting order on one stream and both ends must reach a transfer to complete it (NCCL), with
    each rank's CPU waiting for every receive before the action that consumes it."""
    succ: dict[object, set[object]] = defaultdict(set)
    nodes: set[object] = set()

    def edge(u: object, v: object) -> None:
        nodes.update((u, v))
        succ[u].add(v)

    for r, boundaries in enumerate(by_rank):
        acts = s.actions[r]
        last_on: dict[int, object] = {}  # peer -> this rank's previous transfer on that stream
        waited: object | None = None  # the newest receive this rank's CPU has waited for
        for k, posts in enumerate(boundaries):
            for p in posts:
                node = ("transfer", p.transfer)
                nodes.add(node)
                if p.peer in last_on:
                    edge(last_on[p.peer], node)
                last_on[p.peer] = node
                if waited is not None:
                    edge(waited, node)
                if p.send:
                    edge(("compute", r, k - 1), node)
            if k < len(acts):
                here = ("compute", r, k)
                nodes.add(here)
                if k:
                    edge(("compute", r, k - 1), here)
                if receives(acts[k], s.rank_of_chunk, s.n_chunks, r):
                    waited = ("transfer", transfer_in(acts[k]))
                    edge(waited, here)
    indegree = {n: 0 for n in nodes}
    for u in nodes:
        for v in succ[u]:
            indegree[v] += 1
    ready = deque(n for n, d in indegree.items() if d == 0)
    while ready:
        u = ready.popleft()
        for v in succ[u]:
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    stuck = [n for n, d in indegree.items() if d > 0]
    if stuck:
        computes = sorted((n[1], n[2]) for n in stuck if n[0] == "compute")
        first = {}
        for r, k in computes:
            first.setdefault(r, k)
        lines = [f"  rank {r}: stuck before action {s.actions[r][k]} (#{k})" for r, k in sorted(first.items())]
        raise ScheduleError("posting order deadlocks where each rank pair's transfers run in posting order "
                            "(NCCL):\n" + "\n".join(lines))
