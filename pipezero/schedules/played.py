"""What a rank must play of its program's collectives and transfers, event by event, on every step.

The runtime keeps a record of what it played (zero/coordinator.py `played`: each start of a
bucket's collective with its bytes, wire type and group, each wait for a reduction or a gather,
each release of gathered weights; and runtime/p2p.py's transfers to and from other ranks, each
posted and waited for); the tests hold it against `expected` of the rank's program (a
step's, or an evaluation's forward-only one) with `departure`, so a collective the runtime starts,
skips, reorders, waits for or releases on its own is a failure, not a departure nobody sees. The
rules below read only the program:
- a reduction is waited for where its REDUCE_GRAD says: `blocking`, every reduction in flight;
  `bound`, all but the newest `bound`; OPTIM_STEP waits for the rest before it updates;
- a gather that blocks is waited for right after it starts (a kept chunk's UNSHARD: bucket by
  bucket); one that does not is waited for where its layer first needs it, which the program
  places by the moments of its action, not by an instruction: the record may wait for it anywhere
  after its start and before its bucket's release (ZeRO-1/2's gathers of updated weights under
  --overlap-gather: before the next step's forward reads them, so the wait may come in the next
  record); the blocking one among the gathers after the step waits for every one started;
- RESHARD releases its bucket (a kept chunk: each of its buckets);
- SEND and RECV are posted where the program lists them; a receive is waited for as the compute
  action that reads it starts (F: an activation, B or BW: a gradient), the sends at OPTIM_STEP (or
  a forward-only program's LOSS_SUM), before anything else there, in the order they were posted;
- --offload optimizer: OFFLOAD_GRAD starts its bucket's copy to the host, after waiting for the
  bucket's last reduction where that is still in flight; HOST_STEP starts its bucket's update on the
  host (both "host", no other rank); --offload-activations: OFFLOAD_ACT and RELOAD_ACT start their
  micro-batch's copies where the program places them;
- a forward-only program (schedules/forward_only.py: the held-out evaluation, the text sample) is
  held the same way; its LOSS_SUM starts the all-reduce of the loss over the world.
"""

from __future__ import annotations

from collections.abc import Sequence
import enum
from dataclasses import dataclass

from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.actions import Op
from pipezero.schedules.posting import Transfer
from pipezero.schedules.program import (ActivationCopy, Compute, DataParallel, Kind, LossSum, OptimStep, PointToPoint,
                                        flat)


class PlayEvent(str, enum.Enum):
    START = "start"
    WAIT = "wait"
    RELEASE = "release"  # a gathered bucket's storage dropped (RESHARD)


@dataclass(frozen=True)
class Played:
    """One event of a rank's collectives, transfers and host copies: as the runtime played it
    (zero/coordinator.py `played`), or as the program says it must be played (`expected`)."""

    event: PlayEvent
    name: str  # as the program names it: REDUCE_GRAD(1.0), UNSHARD(0.2), TIED_SUM(0), RESHARD(0.2)
    nbytes: int = 0  # a start: the bucket as it travels (played: codes and scales when quantized)
    group: str = ""  # a start: dp, node, tie, host, world (program.py `Group`); pp: a transfer
    wire: str = ""  # played, a start: the elements on the wire (fp32, bf16, int8, int4; act: activations; p2p)
    step: int = -1  # played: the step it belongs to
    floating: bool = False  # expected: a gather's start whose wait the program leaves to its layer's first use


def expected(instrs: Sequence[object], bp: BucketPlan, applied: bool = True) -> list[Played]:
    """The events of one run of a rank's program `instrs`, in order, but for the waits of gathers
    that do not block (`floating` starts). `applied`: the optimizer step updated the weights (a
    non-finite step changes nothing, so the gathers of updated weights after it are not played)."""
    out: list[Played] = []
    reducing: list[str] = []  # reductions in flight, oldest first
    updating: list[str] = []  # ZeRO-1/2: gathers of updated weights not yet waited for
    receiving: dict[Transfer, str] = {}  # receives posted, not yet waited for, by what they carry
    sending: list[str] = []  # sends posted, waited for at the program's end

    def wait(keep: int) -> None:
        while len(reducing) > keep:
            out.append(Played(PlayEvent.WAIT, reducing.pop(0)))

    stepped = False
    for i in flat(instrs):  # type: ignore[arg-type]
        if isinstance(i, PointToPoint):
            out.append(Played(PlayEvent.START, str(i), 0, "pp"))
            if i.send:
                sending.append(str(i))
            else:
                receiving[i.transfer] = str(i)
            continue
        if isinstance(i, Compute):
            a = i.action
            if a.op is not Op.W and (read := receiving.pop((a.chunk, a.op is not Op.F, a.mb), None)):
                out.append(Played(PlayEvent.WAIT, read))  # its input: waited for as the action starts
            continue
        if isinstance(i, (OptimStep, LossSum)):
            out += [Played(PlayEvent.WAIT, n) for n in sending]
            sending.clear()
        if isinstance(i, OptimStep):
            wait(0)
            stepped = True
            continue
        if isinstance(i, ActivationCopy):
            out.append(Played(PlayEvent.START, str(i), 0, "host"))
            continue
        if isinstance(i, LossSum):
            out.append(Played(PlayEvent.START, str(i), i.nbytes, i.group.value))
            continue
        if not isinstance(i, DataParallel):
            continue
        if stepped and not applied:
            break
        if i.kind is Kind.TIED_SUM:
            out.append(Played(PlayEvent.START, f"TIED_SUM({i.chunk})", i.nbytes, i.group.value))
            continue
        if i.kind in (Kind.OFFLOAD_GRAD, Kind.HOST_STEP):
            reduced = f"REDUCE_GRAD({i.chunk}.{i.bucket})"
            if reduced in reducing:  # its last reduction still in flight: waited for first
                wait(reducing[::-1].index(reduced))
            out.append(Played(PlayEvent.START, f"{i.kind.value}({i.chunk}.{i.bucket})", i.nbytes, i.group.value))
            continue
        sizes = bp.buckets(i.chunk)
        whole = sum(sizes)
        for k in range(len(sizes)) if i.bucket is None else [i.bucket]:
            name = f"{i.kind.value}({i.chunk}.{k})"
            if i.kind is Kind.RESHARD:
                out.append(Played(PlayEvent.RELEASE, name))
                continue
            nbytes = i.nbytes if i.bucket is not None else round(i.nbytes * sizes[k] / whole)
            kept = i.kind is Kind.UNSHARD and i.bucket is None  # a chunk gathered bucket by bucket
            floating = i.kind is Kind.UNSHARD and (stepped or not (i.blocking or kept))
            out.append(Played(PlayEvent.START, name, nbytes, i.group.value, floating=floating))
            if i.kind is Kind.REDUCE_GRAD:
                reducing.append(name)
            elif stepped:
                updating.append(name)
            elif not floating:
                out.append(Played(PlayEvent.WAIT, name))
        if i.kind is Kind.REDUCE_GRAD and i.blocking:
            wait(0)
        elif i.kind is Kind.REDUCE_GRAD and i.bound is not None:
            wait(i.bound)
        elif i.kind is Kind.UNSHARD and stepped and i.blocking:
            out += [Played(PlayEvent.WAIT, n) for n in updating]
            updating.clear()
    return out


def departure(record: Sequence[tuple[str, str]], want: Sequence[Played],
              carried: frozenset[str] = frozenset()) -> tuple[str, frozenset[str]]:
    """Where `record` ((event, name) pairs, as played) departs from `want` (`expected`), "" where it
    does not; and the gathers still unwaited at its end (ZeRO-1/2's updated weights under
    --overlap-gather), to pass as `carried` to the next record. A floating gather's wait may come
    anywhere after its start and before its bucket is released; every other event in order."""
    unwaited = set(carried)
    j = 0
    for n, (event, name) in enumerate(record):
        if j < len(want) and (event, name) == (want[j].event, want[j].name):
            if want[j].floating:
                unwaited.add(name)
            elif event == "release" and f"UNSHARD{name[len('RESHARD'):]}" in unwaited:
                return f"event {n}: {name} before its gather was waited for", frozenset()
            j += 1
        elif event == "wait" and name in unwaited:
            unwaited.discard(name)
        else:
            said = f"{want[j].event.value} {want[j].name}" if j < len(want) else "nothing more"
            return f"event {n}: played {event} {name} where the program says {said}", frozenset()
    if j < len(want):
        return f"the program's {want[j].event.value} {want[j].name} was never played", frozenset()
    return "", frozenset(unwaited)
