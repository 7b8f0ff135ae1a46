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
  bucket); one that does not is waited for by its WAIT, there and nowhere else (layer by layer at
  the moment its layer computes; ZeRO-1/2's gathers of updated weights under --overlap-gather by the
  next program's WAITs, in its first forward of each chunk: a record leaves them in flight and the
  next must wait for each); the blocking one among the gathers after the step waits for every one
  started;
- every wait of a reduction or a gather is held to its place, the instruction that waits (`#i`, or
  `#i@moment` inside compute instruction i), so a wait the runtime chose, even one between the
  same two events, departs from the program;
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
from pipezero.schedules.program import (ActivationCopy, Compute, DataParallel, Group, Kind, LossSum, OptimStep,
                                        PointToPoint)


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
    # a start: the elements' format on the wire (fp32, bf16, int8, int4, fp64; played only: act for
    # activations copied to the host, p2p for transfers)
    wire: str = ""
    step: int = -1  # played: the step it belongs to
    # a wait for a reduction or a gather: the instruction that waits, `#i` (its index in the rank's
    # program) or `#i@moment` (inside compute instruction i, at that moment), or `outside: READER` for a
    # gather of updated weights a reader outside every program waited for (OUTSIDE_READERS); "" for
    # every other event
    place: str = ""
    # played, a wait for a gather: it found nothing in flight (the first step's WAITs, those after a
    # skipped step, or after a reader outside the programs waited first)
    idle: bool = False


# Who may wait for ZeRO-1/2's gathers of updated weights outside every program (zero/sharded.py
# `settle`), and why: each reads the full weights between two programs, or drops them (a --layout auto
# trial's stage, planner/auto_trials.py). Any other wait there is the runtime deciding what the
# program does not say.
OUTSIDE_READERS = ("checkpoint", "memory profile", "end of run", "snapshot", "end of trial")


def expected(instrs: Sequence[object], bp: BucketPlan, applied: bool = True) -> list[Played]:
    """The events of one run of a rank's program `instrs`, in order, each wait of a reduction or a
    gather with its place (`Played.place`). `applied`: the optimizer step updated the weights (a
    non-finite step changes nothing, so the gathers of updated weights after it are not played)."""
    out: list[Played] = []
    reducing: list[str] = []  # reductions in flight, oldest first
    updating: list[str] = []  # ZeRO-1/2: gathers of updated weights not yet waited for
    receiving: dict[Transfer, str] = {}  # receives posted, not yet waited for, by what they carry
    sending: list[str] = []  # sends posted, waited for at the program's end

    def wait(keep: int, place: str) -> None:
        while len(reducing) > keep:
            out.append(Played(PlayEvent.WAIT, reducing.pop(0), place=place))

    stepped = False
    for i, place in placed(instrs):
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
            wait(0, place)
            out.append(Played(PlayEvent.START, str(i), i.nbytes, Group.WORLD.value, i.wire.name, place=place))
            stepped = True
            continue
        if isinstance(i, ActivationCopy):
            out.append(Played(PlayEvent.START, str(i), 0, "host"))
            continue
        if isinstance(i, LossSum):
            out.append(Played(PlayEvent.START, str(i), i.nbytes, i.group.value, i.wire.name))
            continue
        if not isinstance(i, DataParallel):
            continue
        if stepped and not applied:
            break
        if i.kind is Kind.TIED_SUM:
            out.append(Played(PlayEvent.START, f"TIED_SUM({i.chunk})", i.nbytes, i.group.value, _wire(i)))
            continue
        if i.kind in (Kind.OFFLOAD_GRAD, Kind.HOST_STEP):
            reduced = f"REDUCE_GRAD({i.chunk}.{i.bucket})"
            if reduced in reducing:  # its last reduction still in flight: waited for first
                wait(reducing[::-1].index(reduced), place)
            out.append(Played(PlayEvent.START, f"{i.kind.value}({i.chunk}.{i.bucket})", i.nbytes, i.group.value,
                              _wire(i)))
            continue
        sizes = bp.buckets(i.chunk)
        for k in range(len(sizes)) if i.bucket is None else [i.bucket]:
            name = f"{i.kind.value}({i.chunk}.{k})"
            if i.kind is Kind.WAIT:  # a gather started earlier (or by the step before), waited for here
                out.append(Played(PlayEvent.WAIT, i.gather_name(k), place=place))
                continue
            if i.kind is Kind.RESHARD:
                out.append(Played(PlayEvent.RELEASE, name))
                continue
            # a whole chunk's instruction: each bucket's own message
            nbytes = i.nbytes if i.bucket is not None or i.wire is None else i.wire.bytes(sizes[k])
            out.append(Played(PlayEvent.START, name, nbytes, i.group.value, _wire(i)))
            if i.kind is Kind.REDUCE_GRAD:
                reducing.append(name)
            elif stepped:
                updating.append(name)
            elif i.blocking:  # a kept chunk's, bucket by bucket
                out.append(Played(PlayEvent.WAIT, name, place=place))
        if i.kind is Kind.REDUCE_GRAD and i.blocking:
            wait(0, place)
        elif i.kind is Kind.REDUCE_GRAD and i.bound is not None:
            wait(i.bound, place)
        elif i.kind is Kind.UNSHARD and stepped and i.blocking:
            out += [Played(PlayEvent.WAIT, n, place=place) for n in updating]
            updating.clear()
    return out


def _wire(i: DataParallel) -> str:
    return i.wire.name if i.wire is not None else ""


def placed(instrs: Sequence[object]) -> list[tuple[object, str]]:
    """The instructions in the order they happen (program.py `flat`), each with its place as the
    record names it: `#i`, a compute instruction's own at `#i@moment`."""
    out: list[tuple[object, str]] = []
    for n, i in enumerate(instrs):
        out.append((i, f"#{n}"))
        if isinstance(i, Compute):
            out += [(d, f"#{n}@{d.at}") for d in i.during]
    return out


def departure(record: Sequence[tuple], want: Sequence[Played], carried: frozenset[str] = frozenset(),
              readers: Sequence[str] = OUTSIDE_READERS) -> tuple[str, frozenset[str]]:
    """Where `record` ((event, name), (event, name, place) or (event, name, place, idle) tuples, as
    played) departs from `want` (`expected`), "" where it does not; and the gathers it leaves in
    flight (ZeRO-1/2's updated weights under --overlap-gather), to pass as `carried` to the next
    record, which must wait for each. Every event in order; a wait of a reduction or a gather at its
    place too (where the record gives one): a wait the runtime adds, even between the same events, is
    a departure. The record may begin with waits for carried gathers by a reader outside the programs
    (OUTSIDE_READERS: a checkpoint, say; `readers`: those that may stand at this record's boundary);
    a carried gather the program's WAIT found landed without one (idle) was waited for by something
    the program does not say."""
    flying: set[str] = set()
    waited: set[str] = set()
    outside: set[str] = set()
    while record and len(record[0]) > 2 and str(record[0][2]).startswith("outside"):
        event, name, place = record[0][:3]
        reader = place.partition(":")[2].strip()
        if event != "wait" or reader not in readers or name not in carried:
            return (f"before the program: {event} {name} by {reader or 'no named reader'} outside every program "
                    f"(only {', '.join(readers)} wait there, for gathers a program left in flight)"), frozenset()
        outside.add(name)
        record = record[1:]
    for n, played in enumerate(record):
        event, name = played[0], played[1]
        if n >= len(want):
            return f"event {n}: played {event} {name} where the program says nothing more", frozenset()
        w = want[n]
        if (event, name) != (w.event.value, w.name):
            return f"event {n}: played {event} {name} where the program says {w.event.value} {w.name}", frozenset()
        if len(played) > 2 and w.place and played[2] != w.place:
            return (f"event {n}: {event} {name} played at {played[2] or 'no instruction'}, where the program "
                    f"places it at {w.place}"), frozenset()
        if name.startswith("UNSHARD"):
            (flying.add if event == "start" else flying.discard)(name)
            if event == "wait":
                if len(played) > 3 and played[3] and name in carried and name not in outside and name not in waited:
                    return (f"event {n}: wait {name} found its gather landed, where the program before left it "
                            f"in flight: something outside the programs waited for it"), frozenset()
                waited.add(name)
    if len(record) < len(want):
        return f"the program's {want[len(record)].event.value} {want[len(record)].name} was never played", frozenset()
    if missed := sorted(carried - waited - outside):
        return f"{missed[0]}, left in flight by the program before, was never waited for", frozenset()
    return "", frozenset(flying)
