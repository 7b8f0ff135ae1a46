"""One program per rank: the schedule's compute, its transfers in the global posting order, and ZeRO's
collectives, lowered into a single ordered list that the checker proves and the simulator times.

The same program runs: stage.py lowers each rank's over the buckets ZeRO built, the executor
(runtime/executor.py) plays it instruction by instruction, handing UNSHARD, RESHARD and REDUCE_GRAD
to zero/sharded.py's `play`; `pipezero simulate --zero` times it and the checker proves it. What an
instruction cannot place is said below: autograd's hooks start a REDUCE_GRAD early, inside the
backward before it, and layer-by-layer ZeRO-3 gathers inside each action.

Placement rules (D = data-parallel ranks):
- SEND / RECV: exactly where `posting.plans` posts them (before the action whose boundary they
  belong to; final sends after the last action), peers as global ranks of the same replica.
- REDUCE_GRAD, one a bucket: all-reduce at ZeRO 0 and 1, reduce-scatter at 2 and 3. With
  grad-reduce `step` (and always at ZeRO 0/1) after the chunk's last W or BW of the step
  (`last_weight_grad`); with `microbatch` at ZeRO >= 2 after every W or BW of the chunk (B
  produces no weight gradient; `Rules.reduces_every_backward` in schedules/zero_rules.py). The runtime
  launches BW's buckets as autograd fills them, during the backward; here they start when it ends
  (a conservative bound). They run async; the rank blocks (`blocking`: waits for this and every
  earlier collective) after each backward in `microbatch` mode, after the chunk's final backward
  at ZeRO-3, otherwise at OPTIM_STEP. ZeRO-2's cap of two buckets in flight during a backward is
  a memory rule of the runtime (zero/sharded.py), not modelled here.
- ZeRO-3, a chunk kept gathered (the default when P > 1): UNSHARD (all-gather of every bucket of
  the chunk, blocking) right before its first F of the step, RESHARD right after its final
  backward, once its reductions are drained. `prefetch`
  is a what-if the runtime does not do yet: the UNSHARD moves one compute action earlier and does
  not block; the chunk's compute waits for it instead (two chunks may then be gathered at once).
- ZeRO-3 layer by layer: per-layer gathers with a one-layer prefetch happen inside each action
  (zero/layerwise.py hooks), which one instruction cannot place; each F, B and BW (and W of chunk
  0, which has no (x, dy) stash and runs autograd through the weights again) is wrapped in one
  UNSHARD and one RESHARD of the whole chunk with `layerwise=True`, timed as if the gather ran
  before the action (the runtime overlaps all but the first layer's).
- OPTIM_STEP: drains every reduction, then one all-reduce of (norm^2, loss) over the world, then
  the sharded AdamW; at ZeRO 1 and 2 it is followed by one blocking fp32 all-gather (UNSHARD) per
  bucket of every chunk of the rank, in chunk order. (The runtime only starts them there, in
  forward order, and each layer waits for its own in the next step's forward, zero/updates.py; a
  one-step program places that wait at the step's end, the conservative bound.)
Tied embeddings across ranks: their buckets' REDUCE_GRADs are placed as any other's, but the
runtime holds them back to OPTIM_STEP, where the copies are summed between the first and last
rank first (zero/tied.py); every replica does so in the same order, so the dp groups still agree.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pipezero.config import GradReduce
from pipezero.schedules.actions import Action, Op, Schedule
from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.posting import Post, Transfer, plans
from pipezero.schedules.zero_rules import RULES, Rules


class Kind(str, enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"
    SEND = "SEND"
    RECV = "RECV"
    UNSHARD = "UNSHARD"  # all-gather of parameter shards into full weights
    RESHARD = "RESHARD"  # drop the full weights, keep the shard (local, no traffic)
    REDUCE_GRAD = "REDUCE_GRAD"  # one bucket's all-reduce or reduce-scatter
    TIED_SUM = "TIED_SUM"  # a tied embedding's copies' gradients summed (first and last pipeline rank)
    OPTIM_STEP = "OPTIM_STEP"  # drain, norm and loss all-reduce over the world, update


class Collective(str, enum.Enum):
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"
    LOCAL = "local"  # RESHARD: no communication


@dataclass(frozen=True)
class Compute:
    action: Action

    @property
    def kind(self) -> Kind:
        return Kind(self.action.op.value)

    def __str__(self) -> str:
        return str(self.action)


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

    kind: Kind  # UNSHARD, RESHARD or REDUCE_GRAD
    chunk: int
    bucket: int | None  # None: every bucket of the chunk
    collective: Collective
    nbytes: int  # the full bucket(s) as they travel (ring traffic is a multiple of this)
    blocking: bool = False  # the rank waits for this and every earlier collective before going on
    layerwise: bool = False  # ZeRO-3 layer by layer: gathers inside the action, one layer ahead

    def signature(self) -> tuple:
        """What every rank of a dp group must agree on, position by position."""
        return (self.kind, self.chunk, self.bucket, self.collective, self.nbytes)

    def __str__(self) -> str:
        where = f"{self.chunk}" if self.bucket is None else f"{self.chunk}.{self.bucket}"
        return f"{self.kind.value}({where}{', layerwise' if self.layerwise else ''}{', wait' if self.blocking else ''})"


@dataclass(frozen=True)
class OptimStep:
    nbytes: int = 16  # the (norm^2, loss) pair in fp64, all-reduced over the world

    @property
    def kind(self) -> Kind:
        return Kind.OPTIM_STEP

    def signature(self) -> tuple:
        return (Kind.OPTIM_STEP, self.nbytes)

    def __str__(self) -> str:
        return "OPTIM_STEP"


Instr = Compute | PointToPoint | DataParallel | OptimStep


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

    @property
    def rules(self) -> Rules:
        return RULES[self.zero]

    def global_rank(self, pp_rank: int, dp_rank: int) -> int:
        return pp_rank * self.dp + dp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, dp_rank) of a global rank."""
        return divmod(rank, self.dp)

    def listing(self, rank: int) -> str:
        return " ".join(str(i) for i in self.ranks[rank])


def started_collectives(instrs: Sequence[Instr], bp: BucketPlan) -> list[str]:
    """The collectives a rank's program starts, in order, one a bucket (`UNSHARD(c.k)`,
    `REDUCE_GRAD(c.k)`) and a tied embedding's `TIED_SUM(c)`: what the runtime must start, in the
    same order (zero/coordinator.py's `issued`). A kept-gathered chunk's UNSHARD gathers its buckets in their order. A layer-by-layer
    UNSHARD stands for per-layer gathers the runtime places inside the compute (zero/layerwise.py),
    which this program does not list: refused here rather than matched loosely."""
    out: list[str] = []
    for i in instrs:
        if not isinstance(i, DataParallel) or i.kind is Kind.RESHARD:
            continue
        if i.layerwise:
            raise ValueError(f"{i}: a layer-by-layer gather is placed by the runtime, not listed by the program")
        if i.kind is Kind.TIED_SUM:
            out.append(f"TIED_SUM({i.chunk})")
            continue
        ks = range(len(bp.buckets(i.chunk))) if i.bucket is None else [i.bucket]
        out.extend(f"{i.kind.value}({i.chunk}.{k})" for k in ks)
    return out


def last_weight_grad(actions: tuple[Action, ...]) -> dict[int, int]:
    """Index of each chunk's last W or BW (runtime/executor.py's rule, restated: plans import no
    runtime): after it the chunk's gradients for the step are complete."""
    return {a.chunk: i for i, a in enumerate(actions) if a.op in (Op.W, Op.BW)}


def lower(s: Schedule, dp: int, zero: int, grad_reduce: GradReduce, buckets: BucketPlan, *,
          keep_gathered: bool = True, prefetch: bool = False, wire_bytes: float = 4,
          grad_bytes: float | None = None, gather_bytes: float | None = None,
          posts: list[list[list[Post]]] | None = None, pp_ranks: Collection[int] | None = None) -> Program:
    """Lower schedule `s` on D = `dp` replicas with ZeRO stage `zero` into every rank's program.

    `wire_bytes`: bytes an element of gradient reductions and ZeRO-3 gathers (2 with bf16); ZeRO-1/2
    gather their fp32 masters (4). Quantized traffic instead: `grad_bytes` an element of every
    reduction, `gather_bytes` of every parameter gather (int8 with a scale a 256: 1.02; int4: 0.52).
    `posts`: the proven posting order (schedules/proven.py; derived here when not given).
    `prefetch`: ZeRO-3 keep-gathered gathers a chunk one action ahead. `pp_ranks`: lower only these
    pipeline ranks (the others' programs are left empty: a memory walk of a few ranks, sim/memory.py)."""
    if zero not in RULES:
        raise ValueError(f"ZeRO stage must be 0-3, got {zero}")
    if buckets.dp != dp or len(buckets.numels) != s.n_chunks:
        raise ValueError(f"bucket plan for dp={buckets.dp} and {len(buckets.numels)} chunks; "
                         f"the layout has dp={dp} and {s.n_chunks}")
    posts = plans(s) if posts is None else posts
    ranks = [_rank_program(s, p, d, dp, RULES[zero], grad_reduce, buckets, keep_gathered, prefetch, wire_bytes,
                           wire_bytes if grad_bytes is None else grad_bytes, gather_bytes, posts[p])
             if pp_ranks is None or p in pp_ranks else () for p in range(s.pp) for d in range(dp)]
    return Program(s, dp, zero, grad_reduce, buckets, tuple(ranks))


def _rank_program(s: Schedule, p: int, d: int, dp: int, rules: Rules, mode: GradReduce, bp: BucketPlan,
                  keep: bool, prefetch: bool, wire: float, grad: float, gather: float | None,
                  posts: list) -> tuple[Instr, ...]:
    acts = s.actions[p]
    final = last_weight_grad(acts)
    first = {a.chunk: i for i, a in reversed(list(enumerate(acts)))}  # each chunk's first action
    layerwise = rules.sharded_params and not keep
    out: list[Instr] = []

    def p2p(boundary: list) -> None:
        out.extend(PointToPoint(q.send, q.transfer, q.peer * dp + d) for q in boundary)

    def whole(kind: Kind, chunk: int, coll: Collective, blocking: bool) -> DataParallel:
        width = gather if gather is not None and coll is Collective.ALL_GATHER else wire
        return DataParallel(kind, chunk, None, coll, round(bp.chunk_numel(chunk) * width), blocking, layerwise)

    gathered: set[int] = set()
    for i, a in enumerate(acts):
        p2p(posts[i])
        uses_weights = a.op is not Op.W or a.chunk == 0
        if layerwise and uses_weights:
            out.append(whole(Kind.UNSHARD, a.chunk, Collective.ALL_GATHER, True))
        elif rules.sharded_params and not layerwise and a.chunk not in gathered:
            gathered.add(a.chunk)
            out.append(whole(Kind.UNSHARD, a.chunk, Collective.ALL_GATHER, True))
        ahead = acts[i + 1].chunk if i + 1 < len(acts) else None
        if prefetch and rules.sharded_params and not layerwise and ahead not in gathered and first.get(ahead) == i + 1:
            gathered.add(ahead)  # the next action's chunk, gathered while this one computes
            out.append(whole(Kind.UNSHARD, ahead, Collective.ALL_GATHER, False))
        out.append(Compute(a))
        if layerwise and uses_weights:
            out.append(whole(Kind.RESHARD, a.chunk, Collective.LOCAL, False))
        is_final = final.get(a.chunk) == i
        per_mb = rules.reduces_every_backward(mode)
        if a.op in (Op.W, Op.BW) and (is_final or per_mb):
            out.extend(_reductions(a.chunk, bp, rules, grad, drain=per_mb or (rules.sharded_params and is_final)))
        if rules.sharded_params and not layerwise and is_final:
            out.append(whole(Kind.RESHARD, a.chunk, Collective.LOCAL, False))
    p2p(posts[-1])
    out.extend(_tied(sorted(s.chunks(p)), bp, rules, grad))
    out.append(OptimStep())
    if rules.gathers_updates:  # forward order: the next step's first layers get their weights first
        for c in sorted(s.chunks(p)):
            sizes = bp.buckets(c)
            out.extend(DataParallel(Kind.UNSHARD, c, k, Collective.ALL_GATHER, round(sizes[k] * (gather or 4)), True)
                       for k in reversed(range(len(sizes))))
    return tuple(out)


def _reductions(chunk: int, bp: BucketPlan, rules: Rules, wire: float, drain: bool) -> list[DataParallel]:
    """One REDUCE_GRAD a bucket of `chunk` in backward order, but for the buckets of a tied
    embedding's copies (reduced in the step: `_tied`); with `drain` the last one blocks."""
    coll = Collective.REDUCE_SCATTER if rules.sharded_grads else Collective.ALL_REDUCE
    ks = [k for k in range(len(bp.buckets(chunk))) if (chunk, k) not in bp.held]
    return [DataParallel(Kind.REDUCE_GRAD, chunk, k, coll, round(bp.buckets(chunk)[k] * wire), drain and k == ks[-1])
            for k in ks]


def _tied(chunks: list[int], bp: BucketPlan, rules: Rules, grad: float) -> list[DataParallel]:
    """Before the step, on a rank holding a copy of a tied embedding: the copies' gradients summed
    (an all-reduce between the first and last pipeline rank of the replica, or a local sum when one
    rank holds both; the fp32 gradients, 4 bytes an element), then the buckets holding them reduced
    over the dp group."""
    held = [(c, k) for c in chunks for k in range(len(bp.buckets(c))) if (c, k) in bp.held]
    if not held:
        return []
    coll = Collective.REDUCE_SCATTER if rules.sharded_grads else Collective.ALL_REDUCE
    return [DataParallel(Kind.TIED_SUM, held[0][0], None, Collective.ALL_REDUCE, bp.tied_numel * 4, True),
            *(DataParallel(Kind.REDUCE_GRAD, c, k, coll, round(bp.buckets(c)[k] * grad), False) for c, k in held)]


def reducing_backwards(program: tuple[Instr, ...] | list[Instr]) -> set[int]:
    """Positions of the W and BW instructions whose chunk's gradients are reduced right after them
    (a REDUCE_GRAD of that chunk before the next compute): autograd's hooks start those reductions
    during the backward itself, bucket by bucket, as soon as each bucket is complete."""
    out: set[int] = set()
    last: tuple[int, int] | None = None  # (position, chunk) of the latest W or BW
    for i, ins in enumerate(program):
        if isinstance(ins, Compute):
            last = (i, ins.action.chunk) if ins.action.op in (Op.W, Op.BW) else None
        elif isinstance(ins, DataParallel) and ins.kind is Kind.REDUCE_GRAD and last and last[1] == ins.chunk:
            out.add(last[0])
    return out
