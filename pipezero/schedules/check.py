"""The one checker-simulator: plays any schedule under a cost model and proves it sound.

`simulate()` first checks completeness (every chunk and micro-batch gets F, B and W exactly once,
each on the rank that holds the chunk), then plays the ranks' lists in order with the true
dependencies (F of chunk c after F of c-1 and the hop; B of c after B of c+1 and the hop, and after
its own F; W after B), committing actions in start-time order. If no rank can move before all are
done, the schedule deadlocks and the error names each stuck rank, its action, and what it waits for.
With `blocking_sends`, a rank that produced an activation or gradient for another rank cannot go on
until the receiver has posted the matching receive (a send that blocks until received, as NCCL's
do). Receivers keep their next `receives_ahead` receives posted (schedules/receives.py, the policy
the runtime's executor follows); with 1 a receive is posted only once the previous one is consumed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipezero.schedules.actions import Action, Op, Schedule
from pipezero.schedules.receives import post_points, send_order


class ScheduleError(ValueError):
    """A schedule that is incomplete, misplaced, out of dependency order, or deadlocks."""


@dataclass(frozen=True)
class CostModel:
    """Relative compute costs of one full stage (the chunks of one rank together) and the hop time.

    A chunk of a rank with V chunks costs 1/V of a stage unless `chunk_factors` says otherwise (a
    measured per-chunk multiplier), so schedules with different V compare on the same model.
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0  # per hop between ranks, the same for activations and gradients
    chunk_factors: tuple[float, ...] | None = None  # per global chunk; None = 1/V each
    per_chunk: tuple[tuple[float, float, float], ...] | None = None  # measured (F, B, W) per chunk

    def cost(self, action: Action, virtual: int) -> float:
        if self.per_chunk is not None:
            f, b, w = self.per_chunk[action.chunk]
            return {Op.F: f, Op.B: b, Op.W: w, Op.BW: b + w}[action.op]
        base = {Op.F: self.f, Op.B: self.b, Op.W: self.w, Op.BW: self.b + self.w}[action.op]
        factor = self.chunk_factors[action.chunk] if self.chunk_factors else 1.0 / virtual
        return base * factor


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


def _consumer(s: Schedule, a: Action) -> tuple[int, Op, int] | None:
    """The action on another rank that receives what `a` sends, if any."""
    if a.op is Op.F and a.chunk < s.n_chunks - 1:
        target = (a.chunk + 1, Op.F, a.mb)
    elif a.op in (Op.B, Op.BW) and a.chunk > 0:
        target = (a.chunk - 1, Op.B, a.mb)
    else:
        return None
    return target if s.rank_of_chunk[target[0]] != s.rank_of_chunk[a.chunk] else None


def _key(a: Action) -> tuple[int, Op, int]:
    return (a.chunk, Op.B if a.op is Op.BW else a.op, a.mb)


def simulate(s: Schedule, cost: CostModel | None = None, blocking_sends: bool = False,
             receives_ahead: int = 1) -> SimResult:
    """Play `s` under `cost`; raise ScheduleError if it is incomplete or can deadlock."""
    cost = cost or CostModel()
    check_complete(s)
    p = s.pp
    # rank -> consumer key -> index of the action at whose beginning its receive is posted
    posted_at = [{_key(s.actions[r][j]): i
                  for j, i in post_points(s.actions[r], s.rank_of_chunk, s.n_chunks, r, receives_ahead,
                                          send_order(s.actions, s.rank_of_chunk, s.n_chunks, r)).items()}
                 for r in range(p)]
    began: list[list[float]] = [[] for _ in range(p)]  # rank -> when it began each action it reached
    pc = [0] * p  # next action index per rank
    free = [0.0] * p  # when each rank's previous action (or blocking send) ends
    done: dict[tuple[int, Op, int], float] = {}  # finished action key -> end time
    blocked_on: list[tuple[int, tuple[int, Op, int]] | None] = [None] * p  # (receiver rank, consumer key)
    busy = [0.0] * p
    live: list[dict[tuple[int, int], float]] = [dict() for _ in range(p)]  # (chunk, mb) -> factor
    peak = [0] * p
    peak_mem = [0.0] * p
    timeline: list[Event] = []

    waiters: dict[tuple[int, Op, int], set[int]] = {}  # missing dependency -> ranks stalled on it
    senders_to: list[set[int]] = [set() for _ in range(p)]  # receiver rank -> ranks blocked sending to it
    ready: list[float | None] = [None] * p
    dirty = set(range(p))  # ranks whose next action's readiness must be recomputed

    def ready_time(r: int) -> float | None:
        if blocked_on[r] is not None:
            rr, key = blocked_on[r]
            posting = posted_at[rr][key]
            if pc[rr] >= posting:
                # the receiver began that action when its previous one ended
                free[r] = max(free[r], began[rr][posting] if posting < len(began[rr]) else free[rr])
                blocked_on[r] = None
                senders_to[rr].discard(r)
            else:
                return None
        if pc[r] >= len(s.actions[r]):
            return None
        a = s.actions[r][pc[r]]
        t = free[r]
        for dep in _deps(s, a):
            if dep not in done:
                waiters.setdefault(dep, set()).add(r)
                return None
            hop = cost.comm if s.rank_of_chunk[dep[0]] != r else 0.0
            t = max(t, done[dep] + hop)
        return t

    while True:
        for r in dirty:
            ready[r] = ready_time(r)
        dirty.clear()
        candidates = [(t, r) for r, t in enumerate(ready) if t is not None]
        if not candidates:
            break
        start, r = min(candidates)
        a = s.actions[r][pc[r]]
        began[r].append(free[r])  # it began this action (and posted its receives) when free
        end = start + cost.cost(a, s.virtual)
        timeline.append(Event(r, a, start, end))
        busy[r] += end - start
        free[r] = end
        pc[r] += 1
        dirty.add(r)
        dirty.update(senders_to[r])
        if a.op in (Op.W, Op.BW):
            live[r].pop((a.chunk, a.mb), None)
        elif a.op is Op.F:
            live[r][(a.chunk, a.mb)] = cost.chunk_factors[a.chunk] if cost.chunk_factors else 1.0 / s.virtual
            peak[r] = max(peak[r], len(live[r]))
            peak_mem[r] = max(peak_mem[r], sum(live[r].values()))
        keys = [_key(a)] + ([(a.chunk, Op.W, a.mb)] if a.op is Op.BW else [])
        for key in keys:
            done[key] = end
            dirty.update(waiters.pop(key, ()))
        consumer = _consumer(s, a)
        if blocking_sends and consumer is not None:
            receiver = s.rank_of_chunk[consumer[0]]
            blocked_on[r] = (receiver, consumer)
            senders_to[receiver].add(r)

    if any(pc[r] < len(s.actions[r]) for r in range(p)):
        raise ScheduleError(_deadlock_message(s, pc, done, blocked_on))
    step_time = max(free) if timeline else 0.0
    idle = [step_time - b for b in busy]
    bubble = sum(idle) / (p * step_time) if step_time else 0.0
    return SimResult(step_time, bubble, idle, busy, peak, [round(x, 9) for x in peak_mem], timeline)


def receives_needed(s: Schedule) -> int:
    """The fewest receives a rank must keep posted for `s` to finish when sends block until
    received. Posting every receive of the step at its start always suffices (no send then blocks),
    so the search ends; posting earlier never hurts, so the answer is a threshold."""
    most = max(1, max(len(acts) for acts in s.actions))
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            simulate(s, blocking_sends=True, receives_ahead=mid)
            hi = mid
        except ScheduleError:
            lo = mid + 1
    return lo


def _deadlock_message(s: Schedule, pc: list[int], done: dict, blocked_on: list) -> str:
    lines = ["schedule deadlocks: no rank can run its next action"]
    for r in range(s.pp):
        if pc[r] >= len(s.actions[r]):
            lines.append(f"  rank {r}: finished")
            continue
        a = s.actions[r][pc[r]]
        if blocked_on[r] is not None:
            rr, key = blocked_on[r]
            lines.append(f"  rank {r}: before {a}, blocked sending to rank {rr} until it posts the receive "
                         f"of {key[0]}{key[1].value}{key[2]}")
            continue
        missing = [d for d in _deps(s, a) if d not in done]
        what = ", ".join(f"{c}{op.value}{mb} on rank {s.rank_of_chunk[c]}" for c, op, mb in missing)
        lines.append(f"  rank {r}: action {a} waits for {what}")
    first = next(r for r in range(s.pp) if pc[r] < len(s.actions[r]))
    return "\n".join(lines) + "\n" + s.grid((first, pc[first]))
