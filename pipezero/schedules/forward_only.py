"""The held-out evaluation, compiled like a step: every rank's forward-only program.

An evaluation runs each of a replica's micro-batches through the model once, forward only, and sums
the token loss over the world. Each rank's program, micro-batch by micro-batch through its chunks in
model order:
- RECV of a chunk's input right before its F, where the chunk before it sits on another rank (on
  the same rank, as at the V placement's turn, the output is handed over in memory);
- F, with layer-by-layer ZeRO-3's gathers and releases inside it as a forward outside a step fires
  them (lowering.layer_collectives: each layer gathered ahead and released after its forward);
- SEND of its output where the next chunk sits on another rank, waited for at the end;
- ZeRO-3 kept gathered: one blocking UNSHARD of each of the rank's chunks before its first F, and
  one RESHARD of each after the last micro-batch;
- LOSS_SUM: every send waited for, then the summed loss (one fp64 number, non-zero only where the
  last chunk is) all-reduced over the world.
Every rank posts its transfers in this one order, micro-batch-major, so sender and receiver agree
without tags and no pair of ranks waits on each other: a chunk's input comes from a lower chunk, whose
forward of the same micro-batch its rank has already run or runs before its own next receive.
The runtime plays it (runtime/executor.py `evaluate`); the memory model's eval phase prices it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipezero.schedules.actions import Action, Op, Schedule
from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.program import Collective, Compute, DataParallel, Instr, Kind, PointToPoint
from pipezero.schedules.lowering import layer_collectives


@dataclass(frozen=True)
class LossSum:
    """The evaluation's end: every send waited for, the summed loss all-reduced over the world."""

    nbytes: int = 8  # one fp64 number

    @property
    def kind(self) -> str:
        return "LOSS_SUM"

    def __str__(self) -> str:
        return "LOSS_SUM"


EvalInstr = Instr | LossSum


def lower_evaluation(s: Schedule, dp: int, buckets: BucketPlan, microbatches: int, *, sharded_params: bool,
                     layerwise: bool, gather_width: float, depth: int = 1) -> tuple[tuple[EvalInstr, ...], ...]:
    """Every global rank's evaluation program (`ranks[pp_rank * dp + dp_rank]`, as Program numbers
    them) over `microbatches` micro-batches a replica. `sharded_params`: ZeRO-3, gathered a chunk at a
    time unless `layerwise`; `gather_width`: bytes an element of a gather; `depth`: layer by layer,
    how far ahead a layer's gather starts."""
    owner, last = s.rank_of_chunk, s.n_chunks - 1
    out: list[tuple[EvalInstr, ...]] = []
    for p in range(s.pp):
        mine = sorted(s.chunks(p))
        for d in range(dp):
            prog: list[EvalInstr] = []
            kept = sharded_params and not layerwise
            if kept:
                prog += [DataParallel(Kind.UNSHARD, c, None, Collective.ALL_GATHER,
                                      round(buckets.chunk_numel(c) * gather_width), True) for c in mine]
            inside = {c: layer_collectives(None, buckets, False, gather_width, chunk=c, depth=depth)
                      if sharded_params and layerwise else () for c in mine}
            for mb in range(microbatches):
                for c in mine:
                    if c > 0 and owner[c - 1] != p:
                        prog.append(PointToPoint(False, (c, False, mb), owner[c - 1] * dp + d))
                    prog.append(Compute(Action(c, Op.F, mb), inside[c]))
                    if c < last and owner[c + 1] != p:
                        prog.append(PointToPoint(True, (c + 1, False, mb), owner[c + 1] * dp + d))
            if kept:
                prog += [DataParallel(Kind.RESHARD, c, None, Collective.LOCAL, 0) for c in mine]
            prog.append(LossSum())
            out.append(tuple(prog))
    return tuple(out)
