"""The moments inside one action and what the program places at them: layer-by-layer ZeRO-3's gathers
and releases, and the gradient reductions autograd's hooks start. Decided here from the plan alone.

Reductions first, for every ZeRO stage: in a fused backward (BW) that the program follows with
reductions, a bucket's REDUCE_GRAD is placed at the moment its last gradient arrives (`grads k`:
autograd has accumulated every tensor of bucket k), so the reduction overlaps the rest of the
backward; buckets are complete in bucket order (their tensors run in reverse model order). A bucket
holding a tensor two layers use (a head tied to the embedding in one chunk) accumulates twice and a
tied embedding's copies wait for TIED_SUM: theirs follow the action. Split backward's W writes its
gradients itself, outside autograd's accumulation: its reductions follow it too.

Layer by layer, a chunk's parameters are one bucket a layer (schedules/bucket_plan.py), present only
around their use; with --zero3-unit sublayer a layer that names parts is a unit a part (a block's
attention, then its MLP), its moments named `fwd 3.1`, and all below that says layer says unit. An action cannot gather them all before it starts (that would be the kept-gathered
chunk), so each of its collectives is tied to a moment inside it, a `Trigger`: a layer's forward
about to run (`fwd`), just returned (`fwd-end`), the gradient of its output complete so its backward
begins (`bwd`), or the action's `start` and `end`. The runtime's module hooks report those moments
(zero/layerwise.py) and fire the instructions the program placed there, in order; they decide none.

The moments an action passes (`moments`): a forward passes every layer's `fwd` and `fwd-end`, in
model order. A backward that runs autograd through the chunk passes every layer's `bwd`, last layer
first: a fused BW; a B, which differentiates with respect to the chunk's input (never on the first
chunk, which has none: its B computes nothing); a W that runs autograd again (the first chunk, a
chunk whose weighted modules W cannot compute from B's stash, or any chunk with --recompute, whose
forward saves nothing for a stash). A W
from B's stash reads no weight and passes nothing (runtime/weight_grad.py).

What happens at them (`steps`), `depth` layers ahead (--zero3-prefetch, 1 by default): at a
layer's `fwd` its bucket (and any bucket it borrows, a head tied to the embedding in the same chunk)
is gathered (a prefetch started earlier is waited for here: a WAIT at this moment, the only place
the runtime waits for it), and the gathers of the next `depth` layers started (those not already gathered or in flight); at `fwd-end` the layer's (and the
borrowed) buckets are released. At a layer's `bwd` the layer after it, done with, is released, its
own bucket gathered and the `depth` layers before it prefetched. So a layer's gather starts `depth`
layers before its use, and at most `depth` + 1 layers are gathered or in flight at a `fwd` (one more
in backward, the layer just done, until its `bwd`'s successor releases it: memory/model.py). A deeper
prefetch gives a gather more compute to hide behind where one layer's compute is shorter than the
next one's gather and the link has idled (an embedding before a block, the link shared with a
backward's reductions), for one more layer of gathered weights. A prefetch still in flight at `end`
(no layer of the action used it) is waited for there; then whatever is gathered is released, but
for what the next action keeps (below), which is so always landed.

Across actions: where the rank's next action reads the same chunk's weights right after this one
(P = 1: F then BW, BW then the next F; a pipeline's F and B of one chunk), its first layers are
this action's last, which a release at `end` and a gather at the next `start` would move twice
and, the first of them waited for at once, expose. With depth d >= 2 the next action's first d - 1
layers (in its order: forward from the first, backward from the last) that this action uses are
kept gathered (`keep`) and the next one begins with them (`held`); depth 1 keeps none, as before.
Never across the optimizer step (the last action of a step keeps nothing: the weights change), nor
into a forward outside the program (an evaluation, the sample), nor with --recompute. At most
d - 1 layers cross, fewer than an action's d + 1 in flight.

With --recompute each block's forward runs again inside its own backward (runtime/recompute.py:
torch's non-reentrant checkpoint around the block's forward, inside the block module's call). A
whole block's moments are its module's, so they do not come again: at its `bwd` its bucket is
gathered and the rerun computes with it; the moments of a recomputed backward are a plain one's.
A block's parts (--zero3-unit sublayer) are hooked on its sub-modules, which the rerun calls: it
starts at the first saved tensor the block's backward needs, which is in its last part, right after
that part's `bwd` (or before the block's first `bwd` when its last part trains nothing and so has
no hooks), and runs until the last tensor the first forward saved is saved again (torch's early
stop), inside the last part: every part passes its `fwd` and `fwd-end` there but the last, which
passes only its `fwd` (when the last part has no hooks, every hooked part passes both). A part's
`fwd` there gathers it (the backward's rule has prefetched it, one part ahead) and prefetches no
further than its block; its `fwd-end` releases nothing: its own backward comes next, and a release
would only move the part twice. So a rerun holds no more parts gathered than a plain backward does.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pipezero.schedules.actions import Op
from pipezero.schedules.bucket_plan import LayerUse


class Moment(str, enum.Enum):
    START = "start"  # the action begins
    FORWARD = "fwd"  # a layer's forward is about to run
    FORWARD_END = "fwd-end"  # a layer's forward has returned
    BACKWARD = "bwd"  # the gradient of a layer's output is complete: its backward begins
    GRADS = "grads"  # every gradient of a bucket has arrived (a fused backward)
    END = "end"  # the action is over


@dataclass(frozen=True)
class Trigger:
    moment: Moment
    index: int = -1  # model-wide layer index; the chunk's bucket for `grads`; -1 for start and end
    part: int = 0  # the layer's part (LayerUse.part): 0 for a whole layer

    def __str__(self) -> str:
        if self.index < 0:
            return self.moment.value
        return f"{self.moment.value} {self.index}" + (f".{self.part}" if self.part else "")


START, END = Trigger(Moment.START), Trigger(Moment.END)


@dataclass(frozen=True)
class Step:
    """One collective of a layer-by-layer action: a gather (started, started and waited for, or
    only waited for: a prefetch started earlier) or a release of bucket `bucket` of the action's
    chunk, at `at`."""

    gather: bool
    bucket: int
    at: Trigger
    wait: bool = False  # the layer needs it now: waited for here
    started: bool = True  # False: only a wait, for the gather a prefetch started (a WAIT instruction)


def traverses(op: Op, chunk: int, stashed: bool) -> bool:
    """Whether a backward `op` of `chunk` runs autograd through the chunk's layers (module docstring);
    `stashed`: its W runs from B's stash."""
    if op is Op.B:
        return chunk > 0
    if op is Op.W:
        return not stashed
    return op is Op.BW


def moments(op: Op | None, layers: Sequence[LayerUse], through: bool, grads: Sequence[int] = (),
            recompute: bool = False) -> list[Trigger]:
    """The moments an action passes, in order; `op` None is a forward outside any program (an
    evaluation, the text sample); `through`: a backward that runs autograd through the chunk;
    `layers`: its layers layer by layer (else none); `grads`: a fused backward's buckets whose
    completion autograd reports (bucket order; layer by layer each right after its layer's `bwd`);
    `recompute`: each block's forward runs again in its backward (module docstring)."""
    out = [START]
    if op in (None, Op.F):
        for u in layers:
            out += [Trigger(Moment.FORWARD, u.index, u.part), Trigger(Moment.FORWARD_END, u.index, u.part)]
    elif through:
        done = set()
        backward = list(reversed(layers))
        for j, u in enumerate(backward):
            first_of_block = recompute and u.rerun and (j == 0 or backward[j - 1].index != u.index)
            again, closes = _rerun([v for v in layers if v.index == u.index]) if first_of_block else ([], True)
            if not closes:
                out += again  # the last part has no hooks: the rerun comes before any `bwd`
            out.append(Trigger(Moment.BACKWARD, u.index, u.part))
            if closes:
                out += again
            if u.bucket is not None and u.bucket in grads:
                out.append(Trigger(Moment.GRADS, u.bucket))
                done.add(u.bucket)
        out += [Trigger(Moment.GRADS, k) for k in grads if k not in done]
    return out + [END]


def _rerun(parts: Sequence[LayerUse]) -> tuple[list[Trigger], bool]:
    """A recomputed block's hooked parts' moments in its rerun, and whether its last part is one of
    them (then the rerun stops inside it, before its `fwd-end`)."""
    again = [t for u in parts
             for t in (Trigger(Moment.FORWARD, u.index, u.part), Trigger(Moment.FORWARD_END, u.index, u.part))]
    closes = any(u.closes for u in parts)
    return (again[:-1] if closes else again), closes


def needs(layers: Sequence[LayerUse]) -> dict[Trigger, tuple[int, ...]]:
    """The buckets a layer computes with, by the moment its computation starts (`fwd`, `bwd`): they
    must be gathered, or their gathers in flight (the runtime waits for them there)."""
    out: dict[Trigger, tuple[int, ...]] = {}
    for u in layers:
        mine = ((u.bucket,) if u.bucket is not None else ()) + u.borrows
        out[Trigger(Moment.FORWARD, u.index, u.part)] = out[Trigger(Moment.BACKWARD, u.index, u.part)] = mine
    return out


def steps(op: Op | None, layers: Sequence[LayerUse], through: bool, recompute: bool = False,
          depth: int = 1, held: Collection[int] = (),
          keep: Collection[int] = ()) -> list[Step]:
    """The action's gathers and releases, in the order they happen, each layer's gather started
    `depth` layers ahead of its use; `held`: buckets the previous action left gathered for this one,
    `keep`: buckets left gathered for the next (module docstring)."""
    if depth < 1:
        raise ValueError(f"prefetch depth must be 1 or more layers, got {depth}")
    owners = [u for u in layers if u.bucket is not None]
    present: set[int] = set(held)
    flying: set[int] = set()
    out: list[Step] = []

    def gather(k: int, at: Trigger) -> None:
        if k in flying:  # prefetched: waited for where the layer needs it
            out.append(Step(True, k, at, wait=True, started=False))
            flying.discard(k)
            present.add(k)
        elif k not in present:
            out.append(Step(True, k, at, wait=True))
            present.add(k)

    def prefetch(k: int, at: Trigger) -> None:
        if k not in flying and k not in present:
            out.append(Step(True, k, at))
            flying.add(k)

    def release(k: int, at: Trigger) -> None:
        if k in present and k not in keep:
            out.append(Step(False, k, at))
            present.discard(k)

    position = {(u.index, u.part): j for j, u in enumerate(owners)}
    of = {(u.index, u.part): u for u in layers}
    rerun = op not in (None, Op.F)  # a forward moment inside a backward: a recomputed block's part
    for t in moments(op, layers, through, (), recompute)[1:-1]:
        u = of[t.index, t.part]
        j = position.get((u.index, u.part))
        if t.moment is Moment.FORWARD:
            for k in ((u.bucket,) if u.bucket is not None else ()) + u.borrows:
                gather(k, t)
            if j is not None:
                for ahead in owners[j + 1:j + 1 + depth]:
                    if not rerun or ahead.index == u.index:  # a rerun goes no further than its block
                        prefetch(ahead.bucket, t)  # type: ignore[arg-type]
        elif t.moment is Moment.FORWARD_END:
            for k in ((u.bucket,) if u.bucket is not None and not rerun else ()) + u.borrows:
                release(k, t)  # not a rerun part's own: its backward comes next
        else:  # backward: the layer after this one is done with
            if j is not None and j + 1 < len(owners):
                release(owners[j + 1].bucket, t)  # type: ignore[arg-type]
            for k in ((u.bucket,) if u.bucket is not None else ()) + u.borrows:
                gather(k, t)
            if j is not None:
                for behind in reversed(owners[max(0, j - depth):j]):
                    prefetch(behind.bucket, t)  # type: ignore[arg-type]
    for k in sorted(flying):  # a prefetch no layer of the action used: landed before it is released or kept
        out.append(Step(True, k, END, wait=True, started=False))
    for k in sorted((present | flying) - set(keep)):
        out.append(Step(False, k, END))
    return out


def left_gathered(held: Collection[int], placed: Sequence[Step]) -> frozenset[int]:
    """The buckets gathered (or in flight) after an action that began with `held` and placed `placed`."""
    out = set(held)
    for st in placed:
        (out.add if st.gather else out.discard)(st.bucket)
    return frozenset(out)


def first_needed(op: Op, layers: Sequence[LayerUse], through: bool, n: int) -> list[int]:
    """The first `n` buckets an action computes with, in the order it needs them (the next action's,
    which this one keeps gathered)."""
    out: list[int] = []
    need = needs(layers)
    for t in moments(op, layers, through):
        out += [b for b in need.get(t, ()) if b not in out]
    return out[:n]
