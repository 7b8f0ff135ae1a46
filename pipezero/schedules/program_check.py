"""Prove a lowered program (schedules/program.py) sound before anything runs it.

Four claims, each with an error that names the ranks and the position:
1. Compute and transfers, as today: every replica's compute is the schedule's action list
   (`check.simulate` proves that complete and deadlock-free), every rank posts exactly the
   transfers `posting.plans` gives it, to peers of its own replica, in an order `posting.verify`
   proves cannot deadlock on NCCL's per-pair streams.
2. Every rank of a dp group (the D ranks sharing a pp_rank) issues the same collectives (kind,
   chunk, bucket, operation, bytes) in the same order: collectives match by position, so one rank
   reducing bucket 1 where its peer reduces bucket 0 sums the wrong tensors or hangs.
3. ZeRO's placement: each rank runs OPTIM_STEP (the world's norm all-reduce) exactly once, last but
   for the gathers after it; no gradient is produced after its bucket's last reduction; at ZeRO-3
   every compute runs on gathered weights: between an UNSHARD and a RESHARD of its chunk, or, layer
   by layer, with every layer's buckets gathered and waited for (a prefetch's WAIT) by the moment it
   computes, no release or end of the action with a gather in flight, every collective at a moment
   the action passes, in order, and nothing left gathered
   after it but what it keeps for the rank's next action, which begins with exactly that (never
   past the step's last action; schedules/layer_plan.py). ZeRO-1/2 with --overlap-gather: every
   gather of updated weights the step leaves in flight is waited for once, by a WAIT before the
   first layer that reads its bucket (`check_update_waits`).
4. Transfers and collectives together: `program_sim.simulate_program` plays all P x D ranks with
   each collective a rendezvous of its group; it raises if they can wait on each other in a cycle.
   Programs are fixed sequences of waits on events that, once they happen, stay happened, so how
   far each rank gets does not depend on timing (Kahn's determinacy): one play that finishes
   proves every interleaving finishes. The model keeps transfers and each group's collectives on
   streams of their own; how NCCL shares one GPU between those streams is not modelled.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pipezero.schedules.check import ScheduleError
from pipezero.schedules.actions import Op
from pipezero.schedules.bucket_plan import LayerUse
from pipezero.schedules.layer_plan import Moment, moments, needs, traverses
from pipezero.schedules.posting import Post, plans_of, verify
from pipezero.schedules.program import (Collective, Compute, DataParallel, Instr, Kind, OptimStep, PointToPoint, Program,
                                        defers_update_waits, flat, hoisted)
from pipezero.schedules.program_sim import simulate_program


def check_program(prog: Program) -> None:
    """Raise ScheduleError naming the first violated claim (see the module docstring)."""
    s = prog.schedule
    expected = plans_of(s)
    for d in range(prog.dp):
        boundaries = [_boundaries(prog, prog.global_rank(p, d)) for p in range(s.pp)]
        for p in range(s.pp):
            want = Counter(q for b in expected[p] for q in b)
            got = Counter(q for b in boundaries[p] for q in b)
            if want != got:
                missing, extra = sorted(map(str, want - got)), sorted(map(str, got - want))
                raise ScheduleError(f"rank {prog.global_rank(p, d)} (pp {p}, dp {d}): transfers differ from the "
                                    f"posting plan: missing {missing}, unexpected {extra}")
        verify(s, boundaries)
    for p in range(s.pp):
        check_dp_group(prog, p)
    for r in range(len(prog.ranks)):
        check_placement(prog, r)
    simulate_program(prog)


def _boundaries(prog: Program, rank: int) -> list[list[Post]]:
    """The rank's transfers grouped by the compute action they precede (one more group after the
    last), with peers as pipeline ranks: `posting`'s shape. Also checks its compute is the
    schedule's."""
    p, d = prog.coords(rank)
    acts = [i.action for i in prog.ranks[rank] if isinstance(i, Compute)]
    if tuple(acts) != prog.schedule.actions[p]:
        at = next((k for k, (a, b) in enumerate(zip(acts, prog.schedule.actions[p])) if a != b),
                  min(len(acts), len(prog.schedule.actions[p])))
        raise ScheduleError(f"rank {rank} (pp {p}, dp {d}): compute differs from the schedule at action #{at}\n"
                            f"{prog.schedule.grid((p, at))}")
    out: list[list[Post]] = [[]]
    for i in prog.ranks[rank]:
        if isinstance(i, Compute):
            out.append([])
        elif isinstance(i, PointToPoint):
            peer_p, peer_d = prog.coords(i.peer)
            if peer_d != d:
                raise ScheduleError(f"rank {rank} (dp {d}): {i} names rank {i.peer} of replica {peer_d}")
            out[-1].append(Post(i.send, i.transfer, peer_p))
    return out


def collectives(prog: Program, rank: int) -> list[DataParallel | OptimStep]:
    """The rank's instructions that involve other ranks of its dp group or the world, those inside
    compute instructions included (RESHARD and --offload's host copies are local: not among them)."""
    return [i for i in flat(prog.ranks[rank]) if isinstance(i, OptimStep) or (
        isinstance(i, DataParallel) and i.collective not in (Collective.LOCAL, Collective.HOST))]


def check_dp_group(prog: Program, pp_rank: int) -> None:
    """The D ranks of pipeline rank `pp_rank` issue identical collective sequences."""
    group = [prog.global_rank(pp_rank, d) for d in range(prog.dp)]
    first = [c.signature() for c in collectives(prog, group[0])]
    for r in group[1:]:
        mine = [c.signature() for c in collectives(prog, r)]
        if mine == first:
            continue
        k = next((k for k, (a, b) in enumerate(zip(first, mine)) if a != b), min(len(first), len(mine)))
        theirs = _describe(collectives(prog, group[0]), k)
        ours = _describe(collectives(prog, r), k)
        raise ScheduleError(f"dp group of pp rank {pp_rank} (ranks {group}): rank {r} and rank {group[0]} differ at "
                            f"collective #{k}: rank {group[0]} issues {theirs}, rank {r} issues {ours}")


def _describe(cs: list[DataParallel | OptimStep], k: int) -> str:
    return str(cs[k]) if k < len(cs) else "nothing (its sequence ends)"


def check_placement(prog: Program, rank: int) -> None:
    """OPTIM_STEP once and after all compute and reductions; gradients complete before their last
    reduction (a fused backward's own reductions counted as after it); ZeRO-3 compute on gathered
    weights; what sits inside an action at moments the action passes, in order."""
    left: frozenset[int] = frozenset()  # what the previous action kept gathered
    for k, i in enumerate(prog.ranks[rank]):
        if not isinstance(i, Compute):
            continue
        if i.held != left:
            raise ScheduleError(f"rank {rank}: {i.describe()} (#{k}) begins with buckets {sorted(i.held)} gathered; "
                                f"the action before it left {sorted(left)}")
        if i.during or i.held or i.kept:
            _check_moments(prog, rank, k, i)
        left = i.kept
    if left:
        raise ScheduleError(f"rank {rank}: the step's last action keeps buckets {sorted(left)} gathered past the "
                            f"optimizer step")
    if defers_update_waits(prog.ranks[rank]):
        check_update_waits(prog, rank, prog.ranks[rank])
    instrs = hoisted(prog.ranks[rank])
    steps = [k for k, i in enumerate(instrs) if isinstance(i, OptimStep)]
    if len(steps) != 1:
        raise ScheduleError(f"rank {rank}: OPTIM_STEP appears {len(steps)} times (want once a step)")
    late = next((i for i in instrs[steps[0]:] if isinstance(i, (Compute, PointToPoint))
                 or (isinstance(i, DataParallel) and i.kind is Kind.REDUCE_GRAD)), None)
    if late is not None:
        raise ScheduleError(f"rank {rank}: {late} after OPTIM_STEP")
    last_reduce: dict[tuple[int, int | None], int] = {}
    for k, i in enumerate(instrs):
        if isinstance(i, DataParallel) and i.kind is Kind.REDUCE_GRAD:
            last_reduce[(i.chunk, i.bucket)] = k
    p, _ = prog.coords(rank)
    for c in prog.schedule.chunks(p):
        unreduced = [b for b in range(len(prog.buckets.buckets(c))) if (c, b) not in last_reduce]
        if unreduced:
            raise ScheduleError(f"rank {rank}: chunk {c}'s bucket {unreduced[0]} is never reduced")
    gathered: set[int] = set()
    for k, i in enumerate(instrs):
        if isinstance(i, DataParallel) and i.at is not None:
            raise ScheduleError(f"rank {rank}: {i} (#{k}) names a moment inside an action but stands outside one")
        if isinstance(i, DataParallel) and i.kind is Kind.UNSHARD:
            gathered.add(i.chunk)
        elif isinstance(i, DataParallel) and i.kind is Kind.RESHARD:
            gathered.discard(i.chunk)
        if not isinstance(i, Compute):
            continue
        c = i.action.chunk
        if prog.rules.sharded_params and not prog.layerwise and c not in gathered:
            raise ScheduleError(f"rank {rank}: {i} (#{k}) runs on chunk {c}'s shard: no UNSHARD before it")
        if i.kind in (Kind.W, Kind.BW):
            stale = [b for (ch, b), at in last_reduce.items() if ch == c and at < k]
            if stale:
                raise ScheduleError(f"rank {rank}: {i} (#{k}) produces gradients after chunk {c}'s last "
                                    f"REDUCE_GRAD of bucket {stale[0]}: they would never be reduced")


def check_update_waits(prog: Program, rank: int, instrs: Sequence[Instr]) -> None:
    """ZeRO-1/2 with --overlap-gather: the gathers of updated weights a step leaves in flight are
    each waited for once by program `instrs` (a step's, an evaluation's, a sample's) before any
    layer computes with the bucket: a WAIT at a moment of the chunk's first forward up to that
    layer's `fwd`, or one standing before it."""
    p, _ = prog.coords(rank)
    bp = prog.buckets
    waited: dict[int, set[int]] = {c: set() for c in prog.schedule.chunks(p)}

    def wait(d: DataParallel, where: str) -> None:
        if d.bucket is None or d.bucket in waited.get(d.chunk, {d.bucket}):
            raise ScheduleError(f"rank {rank}: {d} {where} waits again, or for a bucket the rank does not hold")
        waited[d.chunk].add(d.bucket)

    for k, i in enumerate(instrs):
        if isinstance(i, DataParallel) and i.kind is Kind.WAIT:
            wait(i, f"(#{k})")
        if not isinstance(i, Compute) or i.action.op is not Op.F:
            continue
        c = i.action.chunk
        reads = bp.reads(c)
        todo = [d for d in i.during if d.kind is Kind.WAIT]
        for t in moments(Op.F, tuple(LayerUse(j, None) for j in reads), False):
            while todo and todo[0].at == t:
                wait(todo.pop(0), f"in {i} (#{k})")
            if t.moment is Moment.FORWARD and (early := [b for b in reads[t.index] if b not in waited[c]]):
                raise ScheduleError(f"rank {rank}: {i} (#{k}): layer {t.index} computes with bucket {c}.{early[0]} "
                                    f"before any WAIT for its updated weights")
        if not reads and len(waited[c]) < len(bp.buckets(c)):
            raise ScheduleError(f"rank {rank}: {i} (#{k}) computes before every WAIT of chunk {c}")
    for c, ks in waited.items():
        if len(ks) != len(bp.buckets(c)):
            missing = sorted(set(range(len(bp.buckets(c)))) - ks)
            raise ScheduleError(f"rank {rank}: the gather of updated weights of bucket {c}.{missing[0]} is never "
                                f"waited for (no WAIT({c}.{missing[0]}))")


def _check_moments(prog: Program, rank: int, k: int, ins: Compute) -> None:
    """Play the moments action `ins` passes (schedules/layer_plan.py) against the collectives it
    lists: each at a moment the action reaches, in order; layer by layer, every layer's buckets
    gathered (or their gathers in flight) by the moment it computes and nothing gathered after it;
    a reduction only at its own bucket's `grads`, in a fused backward."""
    a, bp = ins.action, prog.buckets
    # ZeRO-1/2's waits for updated weights sit at the moments of the layers a forward reads
    layers = bp.layers(a.chunk) if prog.layerwise else \
        tuple(LayerUse(i, None) for i in bp.reads(a.chunk)) if a.op is Op.F else ()
    through = traverses(a.op, a.chunk, bp.stashes_w(a.chunk) and not prog.recompute)
    grads = bp.hooked(a.chunk) if a.op is Op.BW else []
    need = needs(layers)
    present: set[int] = set(ins.held)
    flying: set[int] = set()
    todo = list(ins.during)

    def fail(why: str) -> ScheduleError:
        return ScheduleError(f"rank {rank}: {ins.describe()} (#{k}): {why}")

    for t in moments(a.op, layers, through, grads, prog.recompute):
        while todo and todo[0].at == t:
            d = todo.pop(0)
            if d.chunk != a.chunk or d.bucket is None:
                raise fail(f"{d} is not one bucket of chunk {a.chunk}")
            if d.kind is Kind.REDUCE_GRAD:
                if t.moment is not Moment.GRADS or t.index != d.bucket:
                    raise fail(f"{d} starts before bucket {d.bucket}'s gradients are complete")
            elif d.kind is Kind.WAIT and not prog.layerwise:
                if not (prog.rules.gathers_updates and a.op is Op.F):
                    raise fail(f"{d} inside an action: only a forward waits for updated weights (ZeRO-1/2)")
            elif not prog.layerwise or d.kind not in (Kind.UNSHARD, Kind.RESHARD, Kind.WAIT):
                raise fail(f"{d} inside an action: only reductions, and layer by layer gathers, waits and releases")
            elif d.kind is Kind.WAIT:
                if d.bucket not in flying:
                    raise fail(f"{d} waits for bucket {d.bucket}, whose gather is not in flight")
                flying.discard(d.bucket)
                present.add(d.bucket)
            elif d.kind is Kind.UNSHARD:
                if d.bucket in present | flying:
                    raise fail(f"{d} gathers bucket {d.bucket} again while it is gathered")
                (present if d.blocking else flying).add(d.bucket)
            else:
                if d.bucket in flying:
                    raise fail(f"{d} releases bucket {d.bucket} while its gather is in flight (no WAIT before it)")
                if d.bucket not in present:
                    raise fail(f"{d} releases bucket {d.bucket}, which is not gathered")
                present.discard(d.bucket)
        for b in need.get(t, ()):
            if b in flying:
                raise fail(f"at {t} the layer computes with bucket {b}, whose gather no WAIT before it waits for")
            if b not in present:
                raise fail(f"at {t} the layer computes with bucket {b}, which is not gathered")
    if todo:
        raise fail(f"{todo[0]} is placed at {todo[0].at}, a moment this action never reaches in that order")
    if flying:
        raise fail(f"the gathers of buckets {sorted(flying)} are still in flight after it: no WAIT")
    if present != ins.kept:
        raise fail(f"buckets {sorted(present)} stay gathered after it; it keeps {sorted(ins.kept)} for the "
                   f"next action")
