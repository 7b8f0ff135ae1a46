"""One program per rank: the schedule's compute, its transfers in the global posting order, and ZeRO's
collectives, lowered into a single ordered list that the checker proves and the simulator times.

The same program runs: schedules/compile.py compiles every rank's (the only place one is made),
the executor (runtime/executor.py) plays it instruction by instruction, handing UNSHARD, WAIT,
RESHARD, TIED_SUM, REDUCE_GRAD, OFFLOAD_GRAD and HOST_STEP to zero/sharded.py's `play`; `pipezero
simulate --zero` times it and the checker proves it. What happens inside an action sits inside its
compute instruction (`during`), each with the moment that fires it (schedules/layer_plan.py): a
fused backward's reductions, layer-by-layer ZeRO-3's gathers, waits and releases, and ZeRO-1/2's
waits for the updated weights the step before left in flight; the runtime's hooks report the
moments. A gather that does not block is waited for by its WAIT and nowhere else.

The lowering that makes a program, and where it places each instruction, is schedules/lowering.py.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property

from pipezero.config import GradReduce
from pipezero.schedules.actions import Action, Op, Schedule
from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.layer_plan import Trigger
from pipezero.schedules.posting import Transfer
from pipezero.schedules.wire import FP64, WireFormat
from pipezero.schedules.zero_rules import RULES, Rules


class Kind(str, enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND = "SEND"
    RECV = "RECV"
    UNSHARD = "UNSHARD"  # all-gather of parameter shards into full weights
    # the rank waits for a gather an UNSHARD started without waiting (layer by layer a prefetched
    # layer's, at the moment that layer computes; ZeRO-1/2 --overlap-gather an updated bucket's, at the
    # next step's first forward through a layer reading it); local, no traffic
    WAIT = "WAIT"
    RESHARD = "RESHARD"  # drop the full weights, keep the shard (local, no traffic)
    REDUCE_GRAD = "REDUCE_GRAD"  # one bucket's all-reduce or reduce-scatter
    TIED_SUM = "TIED_SUM"  # a tied embedding's copies' gradients summed (first and last pipeline rank)
    OPTIM_STEP = "OPTIM_STEP"  # drain, norm and loss all-reduce over the world, update
    # --offload optimizer: a bucket's reduced gradient (the part this rank updates) copied to host memory
    OFFLOAD_GRAD = "OFFLOAD_GRAD"
    HOST_STEP = "HOST_STEP"  # --offload optimizer: one bucket's AdamW on the host, its weights copied back
    OFFLOAD_ACT = "OFFLOAD_ACT"  # --offload-activations: a micro-batch's saved activations to host memory
    RELOAD_ACT = "RELOAD_ACT"  # and back to the device ahead of its backward
    LOSS_SUM = "LOSS_SUM"  # a forward-only program's end: sends waited for, its summed loss all-reduced over the world


class Group(str, enum.Enum):
    """Whom a collective runs across."""

    DP = "dp"  # the stage's data-parallel replicas
    NODE = "node"  # hpZ: the replicas in this rank's node, from their fp32 shares of the step's first gather
    TIE = "tie"  # the first and last pipeline rank of a replica (a tied embedding's copies)
    HOST = "host"  # no other rank: a copy between this rank's device and its host memory (--offload)
    WORLD = "world"  # every rank of the job (OPTIM_STEP's norm and loss, an evaluation's LOSS_SUM)


class Collective(str, enum.Enum):
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"
    LOCAL = "local"  # RESHARD: no communication
    HOST = "host copy"  # OFFLOAD_GRAD, HOST_STEP: between this rank's device and its host memory, no network


@dataclass(frozen=True)
class Compute:
    action: Action
    # layer-by-layer ZeRO-3: the gathers and releases fired inside this action, in order, each at
    # its trigger (schedules/layer_plan.py)
    during: tuple[DataParallel, ...] = ()
    # layer by layer, depth >= 2: buckets the previous action left gathered for this one, and those
    # this one leaves gathered for the next (schedules/layer_plan.py, across actions)
    held: frozenset[int] = frozenset()
    kept: frozenset[int] = frozenset()

    @property
    def kind(self) -> Kind:
        return Kind(self.action.op.value)

    def __str__(self) -> str:
        return str(self.action)

    def describe(self) -> str:
        """The action with the collectives inside it, as `--listing` prints it."""
        out = f"{self.action}[{' '.join(map(str, self.during))}]" if self.during else str(self.action)
        return out + (f"(keeps {','.join(f'{self.action.chunk}.{k}' for k in sorted(self.kept))})" if self.kept else "")


@dataclass(frozen=True)
class PointToPoint:
    send: bool
    transfer: Transfer  # (consumer chunk, is a gradient, micro-batch)
    peer: int  # global rank

    @property
    def kind(self) -> Kind:
        return Kind.SEND if self.send else Kind.RECV

    def __str__(self) -> str:
        chunk, grad, mb = self.transfer
        way = "to" if self.send else "from"
        return f"{self.kind.value}({'grad' if grad else 'act'} {chunk}:{mb} {way} {self.peer})"


@dataclass(frozen=True)
class DataParallel:
    """A ZeRO operation on one chunk's buckets across the D ranks holding that chunk."""

    kind: Kind  # UNSHARD, WAIT, RESHARD or REDUCE_GRAD
    chunk: int
    bucket: int | None  # None: every bucket of the chunk
    collective: Collective
    nbytes: int  # the full bucket(s) as they travel (ring traffic is a multiple of this)
    # the rank waits before going on: a REDUCE_GRAD for every reduction in flight (its own included),
    # a post-step UNSHARD for every gather of updated weights in flight, any other UNSHARD for its own
    # gather (zero/sharded.py plays each so; schedules/played.py records it so)
    blocking: bool = False
    at: Trigger | None = None  # inside a Compute's `during`: the moment of the action that fires it
    # REDUCE_GRAD that does not block: once started, the rank waits for the oldest reductions in flight
    # until at most `bound` are left (ZeRO-1-3's bound on full gradient buckets alive; None: no wait)
    bound: int | None = None
    group: Group = Group.DP
    # a start: the elements' format on the wire (schedules/wire.py), which `nbytes` prices; None where
    # nothing travels (WAIT, RESHARD)
    wire: WireFormat | None = None

    def signature(self) -> tuple:
        """What every rank of a dp group must agree on, position by position."""
        return (self.kind, self.chunk, self.bucket, self.collective, self.nbytes, self.wire)

    def __str__(self) -> str:
        where = f"{self.chunk}" if self.bucket is None else f"{self.chunk}.{self.bucket}"
        at = f"@{self.at}" if self.at is not None else ""
        node = ", node" if self.group is Group.NODE else ""
        return f"{self.kind.value}({where}{', wait' if self.blocking else ''}{node}){at}"

    def gather_name(self, bucket: int) -> str:
        """The name of the gather of bucket `bucket` of this instruction's chunk that a WAIT waits
        for, as the record names it (schedules/played.py)."""
        return f"{Kind.UNSHARD.value}({self.chunk}.{bucket})"


@dataclass(frozen=True)
class OptimStep:
    """The step's end: every send of the step waited for and its buffer dropped, every reduction
    drained, the (norm^2, loss) all-reduce over the world, the update. What follows it in a program
    (ZeRO-1/2's gathers of updated weights) is played only where the update was applied."""

    nbytes: int = 16  # the (norm^2, loss) pair in fp64, all-reduced over the world
    wire = FP64

    @property
    def kind(self) -> Kind:
        return Kind.OPTIM_STEP

    def signature(self) -> tuple:
        return (Kind.OPTIM_STEP, self.nbytes)

    def __str__(self) -> str:
        return "OPTIM_STEP"


@dataclass(frozen=True)
class ActivationCopy:
    """--offload-activations: the tensors autograd saved in the forward of micro-batch `mb` of `chunk`,
    moved to host memory right after that forward (OFFLOAD_ACT) and back to the device one compute
    action before its backward (RELOAD_ACT), so the copy back runs beside that action."""

    to_host: bool
    chunk: int
    mb: int

    @property
    def kind(self) -> Kind:
        return Kind.OFFLOAD_ACT if self.to_host else Kind.RELOAD_ACT

    def __str__(self) -> str:
        return f"{self.kind.value}({self.chunk}:{self.mb})"


@dataclass(frozen=True)
class LossSum:
    """A held-out evaluation's end: every send waited for, then the loss summed on the ranks holding
    the last chunk (zero elsewhere) all-reduced over the world, one fp64 number."""

    nbytes: int = 8
    group: Group = Group.WORLD
    wire = FP64

    @property
    def kind(self) -> Kind:
        return Kind.LOSS_SUM

    def signature(self) -> tuple:
        return (Kind.LOSS_SUM, self.nbytes)

    def __str__(self) -> str:
        return "LOSS_SUM"


Instr = Compute | PointToPoint | DataParallel | OptimStep | ActivationCopy


@dataclass(frozen=True)
class Program:
    """Every global rank's instructions (`ranks[pp_rank * dp + dp_rank]`, parallel/mesh.py's
    numbering) for one optimizer step."""

    schedule: Schedule
    dp: int
    zero: int
    grad_reduce: GradReduce
    buckets: BucketPlan
    ranks: tuple[tuple[Instr, ...], ...]
    layerwise: bool = False  # ZeRO-3 gathers layer by layer inside the actions (else a chunk kept gathered)
    recompute: bool = False  # each block's backward runs its forward again (runtime/recompute.py)
    depth: int = 1  # layer by layer: a layer's gather starts this many layers before its use

    @property
    def rules(self) -> Rules:
        return RULES[self.zero]

    def global_rank(self, pp_rank: int, dp_rank: int) -> int:
        return pp_rank * self.dp + dp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, dp_rank) of a global rank."""
        return divmod(rank, self.dp)

    def markers(self, rank: int) -> tuple[tuple[Instr, ...], frozenset[int], dict[int, tuple[int, int]]]:
        """Rank `rank`'s program as the memory walk reads it (`walk_view`), made once a program (a
        plan is immutable): the planner's candidates with and without recomputation share one, and
        each is walked several times."""
        return self._markers[rank]

    @cached_property
    def _markers(self) -> tuple[tuple[tuple[Instr, ...], frozenset[int], dict[int, tuple[int, int]]], ...]:
        return tuple(walk_view(r) for r in self.ranks)

    def listing(self, rank: int) -> str:
        return " ".join(i.describe() if isinstance(i, Compute) else str(i) for i in self.ranks[rank])


def flat(instrs: Sequence[Instr]) -> list[Instr]:
    """The instructions in the order they happen, a Compute's own collectives right after it."""
    out: list[Instr] = []
    for i in instrs:
        out.append(i)
        if isinstance(i, Compute):
            out.extend(i.during)
    return out


def chunk_markers(instrs: Sequence[Instr]) -> list[Instr]:
    """The `hoisted` instructions with, layer by layer, each action that gathers written as one
    UNSHARD of its chunk before it and one RESHARD after it, its own gathers dropped: for walks that
    price a chunk's gathered layers as a whole (memory/model.py)."""
    out: list[Instr] = []
    for i in hoisted(instrs):
        if not isinstance(i, Compute) or not (i.during or i.held):
            out.append(i)
        elif i.held or any(d.kind is Kind.UNSHARD for d in i.during):  # gathers, or begins with layers kept
            c = i.action.chunk
            out += [DataParallel(Kind.UNSHARD, c, None, Collective.ALL_GATHER, 0, True), Compute(i.action),
                    DataParallel(Kind.RESHARD, c, None, Collective.LOCAL, 0)]
        else:
            out.append(Compute(i.action) if isinstance(i, Compute) else i)
    return out


def walk_view(instrs: Sequence[Instr]) -> tuple[tuple[Instr, ...], frozenset[int], dict[int, tuple[int, int]]]:
    """`chunk_markers` of `instrs` in one pass, with what the memory walk needs of it: the positions
    of `reducing_backwards` there, and each run of consecutive REDUCE_GRADs by where it starts, as
    (where it ends, an id that alike runs share). Made without new instructions but the markers (one
    pair a chunk): a compute instruction stands for itself (its `during` unread), and a reduction
    hoisted out of a fused backward keeps its moment `at` (`hoisted` drops it: the walk names it so)."""
    out: list[Instr] = []
    reducing: set[int] = set()
    runs: dict[int, tuple[int, int]] = {}
    ids: dict[tuple, int] = {}
    pair: dict[int, tuple[DataParallel, DataParallel]] = {}
    last: tuple[int, int] | None = None  # (position, chunk) of the latest W or BW
    run: list[tuple[int, int | None, bool, int | None]] = []  # the open run of reductions

    def close() -> None:
        alike = tuple(run)
        runs[len(out) - len(run)] = (len(out), ids.setdefault(alike, len(ids)))
        run.clear()

    for ins in instrs:
        if ins.__class__ is DataParallel and ins.kind is Kind.REDUCE_GRAD:  # type: ignore[union-attr]
            if last is not None and last[1] == ins.chunk:  # type: ignore[union-attr]
                reducing.add(last[0])
            run.append((ins.chunk, ins.bucket, ins.blocking, ins.bound))  # type: ignore[union-attr]
            out.append(ins)
            continue
        if run:
            close()
        if ins.__class__ is not Compute:
            out.append(ins)
            continue
        a = ins.action  # type: ignore[union-attr]
        during = ins.during  # type: ignore[union-attr]
        if ins.held or (during and any(d.kind is Kind.UNSHARD for d in during)):  # type: ignore[union-attr]
            if a.chunk not in pair:
                pair[a.chunk] = (DataParallel(Kind.UNSHARD, a.chunk, None, Collective.ALL_GATHER, 0, True),
                                 DataParallel(Kind.RESHARD, a.chunk, None, Collective.LOCAL, 0))
            out += [pair[a.chunk][0], ins, pair[a.chunk][1]]
            last = (len(out) - 2, a.chunk) if a.op in (Op.W, Op.BW) else None
        else:
            out.append(ins)
            last = (len(out) - 1, a.chunk) if a.op in (Op.W, Op.BW) else None
        for d in during:
            if d.kind is Kind.REDUCE_GRAD:
                if last is not None and last[1] == d.chunk:
                    reducing.add(last[0])
                run.append((d.chunk, d.bucket, d.blocking, d.bound))
                out.append(d)
        if run:
            close()
    if run:
        close()
    return tuple(out), frozenset(reducing), runs


def defers_update_waits(instrs: Sequence[Instr]) -> bool:
    """Whether the gathers of updated weights after the step (ZeRO-1/2) are left for the next
    program's WAITs (none of them blocks: --overlap-gather)."""
    after = list(instrs)[next((k for k, i in enumerate(instrs) if isinstance(i, OptimStep)), len(instrs)):]
    gathers = [i for i in after if isinstance(i, DataParallel) and i.kind is Kind.UNSHARD]
    return bool(gathers) and not any(i.blocking for i in gathers)


def hoisted(instrs: Sequence[Instr]) -> list[Instr]:
    """The instructions with the reductions inside each fused backward moved right after it, in
    order: how the simulator and the memory walk price them (as if they started when the backward
    ends, a conservative bound), and where the placement checks look for them."""
    out: list[Instr] = []
    for i in instrs:
        if isinstance(i, Compute) and any(d.kind is Kind.REDUCE_GRAD for d in i.during):
            out.append(Compute(i.action, tuple(d for d in i.during if d.kind is not Kind.REDUCE_GRAD), i.held, i.kept))
            out.extend(replace(d, at=None) for d in i.during if d.kind is Kind.REDUCE_GRAD)
        else:
            out.append(i)
    return out


def in_flight_of(program: Program) -> int:
    """The reductions a non-blocking REDUCE_GRAD of `program` leaves in flight (every one carries the
    same bound; 1 where none carries one)."""
    for rank in program.ranks:
        for i in flat(rank):
            if isinstance(i, DataParallel) and i.bound is not None:
                return i.bound
    return 1


def reducing_backwards(program: tuple[Instr, ...] | list[Instr]) -> set[int]:
    """Positions of the W and BW instructions whose chunk's gradients are reduced right after them
    (a REDUCE_GRAD of that chunk before the next compute), in a `hoisted` program: the memory walk
    prices a fused backward's reductions inside it."""
    out: set[int] = set()
    last: tuple[int, int] | None = None  # (position, chunk) of the latest W or BW
    for i, ins in enumerate(program):
        if isinstance(ins, Compute):
            last = (i, ins.action.chunk) if ins.action.op in (Op.W, Op.BW) else None
        elif isinstance(ins, DataParallel) and ins.kind is Kind.REDUCE_GRAD and last and last[1] == ins.chunk:
            out.add(last[0])
    return out

