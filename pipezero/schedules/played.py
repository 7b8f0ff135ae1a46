"""What a rank must play of its program's collectives, event by event, on every step.

The runtime keeps a record of what it played (zero/coordinator.py `played`: each start of a
bucket's collective with its bytes, wire type and group, each wait for a reduction); the tests hold
it against `expected` of the rank's program on every step of every layout they train, so a
collective the runtime starts, skips, reorders or waits for on its own is a failure, not a
departure nobody sees. The rules below read only the program: where a reduction is waited for is
its REDUCE_GRAD's `blocking` (every reduction in flight) or `bound` (all but the newest `bound`),
and OPTIM_STEP waits for the rest before it updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.program import DataParallel, Instr, Kind, OptimStep, flat


@dataclass(frozen=True)
class Expected:
    event: str  # "start" or "wait" (zero/coordinator.py `Event`)
    name: str  # REDUCE_GRAD(1.0), UNSHARD(0.2), TIED_SUM(0)
    nbytes: int = 0  # a start: the bucket as the program prices it on the wire
    group: str = ""  # a start: dp, node, tie (program.py `Group`)


def expected(instrs: Sequence[Instr], bp: BucketPlan, applied: bool = True) -> list[Expected]:
    """The events of one step of a rank's program `instrs`, in order. `applied`: the optimizer step
    updated the weights (a non-finite step changes nothing, so the gathers of updated weights after
    it are not played)."""
    out: list[Expected] = []
    reducing: list[str] = []  # reductions in flight, oldest first

    def wait(keep: int) -> None:
        while len(reducing) > keep:
            out.append(Expected("wait", reducing.pop(0)))

    stepped = False
    for i in flat(instrs):
        if isinstance(i, OptimStep):
            wait(0)
            stepped = True
            continue
        if not isinstance(i, DataParallel) or i.kind is Kind.RESHARD:
            continue
        if stepped and not applied:
            break
        if i.kind is Kind.TIED_SUM:
            out.append(Expected("start", f"TIED_SUM({i.chunk})", i.nbytes, i.group.value))
            continue
        sizes = bp.buckets(i.chunk)
        whole = sum(sizes)
        for k in range(len(sizes)) if i.bucket is None else [i.bucket]:
            nbytes = i.nbytes if i.bucket is not None else round(i.nbytes * sizes[k] / whole)
            out.append(Expected("start", f"{i.kind.value}({i.chunk}.{k})", nbytes, i.group.value))
            if i.kind is Kind.REDUCE_GRAD:
                reducing.append(f"REDUCE_GRAD({i.chunk}.{k})")
        if i.kind is Kind.REDUCE_GRAD and i.blocking:
            wait(0)
        elif i.kind is Kind.REDUCE_GRAD and i.bound is not None:
            wait(i.bound)
    return out
