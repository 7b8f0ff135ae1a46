"""Which trainable tensors share a gradient bucket, in what order: decided here, once, from names
and shapes alone (no torch).

A bucket is a chunk's tensors laid end to end in one flat buffer, padded to a multiple of D so each
data-parallel rank owns an equal shard; one collective moves a whole bucket. The rule: walk the
chunk's tensors in reverse model order (the order backward produces their gradients), add each to
the open bucket, and close the bucket once it holds at least `bucket_mb` MiB of fp32; so bucket 0
holds the chunk's last tensors and its gradients are complete first. Layer-by-layer ZeRO-3 instead
makes one bucket a layer (its gathers follow the layers), last layer first, or with `sublayer` one a
part of a layer that names its parts (schedules/model_shapes.py: a block's attention and its MLP),
so a step's first gather and last reduction, which nothing can hide, are a part's, not a block's.
Inside a bucket the tensors lie in the same reverse order.

The lowering (schedules/lowering.py) places one REDUCE_GRAD a bucket and sizes every collective from
this plan; the runtime lays its flat buffers out from the same `BucketLayout`s (zero/buckets.py
`build_buckets`), so a bucket's offsets, and with them every shard and every summation over one,
are the plan's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from functools import cached_property, lru_cache

from pipezero.schedules.model_shapes import ChunkShapes, ModelShapes, TensorShape


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: its tensors in the flat buffer's order."""

    tensors: tuple[TensorShape, ...]

    @cached_property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for t in self.tensors:
            out.append(acc)
            acc += t.numel
        return tuple(out)

    def padded(self, dp: int) -> int:
        return _padded(self.numel, dp)


@dataclass(frozen=True)
class LayerUse:
    """A layer, or a part of one, as layer-by-layer ZeRO-3 sees it: the bucket it owns and the
    buckets it borrows. The triggers of its gathers name it by (index, part)."""

    index: int  # model-wide layer index
    bucket: int | None  # its own bucket (one a layer or part); None: nothing of its own trains
    borrows: tuple[int, ...] = ()  # buckets of earlier layers of the chunk it computes with (a tied head)
    part: int = 0  # which part of the layer (`--zero3-unit sublayer`); 0 for a whole layer
    # a part of a block: hooked on its sub-modules, inside the block's forward, so its moments come
    # again when --recompute runs the block's forward again in backward (runtime/recompute.py);
    # `closes`: it is the block's last part (the rerun stops inside it)
    rerun: bool = False
    closes: bool = False


@dataclass(frozen=True)
class BucketPlan:
    """Per global chunk, each bucket's element count padded to a multiple of `dp`, in backward order
    (bucket 0 holds the chunk's last layers: its gradients are complete first)."""

    dp: int
    numels: tuple[tuple[int, ...], ...]
    # An embedding tied to the head across chunks: (chunk, bucket) of the buckets holding its copies,
    # reduced in the step after the copies' gradients are summed (TIED_SUM), and its elements.
    held: frozenset[tuple[int, int]] = frozenset()
    tied_numel: int = 0
    layouts: tuple[tuple[BucketLayout, ...], ...] = ()  # per chunk, its buckets' tensors (empty: sizes only)
    uses: tuple[tuple[LayerUse, ...], ...] = ()  # per chunk, model order: the layers or parts (one bucket each)
    splits: tuple[bool, ...] = ()  # per chunk: split backward's W reads no weights (empty: every chunk)
    # (chunk, bucket) of buckets holding a tensor two layers of the chunk use: it accumulates twice,
    # so autograd's hooks cannot say when it is complete; reduced after the backward
    shared: frozenset[tuple[int, int]] = frozenset()
    sublayer: bool = False  # layer by layer: layers that name parts are a unit a part (LayerUse.part)

    def __hash__(self) -> int:  # hashed once: the lowering caches programs by their bucket plan
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def buckets(self, chunk: int) -> tuple[int, ...]:
        return self.numels[chunk]

    def chunk_numel(self, chunk: int) -> int:
        return sum(self.numels[chunk])

    def layers(self, chunk: int) -> tuple[LayerUse, ...]:
        """The chunk's layers, one bucket each (layer-by-layer ZeRO-3's plans only)."""
        if not self.uses:
            raise ValueError("this bucket plan has no layers: plan it with layerwise=True")
        return self.uses[chunk]

    def reads(self, chunk: int) -> dict[int, tuple[int, ...]]:
        """Each layer of `chunk` (model order) with the buckets its tensors lie in (layer by layer,
        those it owns and borrows), {} for a plan of sizes only: where a forward first reads a
        bucket, so where the program waits for its gather (schedules/lowering.py)."""
        out: dict[int, list[int]] = {}
        if self.layouts:
            for k, b in enumerate(self.layouts[chunk]):
                for t in b.tensors:
                    if k not in out.setdefault(t.layer, []):
                        out[t.layer].append(k)
        elif self.uses:
            for u in self.uses[chunk]:
                out.setdefault(u.index, []).extend(k for k in ((u.bucket,) if u.bucket is not None else ()) + u.borrows
                                                   if k not in out.get(u.index, []))
        return {i: tuple(sorted(out[i], reverse=True)) for i in sorted(out)}

    def hooked(self, chunk: int) -> list[int]:
        """Buckets of `chunk` whose reduction a fused backward starts as soon as autograd has
        accumulated all their gradients (neither a tied copy held for TIED_SUM nor shared)."""
        return [k for k in range(len(self.numels[chunk])) if (chunk, k) not in self.held | self.shared]

    def stashes_w(self, chunk: int) -> bool:
        """Whether a split W of `chunk` runs from B's stash, touching no weight (runtime/executor.py:
        never on the first chunk, which has no input gradient to compute)."""
        return chunk > 0 and (not self.splits or self.splits[chunk])

    def for_dp(self, dp: int) -> BucketPlan:
        """The same buckets padded for D = `dp` (the grouping does not depend on D)."""
        if not self.layouts:
            raise ValueError("this bucket plan has sizes only: plan it from the model's tensors")
        return _for_dp(self, dp)


@lru_cache(maxsize=1024)
def _for_dp(plan: BucketPlan, dp: int) -> BucketPlan:
    """`BucketPlan.for_dp`, made once a plan and D (the planner pads one plan for many layouts)."""
    return replace(plan, dp=dp, numels=tuple(tuple(b.padded(dp) for b in bs) for bs in plan.layouts))


def _padded(numel: int, dp: int) -> int:
    return -(-numel // dp) * dp


def group_tensors(tensors: Sequence[TensorShape], bucket_mb: float,
                  layerwise: bool = False) -> tuple[BucketLayout, ...]:
    """The buckets one chunk's trainable tensors (model order) fall into, bucket 0 first: close a
    bucket once it reaches `bucket_mb` MiB of fp32 (inf: one bucket a chunk); `layerwise`: one a layer."""
    if layerwise:
        layers: dict[int, list[TensorShape]] = {}
        for t in tensors:
            layers.setdefault(t.layer, []).append(t)
        return tuple(BucketLayout(tuple(reversed(layers[i]))) for i in sorted(layers, reverse=True))
    limit = bucket_mb * 2**20 / 4  # fp32 elements; may be inf
    out: list[BucketLayout] = []
    current: list[TensorShape] = []
    size = 0
    for t in reversed(tensors):
        current.append(t)
        size += t.numel
        if size >= limit:
            out.append(BucketLayout(tuple(current)))
            current, size = [], 0
    if current:
        out.append(BucketLayout(tuple(current)))
    return tuple(out)


@lru_cache(maxsize=1024)
def plan_buckets(model: ModelShapes, bucket_mb: float, dp: int, layerwise: bool = False,
                 sublayer: bool = False) -> BucketPlan:
    """Every chunk's buckets for D = `dp`; with a weight tied across chunks, the buckets holding its
    two copies are `held` for the step (their REDUCE_GRADs follow the TIED_SUM); `sublayer` (layer
    by layer only): one bucket a part of the layers that name parts. Made once for alike arguments
    (a pure function of immutable ones: the planner compiles many layouts over one model's shapes)."""
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    split = layerwise and sublayer
    layouts = tuple(_unit_buckets(c, split) if split else group_tensors(c.tensors, bucket_mb, layerwise)
                    for c in model.chunks)
    numels = tuple(tuple(b.padded(dp) for b in bs) for bs in layouts)
    where = {t.name: (c, k) for c, bs in enumerate(layouts) for k, b in enumerate(bs) for t in b.tensors}
    held: frozenset[tuple[int, int]] = frozenset()
    if model.tied is not None:
        first, second = model.tied
        last = len(model.chunks) - 1
        held = frozenset({where[first], where[second]})
        if where[first][0] != 0 or where[second][0] != last:
            raise ValueError(f"tied weight {model.tied}: its copies must sit in the first and last chunk")
    end = model.chunks[-1]
    total = end.stop if end.stop >= 0 else (end.layers[-1].index + 1 if end.layers else 0)  # the model's layers
    uses = tuple(_uses(c, bs, split, total) for c, bs in zip(model.chunks, layouts)) if layerwise else ()
    shared = frozenset(where[n] for chunk in model.chunks for layer in chunk.layers for n in layer.borrows
                       if n in where)
    return BucketPlan(dp, numels, held, model.tied_numel if held else 0, layouts, uses,
                      tuple(c.splits for c in model.chunks), shared, split)


def _unit_buckets(chunk: ChunkShapes, split: bool) -> tuple[BucketLayout, ...]:
    """One bucket a layer, or a part of one where `split` (last first, tensors in reverse order)."""
    units = [ts for layer in chunk.layers for _, ts in layer.units(split) if ts]
    return tuple(BucketLayout(tuple(reversed(ts))) for ts in reversed(units))


def _uses(chunk: ChunkShapes, buckets: tuple[BucketLayout, ...], split: bool = False,
          total: int = 0) -> tuple[LayerUse, ...]:
    """Each layer's units (`total`: the model's layers, the blocks between the embedding and the head)."""
    of_name = {t.name: k for k, b in enumerate(buckets) for t in b.tensors}
    out = []
    for layer in chunk.layers:
        for part, tensors in layer.units(split):
            own = of_name[tensors[0].name] if tensors else None
            borrowed = tuple(dict.fromkeys(of_name[n] for n in layer.borrows if n in of_name and of_name[n] != own))
            if own is not None or borrowed:
                sub = split and bool(layer.parts) and 0 < layer.index < total - 1
                out.append(LayerUse(layer.index, own, borrowed, part, sub, sub and part == len(layer.parts) - 1))
    return tuple(out)


def uniform_plan(n_chunks: int, buckets_per_chunk: int, numel: int, dp: int) -> BucketPlan:
    """Every chunk `buckets_per_chunk` buckets of `numel` elements, each one layer's (so
    layer-by-layer ZeRO-3 lowers over it too): for tests and quick what-ifs."""
    n = buckets_per_chunk
    uses = tuple(tuple(LayerUse(c * n + j, n - 1 - j) for j in range(n)) for c in range(n_chunks))
    return BucketPlan(dp, tuple((_padded(numel, dp),) * n for _ in range(n_chunks)), uses=uses)
