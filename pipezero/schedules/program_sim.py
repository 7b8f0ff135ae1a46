"""Time a whole lowered program: compute on one lane a rank, ZeRO's collectives on a second lane that
overlaps it, and the waits that tie them together.

The compute lane follows check.simulate exactly (an action starts when the rank is free and its
inputs have arrived, through check.Links' queues when they come from another rank), so with free
communication a program takes exactly the schedule's time: the collectives add only what they cost.
On top:
- a collective (UNSHARD, REDUCE_GRAD) is a rendezvous of its dp group (TIED_SUM: of the replica's
  ranks holding a tied embedding's copies): it starts when every member
  has issued it and each member's communication lane is free (one stream a group, in order), and
  takes `CommCost.time` (bytes over bandwidth, times the ring's traffic factor);
- a fused backward's reductions start when it ends (the runtime starts each as autograd completes
  its bucket, inside the backward: a conservative bound);
- issuing costs the compute lane nothing; a `blocking` collective holds the rank until it (and so
  everything before it on the lane) has finished, and compute on a ZeRO-3 chunk waits for its
  latest UNSHARD; a REDUCE_GRAD with a `bound` holds the rank until the reduction that many
  places back has finished (the program's in-flight bound); layer by layer, an action's own gathers are issued as it becomes the rank's next
  instruction and it waits for all of them (the runtime waits only where the program's WAITs
  inside the action say, each layer's as it computes: a conservative bound); a WAIT standing on
  its own (a kept chunk gathered one action ahead) holds the rank until the chunk's latest UNSHARD
  ends, and one for a gather this program has not started (ZeRO-1/2's updated weights, started by
  the previous step) passes;
- OPTIM_STEP waits for the rank's collectives to drain, meets every rank of the world in the norm
  all-reduce, then computes for `CommCost.optim`; a forward-only program's LOSS_SUM meets the world
  alike (schedules/forward_only.py);
- --offload optimizer: OFFLOAD_GRAD holds the rank until its bucket's last reduction has ended (the
  runtime waits there for it), then copies on the rank's host lane (`host_bandwidth`), beside
  compute; HOST_STEP holds the rank for its bucket's copy to have ended, the host's AdamW
  (`host_step` an element) and the copy back.
All P x D ranks are played, so a cycle of waits between transfers and collectives raises
ScheduleError like a deadlocked schedule does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipezero.schedules.actions import Op
# check.py's own dependency rules, so compute is timed exactly as the schedule's simulation times it
from pipezero.schedules.check import CostModel, Links, ScheduleError, _deps, _key, check_hops, crossing
from pipezero.schedules.program import (Collective, Compute, DataParallel, Instr, Kind, LossSum, OptimStep, Program,
                                        hoisted)


@dataclass(frozen=True)
class CommCost:
    """What collectives cost, in the compute lane's time unit (F of one stage = 1 by default)."""

    bandwidth: float = math.inf  # bytes a time unit through one rank's link; inf: free
    latency: float = 0.0  # fixed cost of every collective between two or more ranks
    optim: float = 0.0  # the optimizer update itself, on the compute lane
    host_bandwidth: float = math.inf  # --offload optimizer: bytes a time unit between device and host
    host_step: float = 0.0  # --offload optimizer: AdamW on the host, time an updated element

    def time(self, coll: Collective, nbytes: int, group: int) -> float:
        """A ring moves (n-1)/n of the buffer through each link per phase; all-reduce has two phases."""
        if group <= 1 or coll is Collective.LOCAL:
            return 0.0
        phases = 2 if coll is Collective.ALL_REDUCE else 1
        return self.latency + nbytes * phases * (group - 1) / group / self.bandwidth


@dataclass(frozen=True)
class Span:
    rank: int  # global rank
    lane: str  # "compute", "comm" or "host"
    label: str  # the instruction as printed
    kind: Kind
    mb: int  # micro-batch of a compute action, else -1
    start: float
    end: float


@dataclass
class ProgramResult:
    step_time: float
    bubble: float  # idle share of every rank's compute lane over the step
    busy: list[float]  # compute per global rank
    comm_busy: list[float]  # time each rank's collectives take on its communication lane
    timeline: list[Span] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"step_time": self.step_time, "bubble": self.bubble, "busy": self.busy, "comm_busy": self.comm_busy}


# ("dp", pp_rank, n), ("tie", dp_rank, n): the ranks holding a tied embedding's copies, ("world", 0, n)
GroupKey = tuple[str, int, int]


@dataclass
class _Play:
    prog: Program
    ranks: list[list[Instr]]  # the program's, a fused backward's reductions after it (`hoisted`)
    cost: CostModel
    comm: CommCost
    links: Links  # the pipelines' links (each replica's own), queued as check.simulate queues them
    pc: list[int]
    free: list[float]  # when each rank's CPU may go on
    comm_free: list[float]
    busy: list[float]
    comm_busy: list[float]
    seq: dict[tuple[int, str], int] = field(default_factory=dict)  # (rank, group kind) -> next number
    issued: dict[GroupKey, dict[int, float]] = field(default_factory=dict)  # member -> ready time
    ends: dict[GroupKey, float] = field(default_factory=dict)  # resolved collectives' end
    waiting: dict[int, GroupKey] = field(default_factory=dict)  # rank -> the collective it issued here
    last: dict[int, GroupKey] = field(default_factory=dict)  # rank -> its newest collective
    gate: dict[tuple[int, int], GroupKey] = field(default_factory=dict)  # (rank, chunk) -> latest UNSHARD
    reducing: dict[int, list[GroupKey]] = field(default_factory=dict)  # rank -> its reductions, oldest first
    inside: set[int] = field(default_factory=set)  # ranks whose next compute has issued its own gathers
    reduced: dict[tuple[int, int, int | None], GroupKey] = field(default_factory=dict)  # (rank, chunk, bucket) -> latest
    host_free: dict[int, float] = field(default_factory=dict)  # rank -> when its host lane is free
    copied: dict[tuple[int, int, int | None], float] = field(default_factory=dict)  # a bucket's copy to the host ends
    done: dict[tuple, float] = field(default_factory=dict)  # (dp_rank, chunk, op, mb) -> end
    arrived: dict[tuple, float] = field(default_factory=dict)  # (dp_rank, chunk, op, mb) sent on -> arrival
    timeline: list[Span] = field(default_factory=list)

    def members(self, key: GroupKey) -> list[int]:
        if key[0] == "world":
            return list(range(len(self.prog.ranks)))
        if key[0] == "tie":
            s = self.prog.schedule
            ends = sorted({s.rank_of_chunk[0], s.rank_of_chunk[s.n_chunks - 1]})
            return [self.prog.global_rank(p, key[1]) for p in ends]
        return [self.prog.global_rank(key[1], d) for d in range(self.prog.dp)]

    def issue(self, rank: int, group: str, ready: float, instr: Instr) -> GroupKey:
        p, d = self.prog.coords(rank)
        n = self.seq.get((rank, group), 0)
        self.seq[(rank, group)] = n + 1
        key = (group, {"dp": p, "tie": d}.get(group, 0), n)
        self.issued.setdefault(key, {})[rank] = ready
        self.last[rank] = key
        ranks = self.members(key)
        if len(self.issued[key]) == len(ranks):  # the last member arrived: it runs now
            start = max([*self.issued[key].values(), *(self.comm_free[m] for m in ranks)])
            nbytes, coll = (instr.nbytes, instr.collective) if isinstance(instr, DataParallel) \
                else (instr.nbytes, Collective.ALL_REDUCE)
            end = start + self.comm.time(coll, nbytes, len(ranks))
            self.ends[key] = end
            for m in ranks:
                self.comm_free[m] = end
                self.comm_busy[m] += end - start
                self.timeline.append(Span(m, "comm", str(instr), instr.kind, -1, start, end))
        return key

    def step(self, r: int) -> bool:
        """Advance rank `r` by one instruction, or issue the collective it must wait for; False when
        it can do neither until another rank moves."""
        instr = self.ranks[r][self.pc[r]]
        if r in self.waiting:  # issued here earlier; blocked until it ends
            end = self.ends.get(self.waiting[r])
            if end is None:
                return False
            del self.waiting[r]
            self.free[r] = max(self.free[r], end if not isinstance(instr, OptimStep) else end + self.comm.optim)
            if isinstance(instr, OptimStep) and self.comm.optim:
                self.busy[r] += self.comm.optim
                self.timeline.append(Span(r, "compute", "OPTIM_STEP", Kind.OPTIM_STEP, -1, end, end + self.comm.optim))
        elif isinstance(instr, Compute):
            if instr.during and r not in self.inside:
                self.inside.add(r)
                for d in instr.during:
                    if d.kind is Kind.UNSHARD:
                        self.gate[(r, d.chunk)] = self.issue(r, "dp", self.free[r], d)
            start = self.compute_start(r, instr)
            if start is None:
                return False
            self.inside.discard(r)
            a = instr.action
            end = start + self.cost.cost(a, self.prog.schedule.virtual)
            self.busy[r] += end - start
            self.free[r] = end
            self.timeline.append(Span(r, "compute", str(a), instr.kind, a.mb, start, end))
            p, d = self.prog.coords(r)
            s = self.prog.schedule
            out = crossing(s, a)
            if out is not None and s.rank_of_chunk[out[1]] != p:
                receiver = self.prog.global_rank(s.rank_of_chunk[out[1]], d)
                self.arrived[(d, *_key(a))] = self.links.send(out[0], r, receiver, end)
            for k in [_key(a)] + ([(a.chunk, Op.W, a.mb)] if a.op is Op.BW else []):
                self.done[(d, *k)] = end
        elif isinstance(instr, DataParallel) and instr.kind in (Kind.OFFLOAD_GRAD, Kind.HOST_STEP):
            return self.host(r, instr)
        elif isinstance(instr, DataParallel) and instr.kind is Kind.WAIT:
            # a gather this program started without waiting: the rank holds here until it ends (one
            # the previous step started, ZeRO-1/2's updated weights, is over by now)
            key = self.gate.get((r, instr.chunk))
            if key is not None:
                self.waiting[r] = key
                return True
        elif isinstance(instr, DataParallel) and instr.kind is not Kind.RESHARD:
            key = self.issue(r, "tie" if instr.kind is Kind.TIED_SUM else "dp", self.free[r], instr)
            if instr.kind is Kind.UNSHARD:
                self.gate[(r, instr.chunk)] = key
            if instr.blocking:
                self.waiting[r] = key
                return True
            if instr.kind is Kind.REDUCE_GRAD:
                self.reduced[(r, instr.chunk, instr.bucket)] = key
                started = self.reducing.setdefault(r, [])
                started.append(key)
                if instr.bound is not None and len(started) > instr.bound:
                    # the program's in-flight bound: on until the reduction `bound` places back ends
                    self.waiting[r] = started[-1 - instr.bound]
                    return True
        elif isinstance(instr, (OptimStep, LossSum)):  # both meet every rank of the world
            drained = self.ends.get(self.last[r], None) if r in self.last else self.free[r]
            if drained is None:
                return False
            self.waiting[r] = self.issue(r, "world", max(self.free[r], drained), instr)
            return True
        self.pc[r] += 1
        return True

    def host(self, r: int, instr: DataParallel) -> bool:
        """OFFLOAD_GRAD or HOST_STEP on rank `r`; False while the reduction it waits for has not ended."""
        bucket = (r, instr.chunk, instr.bucket)
        copy = instr.nbytes / self.comm.host_bandwidth
        if instr.kind is Kind.OFFLOAD_GRAD:
            key = self.reduced.get(bucket)
            end = self.ends.get(key) if key is not None else self.free[r]
            if end is None:
                return False
            self.free[r] = max(self.free[r], end)
            start = max(self.free[r], self.host_free.get(r, 0.0))
            self.copied[bucket] = self.host_free[r] = start + copy
            self.timeline.append(Span(r, "host", str(instr), instr.kind, -1, start, start + copy))
        else:
            start = max(self.free[r], self.copied.get(bucket, 0.0))
            self.free[r] = start + instr.nbytes / 4 * self.comm.host_step + copy  # the device idles meanwhile
            self.timeline.append(Span(r, "host", str(instr), instr.kind, -1, start, self.free[r]))
        self.pc[r] += 1
        return True

    def compute_start(self, r: int, instr: Compute) -> float | None:
        s, a = self.prog.schedule, instr.action
        p, d = self.prog.coords(r)
        t = self.free[r]
        for dep in _deps(s, a):
            end = self.done.get((d, *dep))
            if end is None:
                return None
            t = max(t, self.arrived[(d, *dep)] if s.rank_of_chunk[dep[0]] != p else end)
        gate = self.gate.get((r, a.chunk))
        if gate is not None:
            if gate not in self.ends:
                return None
            t = max(t, self.ends[gate])
        return t


def simulate_program(prog: Program, cost: CostModel | None = None, comm: CommCost | None = None) -> ProgramResult:
    """Play every rank's program; raise ScheduleError if transfers and collectives deadlock."""
    n = len(prog.ranks)
    ranks = [hoisted(r) for r in prog.ranks]
    cost = cost or CostModel()
    check_hops(prog.schedule, cost)
    play = _Play(prog, ranks, cost, comm or CommCost(), Links(cost), [0] * n, [0.0] * n, [0.0] * n, [0.0] * n,
                 [0.0] * n)
    moved = True
    while moved:
        moved = False
        for r in range(n):
            while play.pc[r] < len(ranks[r]) and play.step(r):
                moved = True
    stuck = [r for r in range(n) if play.pc[r] < len(ranks[r])]
    if stuck:
        lines = [f"  rank {r} (pp {prog.coords(r)[0]}, dp {prog.coords(r)[1]}): waits at #{play.pc[r]} "
                 f"{ranks[r][play.pc[r]]}" for r in stuck]
        raise ScheduleError("program deadlocks: transfers and collectives wait on each other\n" + "\n".join(lines))
    # a collective no instruction waits for (ZeRO-1/2's gathers of updated weights under
    # --overlap-gather, waited for by the next step's forwards) still ends inside the step: the
    # conservative bound of a one-step program
    step = max(*play.free, *play.comm_free, *play.host_free.values(), 0.0)
    bubble = sum(step - b for b in play.busy) / (n * step) if step else 0.0
    return ProgramResult(step, bubble, play.busy, play.comm_busy, play.timeline)
