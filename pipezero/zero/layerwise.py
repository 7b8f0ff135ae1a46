"""ZeRO-3 one layer at a time: gather a layer's weights just before it runs, release them after.

Forward: a pre-hook gathers the layer (waiting for the prefetch if one is in flight) and starts the
next layer's gather, so it overlaps this layer's compute; a post-hook releases it. Backward: a hook on
the layer's output gathers it again just before its gradients flow (prefetching the layer before
it); once autograd has accumulated every gradient of the layer, `ZeroDP` releases it again. Between
uses only the 1/D shard of each layer exists. Released storage keeps its tensor objects (resized to
zero bytes), so the views that autograd saved in forward are valid again after the re-gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from pipezero.zero.buckets import Bucket
    from pipezero.zero.sharded import ZeroDP


def layer_index(name: str) -> int:
    """`layers.7.attn.wq.weight` -> 7: buckets follow the model's own layer numbering."""
    return int(name.split(".")[1])


def install(zero: "ZeroDP", chunks: dict[int, nn.Module]) -> None:
    """Hook every layer of every chunk to gather and release its bucket around each use."""
    by_layer = {layer_index(b.names[0]): b for b in zero.all_buckets()}
    for chunk in chunks.values():
        layers = [(int(k), m) for k, m in chunk.layers.items() if int(k) in by_layer]
        for pos, (idx, module) in enumerate(layers):
            bucket = by_layer[idx]
            after = by_layer[layers[pos + 1][0]] if pos + 1 < len(layers) else None
            before = by_layer[layers[pos - 1][0]] if pos > 0 else None
            _hook_layer(zero, module, bucket, after, before)


def _hook_layer(zero: "ZeroDP", module: nn.Module, bucket: "Bucket", after: "Bucket | None",
                before: "Bucket | None") -> None:
    def pre_forward(_m: nn.Module, _args: tuple) -> None:
        zero.gather(bucket)
        if after is not None:
            zero.prefetch(after)

    def post_forward(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(pre_backward)
        zero.release(bucket)

    def pre_backward(grad: torch.Tensor) -> torch.Tensor:
        zero.gather(bucket)
        zero.expect_grads(bucket)
        if before is not None:
            zero.prefetch(before)
        return grad

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)
