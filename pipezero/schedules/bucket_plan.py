"""How many gradient buckets each stage chunk has, and how big, computed from parameter counts alone.

The lowering (schedules/program.py) places one REDUCE_GRAD a bucket and sizes every collective from
this plan, so it must group parameters the way `zero/buckets.make_buckets` does at run time: walk
the chunk's parameters in reverse model order (the order backward produces their gradients), add
each to the open bucket, and close the bucket once it holds at least `bucket_mb` MiB of fp32.
Every bucket is padded to a multiple of D, so each data-parallel rank owns an equal shard.

`make_buckets` builds torch tensors, so it cannot be called here (plans import no torch); this is
the same grouping rule over plain counts. It is given per-layer counts (models/presets.py knows
layers, not tensors), so a layer is never split: where one layer is larger than the bucket, the
runtime closes the bucket at a tensor boundary inside it and this plan closes it after the layer.
Layer-by-layer ZeRO-3 uses one bucket a layer at run time (`zero/layerwise.layer_buckets`); `layerwise`
gives that plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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

    def buckets(self, chunk: int) -> tuple[int, ...]:
        return self.numels[chunk]

    def chunk_numel(self, chunk: int) -> int:
        return sum(self.numels[chunk])


def _padded(numel: int, dp: int) -> int:
    return -(-numel // dp) * dp


def group_layers(layer_params: Sequence[int], bucket_mb: float) -> list[int]:
    """Element counts of the buckets one chunk's layers fall into (unpadded, backward order), by
    `make_buckets`' rule: close a bucket once it reaches the limit; empty layers add nothing."""
    limit = bucket_mb * 2**20 / 4  # fp32 elements; inf: one bucket a chunk
    out: list[int] = []
    size = 0
    for n in reversed(layer_params):
        if n <= 0:
            continue
        size += n
        if size >= limit:
            out.append(size)
            size = 0
    if size:
        out.append(size)
    return out


def plan_buckets(chunk_layers: Sequence[Sequence[int]], bucket_mb: float, dp: int,
                 layerwise: bool = False, tied_numel: int = 0) -> BucketPlan:
    """`chunk_layers[c]`: parameter counts of chunk c's layers in model order. `layerwise`: one
    bucket a layer, as layer-by-layer ZeRO-3 builds them. `tied_numel`: the embedding (the first
    layer) is tied to the head (the last) and has that many elements; with more than one chunk its
    copies sit in chunk 0's last bucket and the last chunk's first (buckets run in backward order)."""
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    grouped = [[n for n in reversed(layers) if n > 0] if layerwise else group_layers(layers, bucket_mb)
               for layers in chunk_layers]
    numels = tuple(tuple(_padded(n, dp) for n in g) for g in grouped)
    n = len(numels)
    held = frozenset({(0, len(numels[0]) - 1), (n - 1, 0)}) if tied_numel and n > 1 else frozenset()
    return BucketPlan(dp, numels, held, tied_numel if held else 0)


def uniform_plan(n_chunks: int, buckets_per_chunk: int, numel: int, dp: int) -> BucketPlan:
    """Every chunk `buckets_per_chunk` buckets of `numel` elements: for tests and quick what-ifs."""
    return BucketPlan(dp, tuple((_padded(numel, dp),) * buckets_per_chunk for _ in range(n_chunks)))
