"""ZeRO-3 one layer at a time: module hooks that report the moments of an action to the program.

Layer by layer, the program places every gather and release of a layer's bucket at a moment inside
an action (schedules/layer_plan.py): a layer's forward about to run (`fwd`), returned (`fwd-end`), or
its backward beginning (`bwd`: the gradient of its output is complete). These hooks only say that a
moment has come, and which buckets the layer computes with; ZeroDP fires the instructions the
program placed there, in order, and waits for the layer's gathers still in flight (`Moments`).
They decide nothing: a moment the program placed nothing at passes without a collective.

A forward outside the program (an evaluation, the end-of-run text sample) is one too: a hook on
the chunk arms the gathers and releases an F would fire (the compiled plan's `forward_only`) when no
action is under way. Released storage keeps its tensor objects (resized to zero bytes), so the
views autograd saved in forward are valid again after the re-gather.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from pipezero.schedules.layer_plan import Moment, Trigger
from pipezero.schedules.model_shapes import layer_of
from pipezero.zero.buckets import Bucket


class Moments(Protocol):
    """What the hooks tell ZeRO-3 (zero/sharded.py ZeroDP)."""

    def all_buckets(self) -> Iterable[Bucket]: ...
    def moment(self, at: Trigger, uses: list[Bucket], what: str) -> None: ...
    def begin_outside(self, chunk: int) -> None: ...
    def end_outside(self, chunk: int) -> None: ...


def install(zero: Moments, chunks: dict[int, nn.Module]) -> None:
    """Hook every layer of every chunk that computes with a bucket (its own, or another layer's: a
    head tied to the embedding in the same chunk uses the embedding's), and every chunk."""
    buckets = list(zero.all_buckets())
    by_param = {q: b for b in buckets for q in b.params}  # tensors hash by identity
    own = {layer_of(b.names[0]): b for b in buckets}
    for c, chunk in chunks.items():
        for k, module in chunk.layers.items():
            index = int(k)
            mine = [own[index]] if index in own else []
            uses = list(dict.fromkeys(mine + [b for q in module.parameters() if (b := by_param.get(q)) is not None]))
            if uses:
                _hook_layer(zero, module, index, uses)
        chunk.register_forward_pre_hook(lambda _m, _a, c=c: zero.begin_outside(c))
        chunk.register_forward_hook(lambda _m, _a, _o, c=c: zero.end_outside(c))


def _hook_layer(zero: Moments, module: nn.Module, index: int, uses: list[Bucket]) -> None:
    what = f"layer {index}"

    def pre_forward(_m: nn.Module, _args: tuple) -> None:
        zero.moment(Trigger(Moment.FORWARD, index), uses, what)

    def post_forward(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(pre_backward)
        zero.moment(Trigger(Moment.FORWARD_END, index), [], what)

    def pre_backward(grad: torch.Tensor) -> torch.Tensor:
        # the gradient of this layer's output is complete, so the next layer's backward is done
        zero.moment(Trigger(Moment.BACKWARD, index), uses, what)
        return grad

    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)
