"""Cut the layer list [embedding, blocks..., head] into contiguous stage chunks.

Policies: `uniform` (layer count), `params` (parameter count) and `cost` (modelled time per layer,
where the LM head's vocab x dim matmul and the embedding's memory traffic count, which matter at
small sizes), or an explicit list of layers per chunk. Balanced cuts minimise the heaviest chunk.

`memory` balances each rank's predicted peak, which depends on the whole run (schedule, ZeRO stage,
micro-batch shape), not on per-layer counts: memory/partition.resolve turns it into an explicit
list first, and here it is only ever explicit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pipezero.config import ModelConfig, Partition

if TYPE_CHECKING:
    from pipezero.models.spec import ModelSpec


def balanced_cuts(weights: list[float], n: int) -> list[int]:
    """Layer counts of `n` contiguous chunks (each >= 1) minimising the heaviest chunk's weight."""
    if n > len(weights):
        raise ValueError(f"cannot cut {len(weights)} layers into {n} non-empty chunks")
    lo, hi = max(weights), sum(weights)

    def chunks_needed(limit: float) -> list[int] | None:
        counts, acc, k = [], 0.0, 0
        for w in weights:
            if k > 0 and acc + w > limit:
                counts.append(k)
                acc, k = 0.0, 0
            acc += w
            k += 1
        counts.append(k)
        return counts if len(counts) <= n else None

    for _ in range(100):
        mid = (lo + hi) / 2
        if chunks_needed(mid) is None:
            lo = mid
        else:
            hi = mid
    counts = chunks_needed(hi) or [1] * n
    while len(counts) < n:  # split the largest chunk to reach exactly n
        i = max(range(len(counts)), key=lambda j: counts[j])
        counts[i:i + 1] = [counts[i] - counts[i] // 2, counts[i] // 2]
    return counts


def partition(model: ModelConfig | ModelSpec, n_chunks: int, policy: Partition, seq_len: int,
              explicit: list[int] | None = None) -> list[tuple[int, int]]:
    """[start, stop) layer slices of the `n_chunks` chunks in model order, from the spec's
    per-layer counts."""
    from pipezero.models.llama_spec import spec_of  # torch: only for a spec; plans call `cut_bounds`

    spec = spec_of(model)
    return cut_bounds(spec.layer_param_counts(), lambda: spec.layer_costs(seq_len), n_chunks, policy, explicit)


def cut_bounds(params: list[int], costs: Callable[[], list[float]], n_chunks: int, policy: Partition,
        explicit: list[int] | None = None) -> list[tuple[int, int]]:
    """`partition` over plain per-layer counts (`params`, and `costs` asked only by the cost
    policy), so torch-free plans (memory/model.py) cut a model as the run will."""
    n_layers = len(params)
    if explicit is not None:
        counts = list(explicit)
    elif n_chunks == 1:  # one stage holds the whole model: no policy has a cut to choose
        counts = [n_layers]
    elif policy is Partition.MEMORY:
        raise ValueError("the memory partition is chosen from the whole run configuration: pass the cuts of "
                         "memory/partition.resolve(cfg) as explicit counts")
    elif policy is Partition.UNIFORM:
        base, extra = divmod(n_layers, n_chunks)
        counts = [base + (1 if i < extra else 0) for i in range(n_chunks)]
    elif policy is Partition.PARAMS:
        counts = balanced_cuts([float(x) for x in params], n_chunks)
    else:
        counts = balanced_cuts(costs(), n_chunks)
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds
