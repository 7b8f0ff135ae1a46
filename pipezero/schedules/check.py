"""The one checker-simulator: plays any schedule under a cost model and proves it sound.

`simulate()` first checks completeness (every chunk and micro-batch gets F, B and W exactly once,
each on the rank that holds the chunk), then plays the ranks' lists in order with the true
dependencies (F of chunk c after F of c-1 and the hop; B of c after B of c+1 and the hop, and after
its own F; W after B), committing actions in start-time order. If no rank can move before all are
done, the schedule deadlocks and the error names each stuck rank, its action, and what it waits for.

A transfer between ranks holds its link: each direction of a rank pair is a queue that carries one
transfer at a time, in the order the sender produced them (`Links`). A link's bandwidth is shared by
whatever crosses it at once, so M activations sent one after another over a slow link arrive one
hop apart, not all one hop after they were sent (a delay that overlapped them would price the link at
M times its bandwidth). The two directions are apart: links are full duplex (Ethernet, NVLink; the
emulated cluster shapes a node's uplink and downlink apart, pipezero/cluster.py). Where the link
keeps up (a hop no longer than the time between two sends) the queue is empty and a hop is the plain
delay it always was.
How ranks post their transfers so that real transports cannot deadlock on them (NCCL runs a rank
pair's transfers in posting order) is schedules/posting.py's business; it builds on this timeline.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from pipezero.schedules.actions import Action, Op, Schedule


class ScheduleError(ValueError):
    """A schedule that is incomplete, misplaced, out of dependency order, or deadlocks."""


@dataclass(frozen=True)
class CostModel:
    """Relative compute costs of one full stage (the chunks of one rank together) and the hop times.

    A chunk of a rank with V chunks costs 1/V of a stage unless `chunk_factors` says otherwise (a
    measured per-chunk multiplier), so schedules with different V compare on the same model.
    A hop is the time one transfer (an activation forward, or its gradient back: the same bytes)
    holds the link it crosses: `hop[c]` for the boundary between chunks c and c + 1, in model order
    (P·V - 1 entries; a boundary inside one rank, the V's turn, has no hop whatever its entry), so a
    pipeline whose ranks sit on several nodes prices each boundary at its own link; `comm` is the
    uniform shorthand, every boundary alike.
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0  # per hop between ranks where `hop` is None, the same for activations and gradients
    hop: tuple[float, ...] | None = None  # per boundary between chunks c and c + 1
    chunk_factors: tuple[float, ...] | None = None  # per global chunk; None = 1/V each
    per_chunk: tuple[tuple[float, float, float], ...] | None = None  # measured (F, B, W) per chunk
    # a fixed cost every action pays whatever its size (kernel launches, Python): why a fused BW is
    # cheaper than its B and W apart, and V chunks cost more than one
    per_action: float = 0.0

    def hop_time(self, boundary: int) -> float:
        """What one transfer across the boundary between chunks `boundary` and `boundary` + 1 holds its link."""
        return self.comm if self.hop is None else self.hop[boundary]

    def cost(self, action: Action, virtual: int) -> float:
        if self.per_chunk is not None:
            f, b, w = self.per_chunk[action.chunk]
            return {Op.F: f, Op.B: b, Op.W: w, Op.BW: b + w}[action.op] + self.per_action
        base = {Op.F: self.f, Op.B: self.b, Op.W: self.w, Op.BW: self.b + self.w}[action.op]
        factor = self.chunk_factors[action.chunk] if self.chunk_factors else 1.0 / virtual
        return base * factor + self.per_action


class Links:
    """The links between a pipeline's ranks as queues, one a direction of each pair of ranks (the
    module's docstring says why). Only the sending rank puts transfers on its own directions, and it
    produces them in its action order, so taking them first come first served as they are produced is
    the order they cross in. Two rank pairs whose hops share one wire (several replicas' pipelines
    through one node's link) are queues apart here: the planner gives each its share of the wire."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.free: dict[tuple[object, object], float] = {}  # (sender, receiver) -> when its link is idle

    def send(self, boundary: int, sender: object, receiver: object, ready: float) -> float:
        """When a transfer across `boundary`, produced at `ready`, has arrived."""
        start = max(ready, self.free.get((sender, receiver), 0.0))
        self.free[(sender, receiver)] = end = start + self.cost.hop_time(boundary)
        return end


def crossing(s: Schedule, a: Action) -> tuple[int, int] | None:
    """(boundary, consumer chunk) of what `a` hands to a neighbouring chunk (F: its activation to
    chunk c + 1, B or BW: the input gradient to chunk c - 1), or None where it hands nothing on."""
    if a.op is Op.F and a.chunk < s.n_chunks - 1:
        return a.chunk, a.chunk + 1
    if a.op in (Op.B, Op.BW) and a.chunk > 0:
        return a.chunk - 1, a.chunk - 1
    return None


def check_hops(s: Schedule, cost: CostModel) -> None:
    """A per-boundary hop list must name every boundary of `s`."""
    if cost.hop is not None and len(cost.hop) != s.n_chunks - 1:
        raise ValueError(f"CostModel.hop has {len(cost.hop)} entries; {s.name} at P={s.pp} V={s.virtual} "
                         f"has {s.n_chunks - 1} boundaries between chunks (one entry each)")


@dataclass(frozen=True)
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class SimResult:
    step_time: float
    bubble: float  # idle share of all ranks' time: sum(idle) / (P * step_time)
    idle: list[float]  # per rank
    busy: list[float]
    peak_activations: list[int]  # per rank: max chunk activations whose F ran and B or W did not
    peak_activation_memory: list[float]  # the same weighted by chunk cost factor (units of one stage)
    timeline: list[Event] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"step_time": self.step_time, "bubble": self.bubble, "idle": self.idle, "busy": self.busy,
                "peak_activations": self.peak_activations, "peak_activation_memory": self.peak_activation_memory}


def check_complete(s: Schedule) -> None:
    """Each (chunk, mb) gets exactly one F and either one BW or one B and one W, on its own rank."""
    seen: Counter[tuple[int, Op, int]] = Counter()
    for r, acts in enumerate(s.actions):
        mine = set(s.chunks(r))
        for i, a in enumerate(acts):
            if a.chunk not in mine:
                raise ScheduleError(f"rank {r} runs {a} but chunk {a.chunk} lives on rank "
                                    f"{s.rank_of_chunk.get(a.chunk, '?')}\n{s.grid((r, i))}")
            if not 0 <= a.mb < s.microbatches:
                raise ScheduleError(f"rank {r}: {a} names micro-batch {a.mb} outside 0..{s.microbatches - 1}\n"
                                    f"{s.grid((r, i))}")
            seen[(a.chunk, a.op, a.mb)] += 1
    for c in range(s.n_chunks):
        r = s.rank_of_chunk[c]
        for mb in range(s.microbatches):
            f, b, w, bw = (seen[(c, op, mb)] for op in (Op.F, Op.B, Op.W, Op.BW))
            problem = None
            if f != 1:
                problem = f"F of chunk {c}, micro-batch {mb} appears {f} times (want 1)"
            elif not ((bw == 1 and b == w == 0) or (bw == 0 and b == w == 1)):
                problem = (f"chunk {c}, micro-batch {mb} has B x{b}, W x{w}, BW x{bw}: want one BW, "
                           f"or one B and one W")
            if problem:
                raise ScheduleError(f"rank {r}: {problem}\n{s.grid()}")


def _deps(s: Schedule, a: Action) -> list[Action | tuple[int, Op, int]]:
    """What `a` waits for, as (chunk, op-kind, mb); 'B' is satisfied by either a B or a BW."""
    last = s.n_chunks - 1
    if a.op is Op.F:
        return [(a.chunk - 1, Op.F, a.mb)] if a.chunk > 0 else []
    if a.op in (Op.B, Op.BW):
        deps = [(a.chunk, Op.F, a.mb)]
        if a.chunk < last:
            deps.append((a.chunk + 1, Op.B, a.mb))
        return deps
    return [(a.chunk, Op.B, a.mb)]  # W


def _key(a: Action) -> tuple[int, Op, int]:
    return (a.chunk, Op.B if a.op is Op.BW else a.op, a.mb)


def simulate(s: Schedule, cost: CostModel | None = None) -> SimResult:
    """Play `s` under `cost`; raise ScheduleError if it is incomplete or can deadlock."""
    cost = cost or CostModel()
    check_complete(s)
    check_hops(s, cost)
    p = s.pp
    links = Links(cost)
    arrived: dict[tuple[int, Op, int], float] = {}  # a transfer to another rank (its producer's key) -> arrival
    pc = [0] * p  # next action index per rank
    free = [0.0] * p  # when each rank's previous action ends
    done: dict[tuple[int, Op, int], float] = {}  # finished action key -> end time
    busy = [0.0] * p
    live: list[dict[tuple[int, int], float]] = [dict() for _ in range(p)]  # (chunk, mb) -> factor
    peak = [0] * p
    peak_mem = [0.0] * p
    timeline: list[Event] = []

    waiters: dict[tuple[int, Op, int], set[int]] = {}  # missing dependency -> ranks stalled on it
    # (start, rank) of each rank whose next action can start: a heap, so picking the earliest (ties to
    # the lower rank) costs log P an action, not P (at P = 256 the scan was most of a proof)
    ready: list[tuple[float, int]] = []
    dirty = set(range(p))  # ranks whose next action's readiness must be recomputed

    def ready_time(r: int) -> float | None:
        if pc[r] >= len(s.actions[r]):
            return None
        a = s.actions[r][pc[r]]
        t = free[r]
        for dep in _deps(s, a):
            if dep not in done:
                waiters.setdefault(dep, set()).add(r)
                return None
            t = max(t, arrived[dep] if s.rank_of_chunk[dep[0]] != r else done[dep])
        return t

    while True:
        for r in dirty:  # a dirty rank has no entry: it just ran, or its next action was waiting
            t = ready_time(r)
            if t is not None:
                heapq.heappush(ready, (t, r))
        dirty.clear()
        if not ready:
            break
        start, r = heapq.heappop(ready)
        a = s.actions[r][pc[r]]
        end = start + cost.cost(a, s.virtual)
        timeline.append(Event(r, a, start, end))
        busy[r] += end - start
        free[r] = end
        pc[r] += 1
        dirty.add(r)
        if a.op in (Op.W, Op.BW):
            live[r].pop((a.chunk, a.mb), None)
        elif a.op is Op.F:
            live[r][(a.chunk, a.mb)] = cost.chunk_factors[a.chunk] if cost.chunk_factors else 1.0 / s.virtual
            peak[r] = max(peak[r], len(live[r]))
            peak_mem[r] = max(peak_mem[r], sum(live[r].values()))
        out = crossing(s, a)
        if out is not None and s.rank_of_chunk[out[1]] != r:
            arrived[_key(a)] = links.send(out[0], r, s.rank_of_chunk[out[1]], end)
        keys = [_key(a)] + ([(a.chunk, Op.W, a.mb)] if a.op is Op.BW else [])
        for key in keys:
            done[key] = end
            dirty.update(waiters.pop(key, ()))

    if any(pc[r] < len(s.actions[r]) for r in range(p)):
        raise ScheduleError(_deadlock_message(s, pc, done))
    step_time = max(free) if timeline else 0.0
    idle = [step_time - b for b in busy]
    bubble = sum(idle) / (p * step_time) if step_time else 0.0
    return SimResult(step_time, bubble, idle, busy, peak, [round(x, 9) for x in peak_mem], timeline)


def _deadlock_message(s: Schedule, pc: list[int], done: dict) -> str:
    lines = ["schedule deadlocks: no rank can run its next action"]
    for r in range(s.pp):
        if pc[r] >= len(s.actions[r]):
            lines.append(f"  rank {r}: finished")
            continue
        a = s.actions[r][pc[r]]
        missing = [d for d in _deps(s, a) if d not in done]
        what = ", ".join(f"{c}{op.value}{mb} on rank {s.rank_of_chunk[c]}" for c, op, mb in missing)
        lines.append(f"  rank {r}: action {a} waits for {what}")
    first = next(r for r in range(s.pp) if pc[r] < len(s.actions[r]))
    return "\n".join(lines) + "\n" + s.grid((first, pc[first]))
