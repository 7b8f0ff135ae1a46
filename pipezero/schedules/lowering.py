"""The lowering: a proven schedule, ZeRO's rules and the buckets made into every rank's program
(schedules/program.py), each instruction where the rules below place it.

Placement rules (D = data-parallel ranks):
- SEND / RECV: exactly where `posting.plans` posts them (before the action whose boundary they
  belong to; final sends after the last action), peers as global ranks of the same replica.
- REDUCE_GRAD, one a bucket: all-reduce at ZeRO 0, reduce-scatter at 1-3 (ZeRO-1's sum lands in its
  shard of the full bucket it keeps). With
  grad-reduce `step` (and always at ZeRO 0/1) after the chunk's last W or BW of the step
  (`last_weight_grad`); with `microbatch` at ZeRO >= 2 after every W or BW of the chunk (B
  produces no weight gradient; `Rules.reduces_every_backward` in schedules/zero_rules.py). In a
  BW each bucket's sits inside it, at the moment autograd completes the bucket (`grads k`), but
  for a bucket holding a tensor used twice (reduced after it); the simulator starts them when the
  BW ends (a conservative bound). They run async; the rank blocks (`blocking`: waits for this and every
  earlier collective) after each backward in `microbatch` mode, after the chunk's final backward
  at ZeRO-3, otherwise at OPTIM_STEP. Where the reduction lands in a shard (ZeRO 1-3) one that
  does not block carries `bound` (--buckets-in-flight): once it has started, the rank waits for
  the oldest reductions until at most `bound` are still in flight, so only that many full gradient
  buckets (and the one being filled) are alive at once. The memory walk, the simulator and the
  runtime all read the bound here.
- ZeRO-3, a chunk kept gathered (the default when P > 1): UNSHARD (all-gather of every bucket of
  the chunk, blocking) right before its first F of the step, RESHARD right after its final
  backward, once its reductions are drained. `prefetch`
  is a what-if the runtime does not do yet: the UNSHARD moves one compute action earlier and does
  not block; a WAIT of the chunk right before its first compute waits for it (two chunks may then be
  gathered at once).
- ZeRO-3 layer by layer: one bucket a layer, each gathered (started `depth` layers ahead of its
  use, --zero3-prefetch), waited for (a WAIT where the gather was started earlier: the moment its
  layer computes) and released at moments inside the actions that use it (a layer's forward about to
  run, its backward beginning, ...):
  those DataParallel instructions sit in the Compute instruction they belong to (`during`), each
  with its `Trigger`, in the order they happen (schedules/layer_plan.py says which and where); the
  runtime's module hooks fire them at those moments (zero/layerwise.py). The simulator times them
  as if they ran before the action (the runtime overlaps all but the first layer's).
- OPTIM_STEP: drains every reduction, then one all-reduce of (norm^2, loss) over the world, then
  the sharded AdamW; at ZeRO 1 and 2 it is followed by one fp32 all-gather (UNSHARD) per bucket of
  every chunk of the rank, in forward order, played only where the step was applied (a step
  skipped for a non-finite gradient changed no weight). The last one blocks (the rank waits for
  them all at the step's end), or with `overlap_gather` none does and the program's first F of
  each chunk holds a WAIT for each of the chunk's buckets at the `fwd` moment of the first layer that
  reads it (`update_waits`; zero/weight_waits.py's hooks report those moments), so the next step
  (or the evaluation or sample between, whose forward-only programs begin alike) waits for them
  there and nowhere else; on the first step, or after a skipped one, they find nothing in flight.
- --offload optimizer: a bucket's OFFLOAD_GRAD (its reduced gradient, the part this rank updates,
  to host memory) right after the instruction at which the program has waited for the bucket's last
  reduction (a blocking REDUCE_GRAD, or a `bound` that leaves only newer ones in flight), else just
  before OPTIM_STEP; OPTIM_STEP then decides and clips, and one HOST_STEP a bucket follows it in
  forward order (AdamW on the host, the weights copied back), before ZeRO-1/2's UNSHARD of the bucket,
  played only where the step was applied. Both are `Collective.HOST`: no other rank takes part.
- --offload-activations N: OFFLOAD_ACT right after the forward of each of the rank's first N
  micro-batches held across two or more other compute actions, RELOAD_ACT one action before its
  backward (`ActivationCopy`; the executor plays them).
Tied embeddings across ranks: their buckets' REDUCE_GRADs come just before OPTIM_STEP, after a
TIED_SUM has summed the copies between the first and last rank (zero/tied.py); every replica does
so in the same order, so the dp groups still agree.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from pipezero.config import GradReduce
from pipezero.schedules.actions import Action, Op, Schedule
from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.layer_plan import (Moment, Step, Trigger, first_needed, left_gathered, moments, steps,
                                          traverses)
from pipezero.schedules.posting import Post, plans_of
from pipezero.schedules.program import (ActivationCopy, Collective, Compute, DataParallel, Group, Instr, Kind, OptimStep,
                                       PointToPoint, Program)
from pipezero.schedules.wire import FP32, WireFormat, Wires
from pipezero.schedules.zero_rules import RULES, Rules


def last_weight_grad(actions: tuple[Action, ...]) -> dict[int, int]:
    """Index of each chunk's last W or BW (runtime/executor.py's rule, restated: plans import no
    runtime): after it the chunk's gradients for the step are complete."""
    return {a.chunk: i for i, a in enumerate(actions) if a.op in (Op.W, Op.BW)}


def lower(s: Schedule, dp: int, zero: int, grad_reduce: GradReduce, buckets: BucketPlan, *,
          keep_gathered: bool = True, prefetch: bool = False, recompute: bool = False, depth: int = 1,
          in_flight: int = 1, overlap_gather: bool = False, node_shares: bool = False, offload: bool = False,
          offload_activations: int = 0, wires: Wires = Wires(),
          posts: list[list[list[Post]]] | None = None, pp_ranks: Collection[int] | None = None,
          replicas: Collection[int] | None = None) -> Program:
    """Lower schedule `s` on D = `dp` replicas with ZeRO stage `zero` into every rank's program
    (schedules/compile.py `compile_plan` is the way in: it plans the buckets and proves the schedule).

    `wires`: the format of gradient reductions, of ZeRO-3's gathers and of ZeRO-1/2's gathers of
    updated masters (schedules/wire.py), each collective priced in its bytes.
    `posts`: the proven posting order (schedules/proven.py; derived here when not given).
    `keep_gathered`: ZeRO-3 gathers a chunk for its whole step (else layer by layer over
    `buckets.uses`); `prefetch`: kept gathered, a chunk one action ahead; `recompute`: each block's
    backward runs its forward again (layer by layer its parts' moments come again); `depth`: layer by layer, how many
    layers ahead of its use a layer's gather starts (schedules/layer_plan.py); `in_flight`: the
    reductions a non-blocking REDUCE_GRAD leaves in flight (its `bound`, ZeRO 1-3); `overlap_gather`:
    ZeRO-1/2's gathers of updated weights after the step do not block (each chunk's first F holds
    a WAIT for each, at its first reading layer: `update_waits`); `node_shares`: hpZ (--secondary-shard node), where a layer's gathers
    after its first of the step come from the fp32 shares its node kept (`Group.NODE`); `offload`:
    --offload optimizer, the host copies and host steps placed (`_offloaded_grads`);
    `offload_activations`: on each rank, that many micro-batches' saved activations leave the device
    between their forward and backward (`_offloaded_activations`). `pp_ranks`: lower only these
    pipeline ranks (the others' programs are left empty: a memory walk of a few ranks, memory/model.py);
    `replicas`: only these data-parallel ranks (a replica's program is its peers' but for the peers
    it names: `simulate` counts one before it lowers all)."""
    if zero not in RULES:
        raise ValueError(f"ZeRO stage must be 0-3, got {zero}")
    if buckets.dp != dp or len(buckets.numels) != s.n_chunks:
        raise ValueError(f"bucket plan for dp={buckets.dp} and {len(buckets.numels)} chunks; "
                         f"the layout has dp={dp} and {s.n_chunks}")
    layerwise = RULES[zero].sharded_params and not keep_gathered
    posts = plans_of(s) if posts is None else posts
    if in_flight < 1:
        raise ValueError(f"in_flight must be at least 1, got {in_flight}")
    ranks = [_rank_program(s, p, d, dp, RULES[zero], grad_reduce, buckets, layerwise, prefetch, recompute, wires,
                           in_flight, posts[p], depth, overlap_gather, node_shares, offload, offload_activations)
             if (pp_ranks is None or p in pp_ranks) and (replicas is None or d in replicas) else ()
             for p in range(s.pp) for d in range(dp)]
    return Program(s, dp, zero, grad_reduce, buckets, tuple(ranks), layerwise, recompute, depth if layerwise else 1)


def _rank_program(s: Schedule, p: int, d: int, dp: int, rules: Rules, mode: GradReduce, bp: BucketPlan,
                  layerwise: bool, prefetch: bool, recompute: bool, w: Wires, in_flight: int, posts: list,
                  depth: int = 1, overlap_gather: bool = False, node_shares: bool = False,
                  offload: bool = False, offload_activations: int = 0) -> tuple[Instr, ...]:
    acts = s.actions[p]
    final = last_weight_grad(acts)
    first = {a.chunk: i for i, a in reversed(list(enumerate(acts)))}  # each chunk's first action
    kept = rules.sharded_params and not layerwise
    out: list[Instr] = []

    def p2p(boundary: list) -> None:
        out.extend(PointToPoint(q.send, q.transfer, q.peer * dp + d) for q in boundary)

    def whole(kind: Kind, chunk: int, coll: Collective, blocking: bool) -> DataParallel:
        return DataParallel(kind, chunk, None, coll, sum(w.gathers.bytes(n) for n in bp.buckets(chunk)), blocking,
                            wire=w.gathers if kind is Kind.UNSHARD else None)

    gathered: set[int] = set()
    prefetched: set[int] = set()  # kept gathered, prefetch: chunks gathered ahead, not yet waited for
    # --overlap-gather: the gathers the previous step started after its update, waited for in this
    # step's first forward of each chunk, each at its first reading layer (`update_waits`)
    waits = rules.gathers_updates and overlap_gather
    gathered_once: set[tuple[int, int]] = set()  # hpZ: buckets whose first gather of the step is placed
    inside_of: dict[tuple, tuple[tuple[DataParallel, ...], list[DataParallel]]] = {}  # alike for alike actions
    held: frozenset[int] = frozenset()  # layer by layer: what the previous action left gathered
    for i, a in enumerate(acts):
        p2p(posts[i])
        if kept and a.chunk not in gathered:
            gathered.add(a.chunk)
            out.append(whole(Kind.UNSHARD, a.chunk, Collective.ALL_GATHER, True))
        if a.chunk in prefetched:  # its gather ran beside the action before: waited for now
            prefetched.discard(a.chunk)
            out.append(DataParallel(Kind.WAIT, a.chunk, None, Collective.LOCAL, 0))
        ahead = acts[i + 1].chunk if i + 1 < len(acts) else None
        if prefetch and kept and ahead not in gathered and first.get(ahead) == i + 1:
            gathered.add(ahead)  # the next action's chunk, gathered while this one computes
            prefetched.add(ahead)
            out.append(whole(Kind.UNSHARD, ahead, Collective.ALL_GATHER, False))
        is_final = final.get(a.chunk) == i
        per_mb = rules.reduces_every_backward(mode)
        reduces = a.op in (Op.W, Op.BW) and (is_final or per_mb)
        drain = per_mb or (rules.sharded_params and is_final)
        keep = handover(a, acts[i + 1] if i + 1 < len(acts) else None, bp, depth, recompute) if layerwise \
            else frozenset()
        key = (a.op, a.chunk, reduces, drain, held, keep)
        if key not in inside_of:
            inside = layer_collectives(a, bp, recompute, w.gathers, depth=depth, held=held, keep=keep) \
                if layerwise else ()
            inside_of[key] = _with_reductions(a, inside, bp, rules, w, in_flight, layerwise, recompute, drain) \
                if reduces else (inside, [])
        inside, after = inside_of[key]
        if node_shares and layerwise:
            inside = _from_node_shares(inside, gathered_once, bp)
        left = left_gathered(held, [_step_of(d) for d in inside if d.kind in (Kind.UNSHARD, Kind.RESHARD)])
        if waits and first[a.chunk] == i:
            timed = update_waits(bp, a.chunk)
            out.extend(d for d in timed if d.at is None)  # a plan of sizes only: no moment to name
            inside = tuple(d for d in timed if d.at is not None) + inside
        out.append(Compute(a, inside, held, left))
        held = left
        out.extend(after)
        if kept and is_final:
            out.append(whole(Kind.RESHARD, a.chunk, Collective.LOCAL, False))
    p2p(posts[-1])
    if offload_activations:
        out = _offloaded_activations(out, offload_activations)
    out.extend(_tied(sorted(s.chunks(p)), bp, rules, w, in_flight))
    if offload:
        out = _offloaded_grads(out, bp, rules, dp)
    out.append(OptimStep())
    # forward order: the next step's first layers get their weights first
    order = [(c, k, n) for c in sorted(s.chunks(p)) for k, n in reversed(list(enumerate(bp.buckets(c))))]
    for j, (c, k, n) in enumerate(order):
        if offload:
            out.append(DataParallel(Kind.HOST_STEP, c, k, Collective.HOST, FP32.bytes(_updated(n, rules, dp)),
                                    group=Group.HOST, wire=FP32))
        if rules.gathers_updates:
            out.append(DataParallel(Kind.UNSHARD, c, k, Collective.ALL_GATHER, w.updates.bytes(n),
                                    not overlap_gather and j == len(order) - 1, wire=w.updates))
    return tuple(out)


def _updated(padded: int, rules: Rules, dp: int) -> int:
    """Elements of a bucket this rank updates: all of it where every rank updates whole buckets, else
    its shard."""
    return padded if rules.updates_whole else padded // dp


def _offloaded_activations(out: list[Instr], n: int) -> list[Instr]:
    """--offload-activations `n`: the rank's first `n` micro-batches (in forward order) held across two
    or more other compute actions, so each copy has an action to run beside: the warm-up's, which are
    alive when the rank holds the most (P - p of them in 1F1B on pipeline rank p). Each gets
    OFFLOAD_ACT right after its forward and RELOAD_ACT right before the action before its backward."""
    at = [i for i, x in enumerate(out) if isinstance(x, Compute)]
    eligible = [(at[kf], at[kb - 1], c, mb) for kf, kb, c, mb in held_long([out[i].action for i in at])]
    copies: dict[int, list[Instr]] = {}  # position -> copies placed before (reload) or after (offload) it
    for i_f, i_before, c, mb in sorted(eligible)[:n]:
        copies.setdefault(i_f, []).append(ActivationCopy(True, c, mb))
        copies.setdefault(i_before, []).insert(0, ActivationCopy(False, c, mb))
    placed: list[Instr] = []
    for i, x in enumerate(out):
        here = copies.get(i, [])
        placed += [c for c in here if not c.to_host] + [x] + [c for c in here if c.to_host]
    return placed


def held_long(actions: Sequence[Action]) -> list[tuple[int, int, int, int]]:
    """(index of its forward, of its backward, chunk, micro-batch) of each micro-batch a rank's
    `actions` hold across two or more other actions: those --offload-activations may copy."""
    forward: dict[tuple[int, int], int] = {}
    held = []
    for k, a in enumerate(actions):
        if a.op is Op.F:
            forward[(a.chunk, a.mb)] = k
        elif a.op in (Op.B, Op.BW) and (kf := forward.pop((a.chunk, a.mb), None)) is not None and k - kf - 1 >= 2:
            held.append((kf, k, a.chunk, a.mb))
    return held


def _offloaded_grads(out: list[Instr], bp: BucketPlan, rules: Rules, dp: int) -> list[Instr]:
    """--offload optimizer: each bucket's OFFLOAD_GRAD right after the instruction at which the
    program has waited for the bucket's last reduction of the step (a blocking REDUCE_GRAD, or a
    `bound` that leaves only newer ones in flight), so its copy to the host runs beside the rest of
    the backward; those still in flight at the step's end go before OPTIM_STEP, oldest first (each
    waits for its own reduction there)."""
    reductions = [d for i in out for d in (i.during if isinstance(i, Compute) else (i,))
                  if isinstance(d, DataParallel) and d.kind is Kind.REDUCE_GRAD]
    left = {(d.chunk, d.bucket): 0 for d in reductions}
    for d in reductions:
        left[(d.chunk, d.bucket)] += 1

    def offload(c: int, k: int) -> DataParallel:
        return DataParallel(Kind.OFFLOAD_GRAD, c, k, Collective.HOST, FP32.bytes(_updated(bp.buckets(c)[k], rules, dp)),
                            group=Group.HOST, wire=FP32)

    flying: list[tuple[int, int]] = []  # reductions in flight, oldest first
    placed: list[Instr] = []
    for i in out:
        placed.append(i)
        landed: list[tuple[int, int]] = []
        for d in i.during if isinstance(i, Compute) else (i,):
            if not (isinstance(d, DataParallel) and d.kind is Kind.REDUCE_GRAD):
                continue
            flying.append((d.chunk, d.bucket))  # type: ignore[arg-type]
            keep = 0 if d.blocking else d.bound
            while keep is not None and len(flying) > keep:
                landed.append(flying.pop(0))
        for c, k in landed:
            left[(c, k)] -= 1
            if not left[(c, k)]:
                placed.append(offload(c, k))
    for c, k in flying:
        left[(c, k)] -= 1
        if not left[(c, k)]:
            placed.append(offload(c, k))
    return placed


def _from_node_shares(inside: tuple[DataParallel, ...], seen: set[tuple[int, int]],
                      bp: BucketPlan) -> tuple[DataParallel, ...]:
    """hpZ: a bucket's first gather of the step crosses the nodes (and leaves each rank its node's
    fp32 share); each later one gathers those shares inside the node, fp32 on the wire. `seen`: the
    buckets gathered earlier in the step, updated."""
    out = []
    for d in inside:
        if d.kind is Kind.UNSHARD and d.bucket is not None:
            if (d.chunk, d.bucket) in seen:
                d = replace(d, nbytes=FP32.bytes(bp.buckets(d.chunk)[d.bucket]), group=Group.NODE, wire=FP32)
            seen.add((d.chunk, d.bucket))
        out.append(d)
    return tuple(out)


def handover(a: Action, nxt: Action | None, bp: BucketPlan, depth: int, recompute: bool) -> frozenset[int]:
    """Layer by layer: the buckets action `a` keeps gathered for the rank's next action `nxt`, the
    next one's first `depth` - 1 (schedules/layer_plan.py, across actions); none into another chunk,
    past the step's last action, with --recompute, or where either reads no weights."""
    if nxt is None or nxt.chunk != a.chunk or depth < 2 or recompute:
        return frozenset()
    layers, stashed = bp.layers(a.chunk), bp.stashes_w(a.chunk)
    if a.op is not Op.F and not traverses(a.op, a.chunk, stashed):
        return frozenset()  # reads no weights: nothing gathered to keep
    through = traverses(nxt.op, nxt.chunk, stashed)
    if nxt.op is not Op.F and not through:
        return frozenset()
    return frozenset(first_needed(nxt.op, layers, through, depth - 1))


def _step_of(d: DataParallel) -> Step:
    return Step(d.kind is Kind.UNSHARD, d.bucket, d.at, d.blocking, True)  # type: ignore[arg-type]


def update_waits(bp: BucketPlan, chunk: int) -> tuple[DataParallel, ...]:
    """ZeRO-1/2 with --overlap-gather: a WAIT for each bucket of `chunk` whose updated weights the
    step's UNSHARDs left in flight, in the order they were started (forward order), each at the
    `fwd` moment of the first layer that reads it (bucket plan `reads`), so a layer's weights are
    waited for only as it is about to compute; without a layer to name (a plan of sizes only) each
    stands on its own (`at` None), before the forward."""
    first: dict[int, int] = {}
    for layer, ks in bp.reads(chunk).items():
        for k in ks:
            first.setdefault(k, layer)
    order = sorted(range(len(bp.buckets(chunk))), key=lambda k: (first.get(k, -1), -k))
    return tuple(DataParallel(Kind.WAIT, chunk, k, Collective.LOCAL, 0,
                              at=Trigger(Moment.FORWARD, first[k]) if k in first else None) for k in order)


def layer_collectives(a: Action | None, bp: BucketPlan, recompute: bool, wire: WireFormat,
                      chunk: int | None = None, depth: int = 1, held: frozenset[int] = frozenset(),
                      keep: frozenset[int] = frozenset()) -> tuple[DataParallel, ...]:
    """Layer-by-layer ZeRO-3: the gathers and releases inside action `a` (None: a forward of
    `chunk` outside any program, an evaluation or the text sample), each at its trigger
    (schedules/layer_plan.py), each layer's gather `depth` layers ahead; `wire`: the gathers' format
    (a release's bytes are what its gather brought); `held` / `keep`: buckets the previous action left gathered, and those left for the next."""
    c = a.chunk if a is not None else chunk
    assert c is not None
    op = a.op if a is not None else None
    through = op is not None and traverses(op, c, bp.stashes_w(c) and not recompute)
    sizes = bp.buckets(c)
    return tuple(DataParallel(Kind.WAIT, c, st.bucket, Collective.LOCAL, 0, False, st.at) if not st.started else
                 DataParallel(Kind.UNSHARD, c, st.bucket, Collective.ALL_GATHER, wire.bytes(sizes[st.bucket]),
                              st.wait, st.at, wire=wire) if st.gather else
                 DataParallel(Kind.RESHARD, c, st.bucket, Collective.LOCAL, wire.bytes(sizes[st.bucket]), False,
                              st.at)
                 for st in steps(op, bp.layers(c), through, recompute, depth, held, keep))


def _with_reductions(a: Action, inside: tuple[DataParallel, ...], bp: BucketPlan, rules: Rules, w: Wires,
                     in_flight: int, layerwise: bool, recompute: bool,
                     drain: bool) -> tuple[tuple[DataParallel, ...], list[DataParallel]]:
    """One REDUCE_GRAD a bucket of `a`'s chunk, in bucket order, but for a tied embedding's copies
    (reduced in the step: `_tied`). In a fused backward, each bucket's autograd can report complete
    goes inside it at that moment (`grads k`, schedules/layer_plan.py), merged with the action's own
    collectives in the order of the moments; the rest follow the action. With `drain` the last one
    started blocks, and each other one carries the in-flight bound (`_reduction`). Returns (the action's
    collectives, those after it)."""
    c = a.chunk
    ks = [k for k in range(len(bp.buckets(c))) if (c, k) not in bp.held]
    hooked = set(bp.hooked(c)) if a.op is Op.BW else set()
    early = [k for k in ks if k in hooked]
    late = [k for k in ks if k not in hooked]
    last = (late or early or [None])[-1]

    def reduce(k: int, at: Trigger | None) -> DataParallel:
        return _reduction(c, k, bp, rules, w, in_flight, drain and k == last, at)

    if not early:
        return inside, [reduce(k, None) for k in late]
    order = {t: n for n, t in enumerate(moments(a.op, bp.layers(c) if layerwise else (), True, early, recompute))}
    merged = sorted([*inside, *(reduce(k, Trigger(Moment.GRADS, k)) for k in early)],
                    key=lambda d: order[d.at])  # type: ignore[index]
    return tuple(merged), [reduce(k, None) for k in late]


def _reduction(c: int, k: int, bp: BucketPlan, rules: Rules, w: Wires, in_flight: int, blocking: bool,
               at: Trigger | None = None) -> DataParallel:
    """Bucket `k` of chunk `c`'s REDUCE_GRAD: a reduce-scatter where the sum lands in a shard, else an
    all-reduce; one that does not block waits, once started, until at most `in_flight` reductions
    are left in flight where the sum lands in a shard (ZeRO 1-3: the full buckets it frees)."""
    coll = Collective.REDUCE_SCATTER if rules.reduces_to_shard else Collective.ALL_REDUCE
    bound = in_flight if rules.reduces_to_shard and not blocking else None
    return DataParallel(Kind.REDUCE_GRAD, c, k, coll, w.grads.bytes(bp.buckets(c)[k]), blocking, at, bound,
                        wire=w.grads)


def _tied(chunks: list[int], bp: BucketPlan, rules: Rules, w: Wires, in_flight: int) -> list[DataParallel]:
    """Before the step, on a rank holding a copy of a tied embedding: the copies' gradients summed
    (an all-reduce between the first and last pipeline rank of the replica, or a local sum when one
    rank holds both; the fp32 gradients, 4 bytes an element), then the buckets holding them reduced
    over the dp group."""
    held = [(c, k) for c in chunks for k in range(len(bp.buckets(c))) if (c, k) in bp.held]
    if not held:
        return []
    return [DataParallel(Kind.TIED_SUM, held[0][0], None, Collective.ALL_REDUCE, FP32.bytes(bp.tied_numel), True,
                         group=Group.TIE, wire=FP32),
            *(_reduction(c, k, bp, rules, w, in_flight, False) for c, k in held)]

