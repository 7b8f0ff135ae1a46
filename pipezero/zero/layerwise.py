"""ZeRO-3 one layer at a time: module hooks that report the moments of an action to the program.

Layer by layer, the program places every gather and release of a unit's bucket (a layer's, or with
`--zero3-unit sublayer` a part's: a block's attention, its MLP) at a moment inside an action
(schedules/layer_plan.py): a unit's forward about to run (`fwd`), returned (`fwd-end`), or its
backward beginning (`bwd`: the gradient of its output is complete). These hooks only say that a
moment has come, and which buckets the unit computes with; ZeroDP fires the instructions the
program placed there, in order, and waits for the gathers still in flight (`Moments`). They decide
nothing: a moment the program placed nothing at passes without a collective. A whole layer's
moments are its module's; a part's are its first sub-module's forward and its last one's output
(the parts of a block run one after another, joined by residual sums that hold no weight).

The held-out evaluation's and the text sample's forwards are compute instructions of programs of
their own (schedules/forward_only.py), armed like a step's; a forward outside any program finds its
first layer ungathered, an error. Released storage keeps its tensor objects (resized to zero
bytes), so the views autograd saved in forward are valid again after the re-gather.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from pipezero.schedules.bucket_plan import LayerUse
from pipezero.schedules.layer_plan import Moment, Trigger
from pipezero.zero.buckets import Bucket

Units = Sequence[tuple[LayerUse, tuple[str, ...]]]  # a chunk's units, each with its part's sub-modules


class Moments(Protocol):
    """What the hooks tell ZeRO-3 (zero/sharded.py ZeroDP)."""

    buckets: dict[int, list[Bucket]]

    def moment(self, at: Trigger, uses: list[Bucket], what: str) -> None: ...


def install(zero: Moments, chunks: dict[int, nn.Module], units: dict[int, Units]) -> None:
    """Hook every unit of every chunk as the plan lists it (compiled plan `units`: its own bucket
    and those it borrows, a head tied to the embedding in the same chunk)."""
    for c, chunk in chunks.items():
        for u, modules in units[c]:
            layer = chunk.layers[str(u.index)]
            uses = [zero.buckets[c][k] for k in ((u.bucket,) if u.bucket is not None else ()) + u.borrows]
            first, last = (layer.get_submodule(modules[0]), layer.get_submodule(modules[-1])) if modules \
                else (layer, layer)
            _hook_unit(zero, first, last, u, uses)


def _hook_unit(zero: Moments, first: nn.Module, last: nn.Module, u: LayerUse, uses: list[Bucket]) -> None:
    what = f"layer {u.index}" + (f" part {u.part}" if first is not last else "")

    def pre_forward(_m: nn.Module, _args: tuple) -> None:
        zero.moment(Trigger(Moment.FORWARD, u.index, u.part), uses, what)

    def post_forward(_m: nn.Module, _args: tuple, out: torch.Tensor) -> None:
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(pre_backward)
        zero.moment(Trigger(Moment.FORWARD_END, u.index, u.part), [], what)

    def pre_backward(grad: torch.Tensor) -> torch.Tensor:
        # the gradient of this unit's output is complete, so the next unit's backward is done
        zero.moment(Trigger(Moment.BACKWARD, u.index, u.part), uses, what)
        return grad

    first.register_forward_pre_hook(pre_forward)
    last.register_forward_hook(post_forward)
