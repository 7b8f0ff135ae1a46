"""ZeRO-3 one layer at a time: gather a layer's weights just before it runs, release them after.

Forward: a pre-hook gathers the layer (waiting for the prefetch if one is in flight) and starts the
next layer's gather, so it overlaps this layer's compute; a post-hook releases it. Backward: a hook on
the layer's output gathers it again just before its gradients flow (prefetching the layer before
it); once autograd has accumulated every gradient of the layer, `ZeroDP` releases it again. Inside
split backward's autograd.grad calls (B and W) no such hook fires: there the layer is released when
its input's gradient is complete (the layer before it starts its backward, or, for a chunk's first
layer, a hook on the chunk's input), which is when a fused backward is also done with it. Between
uses only the 1/D shard of each layer exists. Released storage keeps its tensor objects (resized to
zero bytes), so the views that autograd saved in forward are valid again after the re-gather.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from pipezero.zero.buckets import Bucket, FlatSource, make_buckets


class Gatherer(Protocol):
    """What the hooks ask of ZeRO-3's parameters (zero/gathering.py): this module
    places gathers and releases, the owner runs them."""

    def all_buckets(self) -> Iterable[Bucket]: ...
    def gather(self, bucket: Bucket) -> None: ...
    def prefetch(self, bucket: Bucket) -> None: ...
    def release(self, bucket: Bucket) -> None: ...
    def expect_grads(self, bucket: Bucket) -> None: ...


def layer_index(name: str) -> int:
    """`layers.7.attn.wq.weight` -> 7: buckets follow the model's own layer numbering."""
    return int(name.split(".")[1])


def layer_buckets(named: list[tuple[str, nn.Parameter]], dp: int, dp_rank: int,
                  source: FlatSource | None = None) -> list[Bucket]:
    """One bucket a layer, in backward order (the last layer's first); `source` as make_buckets'."""
    layers: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for n, q in named:
        layers.setdefault(layer_index(n), []).append((n, q))
    return [make_buckets(layers[i], float("inf"), dp, dp_rank, source)[0] for i in sorted(layers, reverse=True)]


def install(zero: Gatherer, chunks: dict[int, nn.Module]) -> None:
    """Hook every layer of every chunk to gather and release its bucket around each use. A layer
    that uses another layer's parameter (a head tied to the embedding, in the same chunk) gathers
    that layer's bucket too: the parameter is listed, and bucketed, once, under the embedding."""
    by_layer = {layer_index(b.names[0]): b for b in zero.all_buckets()}
    by_param = {q: b for b in zero.all_buckets() for q in b.params}  # tensors hash by identity
    for chunk in chunks.values():
        layers = [(int(k), m) for k, m in chunk.layers.items() if int(k) in by_layer]
        for pos, (idx, module) in enumerate(layers):
            bucket = by_layer[idx]
            after = by_layer[layers[pos + 1][0]] if pos + 1 < len(layers) else None
            before = by_layer[layers[pos - 1][0]] if pos > 0 else None
            _hook_layer(zero, module, bucket, after, before, _borrowed(module, bucket, by_param))
        # A layer whose own tensors are all frozen owns no bucket, but may still compute with
        # another layer's (a tied head whose norm is frozen: its projection is the embedding)
        for k, module in chunk.layers.items():
            if int(k) not in by_layer and (borrowed := _borrowed(module, None, by_param)):
                _hook_borrower(zero, module, borrowed)


def _borrowed(module: nn.Module, own: Bucket | None, by_param: dict[nn.Parameter, Bucket]) -> list[Bucket]:
    """Buckets other than `own` that hold parameters `module` computes with, in order, once each."""
    return list(dict.fromkeys(b for q in module.parameters() if (b := by_param.get(q)) not in (None, own)))


def _hook_borrower(zero: Gatherer, module: nn.Module, borrowed: list[Bucket]) -> None:
    """Gather the buckets a bucketless layer borrows around its forward and again before its
    backward; they are released after its forward and, as any borrowed bucket, after the chunk's
    backward (zero/gathering.py release_layers)."""
    def pre_forward(_m: nn.Module, _args: tuple) -> None:
        for b in borrowed:
            zero.gather(b)

    def post_forward(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(pre_backward)
        for b in borrowed:
            zero.release(b)

    def pre_backward(grad: torch.Tensor) -> torch.Tensor:
        for b in borrowed:
            zero.gather(b)
        return grad

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)


def _hook_layer(zero: Gatherer, module: nn.Module, bucket: Bucket, after: Bucket | None,
                before: Bucket | None, borrowed: list[Bucket]) -> None:
    def pre_forward(_m: nn.Module, args: tuple) -> None:
        for b in [bucket, *borrowed]:
            zero.gather(b)
        if after is not None:
            zero.prefetch(after)
        x = args[0] if args else None
        if before is None and torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            x.register_hook(after_backward)  # the chunk's first layer: no layer before it to tell

    def after_backward(grad: torch.Tensor) -> torch.Tensor:
        zero.release(bucket)
        return grad

    def post_forward(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(pre_backward)
        for b in [bucket, *borrowed]:
            zero.release(b)

    def pre_backward(grad: torch.Tensor) -> torch.Tensor:
        # The gradient of this layer's output is the next layer's input gradient, complete only
        # once every node of the next layer has run, those making its weight gradients included:
        # the next layer is done with. A fused backward releases it anyway when its gradients
        # arrive; inside autograd.grad (split backward's B and W) no post-accumulate hook fires,
        # and this is what releases it, before this layer gathers: never more than a fused backward.
        if after is not None:
            zero.release(after)
        # a borrowed bucket's gradient is complete only after its own layer's backward: it stays
        # gathered until then, and is released after the chunk's backward (zero/gathering.py)
        for b in [bucket, *borrowed]:
            zero.gather(b)
        zero.expect_grads(bucket)
        if before is not None:
            zero.prefetch(before)
        return grad

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)
