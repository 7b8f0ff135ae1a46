"""A pipeline stage chunk: a contiguous slice of any ModelSpec's layer list, named model-wide.

Parameters are named `layers.{global_index}.…` whatever the slice, so state dicts and checkpoints
are keyed the same way for every layout, and ZeRO-3, `--freeze` and tied weights need no model
knowledge. Each layer is initialised by the spec from its own seeded generator, so a layer's
initial weights do not depend on which rank builds it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pipezero.config import ModelConfig
from pipezero.models.llama_spec import spec_of
from pipezero.models.meta import shapes_only
from pipezero.models.spec import ModelSpec


class StageChunk(nn.Module):
    """A contiguous slice [start, stop) of the layer list; the whole model is the slice [0, L+2)."""

    def __init__(self, model: ModelConfig | ModelSpec, start: int, stop: int, seed: int, init: bool = True) -> None:
        super().__init__()
        spec = spec_of(model)
        total = spec.n_layers + 2
        if not 0 <= start <= stop <= total:
            raise ValueError(f"layer slice [{start}, {stop}) outside 0..{total}")
        self.spec = spec
        self.start, self.stop = start, stop
        self.is_first = start == 0
        self.is_last = stop == total
        self.layers = nn.ModuleDict()
        for i in range(start, stop):
            layer = spec.build_layer(i)
            if init:
                spec.init_layer(layer, i, seed)
            self.layers[str(i)] = layer
        self.tie()

    def tie(self) -> None:
        """Both names of a tied weight in this chunk: one Parameter serves both (across ranks the
        engine sums the two copies' gradients instead)."""
        names = self.spec.tied_names()
        if names is None or not all(self.start <= int(n.split(".")[1]) < self.stop for n in names):
            return
        shared = self.get_parameter(names[0])
        owner, attr = names[1].rsplit(".", 1)
        setattr(self.get_submodule(owner), attr, shared)

    def is_block(self, index: int) -> bool:
        return 0 < index <= self.spec.n_layers

    def forward(self, x: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        """x: tokens (B, T) on the first chunk, else activations (B, T, dim); docs: the tokens'
        document ids (B, T) when documents are packed with masks (blocks get the spec's mask of
        them as a second argument), else None."""
        mask = self.spec.doc_mask(docs) if docs is not None else None
        for key, layer in self.layers.items():
            x = layer(x, mask) if mask is not None and self.is_block(int(key)) else layer(x)
        return x

    def layer_modules(self) -> Iterable[tuple[int, nn.Module]]:
        return ((int(k), m) for k, m in self.layers.items())


def compile_blocks(chunk: StageChunk) -> None:
    """torch.compile every block's forward in place: the fused kernels (norms, rotary, SwiGLU) are
    where eager mode loses time on a GPU. The module's own call and hooks stay eager, so ZeRO-3's
    per-layer gather and release hooks run around the compiled code; names and parameters are
    unchanged, so checkpoints do not see it."""
    for index, layer in chunk.layer_modules():
        if chunk.is_block(index):
            layer.forward = torch.compile(layer.forward)


def build_chunk(model: ModelConfig | ModelSpec, start: int, stop: int, seed: int,
                device: torch.device | str = "cpu") -> StageChunk:
    """Layers [start, stop), seeded; a deferred-init spec's (a pretrained model) are allocated
    uninitialised (on the meta device first: even nn.Linear's own init of 0.5B numbers costs
    seconds), for a loader (models/hf_weights.py) to fill."""
    spec = spec_of(model)
    if not spec.deferred_init:
        return StageChunk(spec, start, stop, seed).to(device)
    with shapes_only():
        chunk = StageChunk(spec, start, stop, seed, init=False)
    chunk = chunk.to_empty(device=device)
    chunk.tie()  # to_empty gives the two ends of a tied embedding a tensor each
    return chunk


def place_hollow(chunk: StageChunk, device: torch.device | str) -> None:
    """Move a chunk built on the meta device to `device` holding only what ZeRO-3 will not: frozen
    parameters are allocated (for the loader), trainable ones keep their shape at zero bytes until
    ZeRO-3 makes them views of its buckets, whose shards it reads itself (zero/buckets.py). A
    tensor is allocated untouched and released at once: no resident memory, never the chunk."""
    placed: dict[nn.Parameter, nn.Parameter] = {}  # tensors hash by identity: a tied weight, once
    for module in chunk.modules():
        for key, p in list(module.named_parameters(recurse=False)):
            if p not in placed:
                q = torch.empty(p.shape, dtype=p.dtype, device=device)
                if p.requires_grad:
                    q.untyped_storage().resize_(0)
                placed[p] = nn.Parameter(q, requires_grad=p.requires_grad)
            setattr(module, key, placed[p])
