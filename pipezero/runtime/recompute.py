"""--recompute: activation checkpointing one transformer block at a time (torchtitan's "full" mode).

Each block's forward runs under torch's non-reentrant checkpoint: in forward a block keeps only its
input (the one tensor the checkpoint saves), and its backward runs that block's forward again just
before differentiating it. So a micro-batch in flight holds one residual-stream tensor a block, and
a backward holds one block's activations at a time, never the chunk's (which checkpointing the
whole chunk would rerun and hold at once). The embedding and the head are not checkpointed: the
embedding saves only token ids, and the head's log-softmax is the loss's, needed anyway.

The checkpoint replaces the block's `forward`, inside the module's call: the block's own hooks
(layer-by-layer ZeRO-3's moments, zero/layerwise.py) fire once in forward and once in backward and
never in the rerun, whose weights are those the block's backward gathered (a block's parts, hooked
on its sub-modules, do fire in the rerun: schedules/layer_plan.py places their moments).

Under bf16 autocast a block's forward casts its weights as it uses them (runtime/autocast.py keeps
autocast's cache off, which would hold every block's bf16 copy until the chunk's forward returns,
where the checkpoint keeps none of them); its rerun casts them again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from pipezero.models import StageChunk


def checkpoint_blocks(chunk: StageChunk) -> None:
    """Make every block of `chunk` a checkpointed one, in place (names and parameters unchanged)."""
    for index, layer in chunk.layer_modules():
        if chunk.is_block(index):
            # the block by a weak reference: a closure holding it (its bound forward) from its own
            # attribute would be a reference cycle, keeping the chunk's weights until the garbage
            # collector runs; a compiled forward (models/chunk.compile_blocks) is the block's own
            layer.forward = _checkpointed(weakref.ref(layer), layer.__dict__.get("forward"))


def _checkpointed(block: weakref.ref, own: Callable[..., torch.Tensor] | None) -> Callable[..., torch.Tensor]:
    def forward(*args: torch.Tensor | None) -> torch.Tensor:
        layer = block()
        assert layer is not None, "a checkpointed block's forward outlived its block"
        return own(*args) if own is not None else type(layer).forward(layer, *args)

    def run(*args: torch.Tensor | None) -> torch.Tensor:
        if not torch.is_grad_enabled():  # an evaluation or the sample: nothing is saved anyway
            return forward(*args)
        return checkpoint(forward, *args, use_reentrant=False)

    return run
