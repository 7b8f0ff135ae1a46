"""Forward-only programs, compiled like a step: the held-out evaluation's and the text sample's.

Both run a model's forward and nothing else, as a program of the step's instruction kinds that the
executor plays (runtime/executor.py `evaluate`, `sample`) and the record is held to
(schedules/played.py). A forward-only program lists, pass by pass (a micro-batch of the evaluation,
a token of the sample) through the rank's chunks in model order:
- RECV of a chunk's input right before its F, where the chunk before it sits on another rank (on
  the same rank, as at the V placement's turn, the output is handed over in memory);
- F, with layer-by-layer ZeRO-3's gathers and releases inside it as an F of the step places them
  (lowering.layer_collectives: each layer gathered `depth` layers ahead, released after its forward);
  with ZeRO-1/2 --overlap-gather, a chunk's first F holds the WAITs for the gathers of updated weights
  the step left in flight, as the step's first F does (lowering.update_waits);
- SEND of its output where the next chunk sits on another rank, waited for at the program's end;
- ZeRO-3 kept gathered: one blocking UNSHARD of each of the rank's chunks before its first F, and
  one RESHARD of each after the last pass.
Every rank posts its transfers in this one order, pass-major, so sender and receiver agree without
tags and no pair of ranks waits on each other: a chunk's input comes from a lower chunk, whose
forward of the same pass its rank has already run or runs before its own next receive.

The evaluation (`lower_evaluation`) runs each of a replica's micro-batches once and ends in
LOSS_SUM: every send waited for, then the summed loss (one fp64 number, non-zero only where the
last chunk is) all-reduced over the world. The memory model's eval phase prices it.

The text sample (`lower_sample`) needs the whole model in one process, so it runs with one pipeline
rank only (a token drawn on the last chunk would have to travel back to the first): one F a token,
on a window of the tokens so far (batch 1). Layer by layer every replica samples the same tokens
(same weights, same seed), each F gathering and releasing its layers; otherwise replica 0 alone
samples, and kept-gathered ZeRO-3's replicas all take part in the gather around it. Where a token's
logits are not finite (a last update made the weights so), the sampler draws nothing more, and the
program is still played as written, every F and the gathers and releases inside them, on every
replica alike.

`check_forward_only` proves such a program as check.py and program_check.py prove a step's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from pipezero.config import GradReduce
from pipezero.schedules.actions import Action, Op, Schedule
from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.check import ScheduleError
from pipezero.schedules.lowering import layer_collectives, update_waits as _update_waits
from pipezero.schedules.program_check import check_dp_group, check_update_waits
from pipezero.schedules.program_sim import simulate_program
from pipezero.schedules.wire import WireFormat
from pipezero.schedules.program import (Collective, Compute, DataParallel, Instr, Kind, LossSum, PointToPoint,
                                        Program, flat)

EvalInstr = Instr | LossSum
Forward = tuple[EvalInstr, ...]  # one rank's forward-only program


def lower_evaluation(s: Schedule, dp: int, buckets: BucketPlan, microbatches: int, *, sharded_params: bool,
                     layerwise: bool, gathers: WireFormat, depth: int = 1,
                     update_waits: bool = False) -> tuple[Forward, ...]:
    """Every global rank's evaluation program (`ranks[pp_rank * dp + dp_rank]`, as Program numbers
    them) over `microbatches` micro-batches a replica. `sharded_params`: ZeRO-3, gathered a chunk at a
    time unless `layerwise`; `gathers`: the gathers' format on the wire; `depth`: layer by layer,
    how far ahead a layer's gather starts; `update_waits`: ZeRO-1/2 --overlap-gather, the step's
    gathers of updated weights may still be in flight: waited for in the first forward (or, on a
    replica that computes nothing, at the program's start)."""
    ranks = _lower_forward(s, dp, buckets, microbatches, range(dp), sharded_params=sharded_params,
                           layerwise=layerwise, gathers=gathers, depth=depth, update_waits=update_waits)
    return tuple((*r, LossSum()) for r in ranks)


def lower_sample(s: Schedule, dp: int, buckets: BucketPlan, tokens: int, *, sharded_params: bool, layerwise: bool,
                 gathers: WireFormat, depth: int = 1, update_waits: bool = False) -> tuple[Forward, ...]:
    """Every global rank's text-sample program: one F of each chunk a token, `tokens` tokens, on one
    pipeline rank (ValueError otherwise); every replica samples layer by layer, else replica 0."""
    if s.pp != 1:
        raise ValueError(f"the text sample runs the whole model in one process: one pipeline rank, not {s.pp}")
    sampling = range(dp) if sharded_params and layerwise else range(1)
    return _lower_forward(s, dp, buckets, tokens, sampling, sharded_params=sharded_params, layerwise=layerwise,
                          gathers=gathers, depth=depth, update_waits=update_waits)


def _lower_forward(s: Schedule, dp: int, buckets: BucketPlan, passes: int, computing: Sequence[int], *,
                   sharded_params: bool, layerwise: bool, gathers: WireFormat, depth: int,
                   update_waits: bool = False) -> tuple[Forward, ...]:
    """Every rank's forward-only program over `passes` passes (module docstring), the F run by the
    replicas in `computing` (the others only take part in kept-gathered ZeRO-3's gathers)."""
    waits = {c: _update_waits(buckets, c) if update_waits else () for c in range(s.n_chunks)}
    owner, last = s.rank_of_chunk, s.n_chunks - 1
    kept = sharded_params and not layerwise
    out: list[Forward] = []
    for p in range(s.pp):
        mine = sorted(s.chunks(p))
        inside = {c: layer_collectives(None, buckets, False, gathers, chunk=c, depth=depth)
                  if sharded_params and layerwise else () for c in mine}
        for d in range(dp):
            prog: list[EvalInstr] = []
            if d not in computing or not passes:  # nothing computes here: the waits stand alone
                prog += [DataParallel(w.kind, w.chunk, w.bucket, w.collective, 0) for c in mine for w in waits[c]]
            if kept:
                prog += [DataParallel(Kind.UNSHARD, c, None, Collective.ALL_GATHER,
                                      sum(gathers.bytes(n) for n in buckets.buckets(c)), True, wire=gathers)
                         for c in mine]
            for mb in range(passes) if d in computing else ():
                for c in mine:
                    if c > 0 and owner[c - 1] != p:
                        prog.append(PointToPoint(False, (c, False, mb), owner[c - 1] * dp + d))
                    prog.append(Compute(Action(c, Op.F, mb), inside[c] if mb else _first(waits[c], prog) + inside[c]))
                    if c < last and owner[c + 1] != p:
                        prog.append(PointToPoint(True, (c + 1, False, mb), owner[c + 1] * dp + d))
            if kept:
                prog += [DataParallel(Kind.RESHARD, c, None, Collective.LOCAL, 0) for c in mine]
            out.append(tuple(prog))
    return tuple(out)


def _first(waits: tuple[DataParallel, ...], prog: list[EvalInstr]) -> tuple[DataParallel, ...]:
    """The waits of a chunk's first forward: those with a moment go inside it, the others (a plan of
    sizes only) before it, in `prog`."""
    prog += [w for w in waits if w.at is None]
    return tuple(w for w in waits if w.at is not None)


def check_forward_only(s: Schedule, dp: int, buckets: BucketPlan, ranks: Sequence[Forward], passes: int,
                       computing: Collection[int] | None = None) -> None:
    """Prove every rank's forward-only program `ranks` (`ranks[pp_rank * dp + dp_rank]`) over
    `passes` passes, run by the replicas in `computing` (None: every one); raise ScheduleError
    naming the first violated claim:
    1. complete: a replica that computes runs F of every chunk on every pass exactly once, each on
       the rank holding the chunk, and every other replica runs none;
    2. transfers: between each pair of ranks, the sends of one are the receives of the other, in
       the same order (no tags travel), and each stays in its replica;
    3. the ranks of a dp group issue the same collectives in the same order (program_check), and
       ZeRO-1/2's waits for updated weights wait for each bucket once, before any layer reads it;
    4. the joint play of all ranks, each collective a rendezvous of its group and LOSS_SUM of the
       world, finishes (program_sim: a cycle of waits raises)."""
    if len(ranks) != s.pp * dp:
        raise ScheduleError(f"{len(ranks)} forward-only programs for {s.pp * dp} ranks")
    want = Counter((c, mb) for c in range(s.n_chunks) for mb in range(passes))
    for d in range(dp):
        forwards = [(r, i.action) for p in range(s.pp) for r in [p * dp + d] for i in ranks[r]
                    if isinstance(i, Compute)]
        if bad := next(((r, a) for r, a in forwards if a.op is not Op.F or s.rank_of_chunk[a.chunk] * dp + d != r),
                       None):
            raise ScheduleError(f"replica {d}: rank {bad[0]} runs {bad[1]}, not an F of a chunk it holds")
        got = Counter((a.chunk, a.mb) for _, a in forwards)
        if got != (want if computing is None or d in computing else Counter()):
            missing, extra = sorted((want - got).elements()), sorted((got - want).elements())
            raise ScheduleError(f"replica {d}: forwards differ from every chunk on every pass once: missing (chunk, "
                                f"pass) {missing[:4]}, repeated or unknown {extra[:4]}")
    for a in range(len(ranks)):
        for b in range(len(ranks)):
            sends = [i.transfer for i in ranks[a] if isinstance(i, PointToPoint) and i.send and i.peer == b]
            recvs = [i.transfer for i in ranks[b] if isinstance(i, PointToPoint) and not i.send and i.peer == a]
            if sends != recvs:
                raise ScheduleError(f"rank {a} sends {[str(t) for t in sends][:4]} to rank {b}, which receives "
                                    f"{[str(t) for t in recvs][:4]} from it")
            if sends and a % dp != b % dp:
                raise ScheduleError(f"rank {a} sends to rank {b} of another replica")
    prog = Program(s, dp, 3 if any(isinstance(i, DataParallel) for r in ranks for i in r) else 0,
                   GradReduce.STEP, buckets, tuple(ranks))  # type: ignore[arg-type]
    for p in range(s.pp):
        check_dp_group(prog, p)
    for r, instrs in enumerate(ranks):  # ZeRO-1/2's waits for updated weights: each bucket once, before its use
        if any(isinstance(i, DataParallel) and i.kind is Kind.WAIT for i in flat(instrs)) \
                and not any(isinstance(i, DataParallel) and i.kind is Kind.UNSHARD for i in flat(instrs)):
            check_update_waits(prog, r, instrs)
    simulate_program(prog)
