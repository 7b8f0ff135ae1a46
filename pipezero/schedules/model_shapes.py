"""What the plan knows of a model: each chunk's trainable tensors by name and shape, layer by layer.

The compile step (schedules/compile.py) groups these tensors into buckets and lowers the program
over them, so the plan and the run lay out the same buffers: a run reads them from its model built
on the meta device (stage.py `model_shapes`), `simulate`, `plan` and the memory model from the
built-in decoder's shapes (models/presets.py `layer_tensors`), the hang doctor from the facts a
rank's record carries (`to_json`). Plain data: no torch.

A layer may name its parts (`parts`: groups of its sub-modules, in forward order; the built-in
block's attention with its norm, then its MLP with its norm): layer-by-layer ZeRO-3 with
`--zero3-unit sublayer` gathers, releases and reduces each part on its own (`units`).

A tensor two layers of one chunk compute with (the embedding tied to the head when both sit in one
chunk) is listed once, under the first layer, and the other layer `borrows` it by name: layer by
layer, ZeRO-3 gathers the first layer's bucket for the borrower too. Frozen tensors are not listed
(they never enter a bucket), but a layer with nothing trainable of its own that borrows is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any


def layer_of(name: str) -> int:
    """`layers.7.attn.wq.weight` -> 7: parameter names are model-wide (models/chunk.py)."""
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"parameter {name!r} is not named layers.<index>.…: the plan reads the layer from it")
    return int(parts[1])


@dataclass(frozen=True)
class TensorShape:
    name: str  # layers.<index>.<the layer's own name>
    shape: tuple[int, ...]

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def layer(self) -> int:
        return layer_of(self.name)


@dataclass(frozen=True)
class LayerTensors:
    index: int  # model-wide layer index
    tensors: tuple[TensorShape, ...] = ()  # its trainable tensors, in the layer's own order
    borrows: tuple[str, ...] = ()  # trainable tensors listed under an earlier layer of the chunk that it uses
    # its sub-modules (names inside the layer) grouped into parts, forward order; () : one part, the
    # layer. Each group's first module starts the part's forward, its last ends it.
    parts: tuple[tuple[str, ...], ...] = ()

    def part_of(self, name: str) -> int:
        """The part a tensor of this layer (`layers.7.attn.wq.weight`) lies in: 0 for an undivided layer."""
        if not self.parts:
            return 0
        module = name.split(".")[2] if name.count(".") >= 2 else ""
        for j, group in enumerate(self.parts):
            if module in group:
                return j
        raise ValueError(f"{name}: in none of layer {self.index}'s parts {self.parts}")

    def units(self, split: bool) -> list[tuple[int, tuple[TensorShape, ...]]]:
        """(part, its tensors) in forward order: one unit, the whole layer, unless `split` and it has
        parts (a part with nothing trainable left out)."""
        if not (split and self.parts):
            return [(0, self.tensors)]
        out = [(j, tuple(t for t in self.tensors if self.part_of(t.name) == j)) for j in range(len(self.parts))]
        return [(j, ts) for j, ts in out if ts]


@dataclass(frozen=True)
class ChunkShapes:
    layers: tuple[LayerTensors, ...]  # model order; layers with nothing trainable and nothing borrowed left out
    # split backward's W needs no weights here: every weighted module computes its gradient from
    # (input, output gradient) (runtime/weight_grad.py); never the first chunk, whose B computes
    # nothing (it has no input gradient), so its W runs autograd
    splits: bool = True
    stop: int = -1  # one past the chunk's last layer (model-wide); -1: its last listed layer is its last

    @property
    def tensors(self) -> tuple[TensorShape, ...]:
        return tuple(t for layer in self.layers for t in layer.tensors)


@dataclass(frozen=True)
class ModelShapes:
    chunks: tuple[ChunkShapes, ...]  # every stage chunk of the model, in model order
    # (first name, second name) of a weight tied across chunks: each end holds a trainable copy, and
    # the copies' gradients are summed before their buckets are reduced (TIED_SUM); None otherwise
    tied: tuple[str, str] | None = None

    def __hash__(self) -> int:  # hashed once: compiled plans are cached by the shapes they are made of
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    @property
    def tied_numel(self) -> int:
        if self.tied is None:
            return 0
        return next(t.numel for t in self.chunks[0].tensors if t.name == self.tied[0])

    def to_json(self) -> dict[str, Any]:
        def layer(x: LayerTensors) -> list:
            return [x.index, [[t.name, list(t.shape)] for t in x.tensors], list(x.borrows), [list(g) for g in x.parts]]
        return {"tied": list(self.tied) if self.tied else None,
                "chunks": [{"splits": c.splits, "stop": c.stop, "layers": [layer(x) for x in c.layers]}
                           for c in self.chunks]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelShapes:
        def layer(i: int, ts: list, b: list, parts: list | None = None) -> LayerTensors:
            return LayerTensors(i, tuple(TensorShape(n, tuple(s)) for n, s in ts), tuple(b),
                                tuple(tuple(g) for g in parts or ()))
        chunks = tuple(ChunkShapes(tuple(layer(*x) for x in c["layers"]), c["splits"], c["stop"]) for c in d["chunks"])
        return cls(chunks, tuple(d["tied"]) if d.get("tied") else None)

    @classmethod
    def of_counts(cls, chunk_layers: Sequence[Sequence[int]], tied: bool = False) -> ModelShapes:
        """One tensor a layer of `chunk_layers[c][j]` elements (layers numbered in model order across
        chunks; empty layers frozen): for tests and what-ifs that know sizes, not tensors. `tied`:
        the first layer's tensor is tied to the last's, apart in two chunks."""
        chunks, i = [], 0
        for counts in chunk_layers:
            layers = []
            for n in counts:
                if n > 0:
                    layers.append(LayerTensors(i, (TensorShape(f"layers.{i}.weight", (n,)),)))
                i += 1
            chunks.append(ChunkShapes(tuple(layers), splits=len(chunks) > 0, stop=i))
        pair = (f"layers.0.weight", f"layers.{i - 1}.weight") if tied and len(chunks) > 1 else None
        return cls(tuple(chunks), pair)


def cut_shapes(layers: Sequence[LayerTensors], bounds: Sequence[tuple[int, int]], tied: tuple[str, str] | None = None,
        frozen: frozenset[str] = frozenset(), splits: Sequence[bool] | None = None) -> ModelShapes:
    """The whole model's layers (`layers[i]`: layer i, its tied second name still listed) cut into
    chunks [start, stop): a weight tied across two layers of one chunk is listed once and borrowed,
    across chunks each end keeps its copy; `frozen` names leave the plan (a tied pair together)."""
    if tied and frozen & set(tied):
        tied = None
    chunks = []
    for c, (a, b) in enumerate(bounds):
        out = []
        for layer in layers[a:b]:
            own = tuple(t for t in layer.tensors if t.name not in frozen)
            borrows, parts = layer.borrows, layer.parts
            if tied and tied[1] in {t.name for t in own} and a <= layer_of(tied[0]) < b:
                own = tuple(t for t in own if t.name != tied[1])  # one tensor here: listed under the first name
                borrows += (tied[0],)
            if own or borrows:
                out.append(LayerTensors(layer.index, own, borrows, () if borrows else parts))
        chunks.append(ChunkShapes(tuple(out), c > 0 if splits is None else splits[c], b))
    apart = tied is not None and len(bounds) > 1
    return ModelShapes(tuple(chunks), tied if apart else None)
