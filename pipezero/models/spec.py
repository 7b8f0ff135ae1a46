"""The model protocol: what the engine, partitioner, ZeRO, freezing and checkpoints may know of a model.

A model is an ordered list of `n_layers + 2` layers: [embedding, block x n_layers, head]. The
engine never looks inside a layer; it asks the spec for

- `build_layer(index)` and `init_layer(layer, index, seed)`: one layer, on the current device
  (the engine builds on the meta device where it needs only names or shapes). Initialise from a
  generator seeded by (seed, index) so a layer starts the same whichever rank builds it;
- `layer_param_counts()` and `layer_costs(seq_len)`: per-layer sizes for the `params` and `cost`
  partition policies (no tensors: the planner reasons about shapes it cannot allocate);
- `flops_per_token(seq_len)`: for the run's opening line and throughput figures;
- `loss(logits, targets, denom)`: the last layer's output against targets (-100 = not counted),
  summed and divided by `denom`, so micro-batch losses add up to the global batch's mean;
- `tied_names()`: the two parameter names of one shared tensor (a tied embedding), or None.

The contract between layers: the first takes tokens (B, T) int64 and every layer returns one tensor;
between pipeline chunks that tensor is (B, T, dim) in the activation dtype. Parameters are named
`layers.{index}.<the layer's own name>` by `StageChunk`, whatever the layout, so ZeRO-3's layer
buckets, checkpoints, `--freeze` patterns and tied weights work without knowing the model.

A spec reaches the engine through Python, `pipezero.engine.train(cfg, spec=MySpec(...))` (the
TrainConfig still gives layout, optimizer, data and run), or through the settings,
`pipezero train --model-spec my_mod:MySpec` (`[model] spec`; models/user_spec.py); any other
ModelConfig means the built-in decoder (`LlamaSpec`, models/llama_spec.py). examples/own_model.py
is a complete example.

Split backward (zero-bubble schedules' B and W) needs every weighted module of a non-first chunk to
be one W can compute from (input, output gradient) alone: nn.Linear, nn.Embedding, nn.LayerNorm,
nn.RMSNorm, or a module with a `weight_grad(x, dy)` method (runtime/weight_grad.py). A chunk with
any other weighted module keeps autograd for W, and the executor warns once naming the module type.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, denom: float) -> torch.Tensor:
    """Sum of token cross-entropies divided by `denom` (all counted targets of the global batch), so
    the per-micro-batch losses add up to the global mean whatever the layout. Targets of -100 (a
    document's last token under packing, padding) are not counted."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / denom


class ModelSpec:
    """Base class of a model family: subclass it and fill in the four abstract methods; the rest
    have defaults. `n_layers` counts blocks; `dim` is the width of activations between chunks;
    `vocab_size` the embedding's rows (the tokenizer must fit in them)."""

    n_layers: int
    dim: int
    vocab_size: int
    max_seq_len: int | None = None  # the longest sequence the model takes (learned positions); None: any
    # True when layers are allocated uninitialised (meta device, then empty) for a loader to fill
    # (a pretrained checkpoint), instead of calling init_layer.
    deferred_init: bool = False

    def build_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def init_layer(self, layer: nn.Module, index: int, seed: int) -> None:
        raise NotImplementedError

    def layer_param_counts(self) -> list[int]:
        raise NotImplementedError

    def flops_per_token(self, seq_len: int) -> float:
        raise NotImplementedError

    def layer_costs(self, seq_len: int) -> list[float]:
        """Relative training time per layer, for the `cost` partition policy: by default 6 FLOPs
        a parameter a token (forward 2, backward 4), which ignores attention and the embedding's
        lookup being cheaper than a matmul."""
        return [6.0 * n for n in self.layer_param_counts()]

    def layer_parts(self, index: int) -> tuple[tuple[str, ...], ...]:
        """Layer `index`'s sub-modules (attribute names) grouped into parts that layer-by-layer
        ZeRO-3 may gather and reduce apart (`--zero3-unit sublayer`), in forward order: each part's
        modules run one after another, its first starts it and its last's output ends it (what
        comes between parts, a residual sum, holds no weight). By default () : the layer is one."""
        return ()

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, denom: float) -> torch.Tensor:
        return lm_loss(logits, targets, denom)

    def tied_names(self) -> tuple[str, str] | None:
        """(a parameter of layer 0, one of layer n_layers + 1) that are one tensor, or None. Apart
        on two pipeline ranks, the engine sums the copies' gradients between the first and last."""
        return None

    def doc_mask(self, docs: torch.Tensor) -> Any:
        """What blocks take as their second argument when documents are packed with masks (from
        per-token document ids (B, T)). A model without document masking refuses them."""
        raise NotImplementedError(f"{type(self).__name__} does not support packed document masks; "
                                  f"use --packing concat or none")

    def param_names(self) -> list[str]:
        """Every parameter name of the whole model in model order, both names of a tied weight
        included; built on the meta device, so it allocates nothing."""
        from pipezero.models.meta import shapes_only

        names = []
        with shapes_only():
            for i in range(self.n_layers + 2):
                names += [f"layers.{i}.{n}" for n, _ in self.build_layer(i).named_parameters(remove_duplicate=False)]
        return names
