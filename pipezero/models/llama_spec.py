"""The built-in Llama decoder (and the Hugging Face families, which build the same layers from a
ModelConfig) as a ModelSpec: the one place the engine's model-agnostic code meets models/llama.py."""

from __future__ import annotations

import torch
from torch import nn

from pipezero.config import ModelConfig
from pipezero.models.presets import BLOCK_PARTS, flops_per_token, layer_costs, layer_param_counts
from pipezero.models.llama import DocMask
from pipezero.models.llama import build_layer as llama_layer
from pipezero.models.llama import init_layer as llama_init
from pipezero.models.meta import shapes_only
from pipezero.models.spec import ModelSpec


class LlamaSpec(ModelSpec):
    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.n_layers, self.dim, self.vocab_size = cfg.n_layers, cfg.dim, cfg.vocab_size
        self.max_seq_len = cfg.max_seq_len
        self.deferred_init = cfg.pretrained is not None  # models/hf_weights.py fills the layers

    def build_layer(self, index: int) -> nn.Module:
        return llama_layer(self.cfg, index)

    def init_layer(self, layer: nn.Module, index: int, seed: int) -> None:
        llama_init(layer, index, self.cfg, seed)

    def layer_param_counts(self) -> list[int]:
        return layer_param_counts(self.cfg)

    def layer_costs(self, seq_len: int) -> list[float]:
        return layer_costs(self.cfg, seq_len)

    def flops_per_token(self, seq_len: int) -> float:
        return flops_per_token(self.cfg, seq_len)

    def layer_parts(self, index: int) -> tuple[tuple[str, ...], ...]:
        return BLOCK_PARTS if 0 < index <= self.n_layers else ()

    def tied_names(self) -> tuple[str, str] | None:
        return ("layers.0.weight", f"layers.{self.n_layers + 1}.proj.weight") if self.cfg.tie_embeddings else None

    def doc_mask(self, docs: torch.Tensor) -> DocMask:
        return DocMask.of(docs)

    def param_names(self) -> list[str]:
        """One block built for all (blocks share their names but the index), so a 70B shape costs
        nothing."""
        with shapes_only():
            emb, block, head = self.build_layer(0), self.build_layer(1), self.build_layer(self.n_layers + 1)
        names = [f"layers.0.{n}" for n, _ in emb.named_parameters()]
        for i in range(1, self.n_layers + 1):
            names += [f"layers.{i}.{n}" for n, _ in block.named_parameters()]
        return names + [f"layers.{self.n_layers + 1}.{n}" for n, _ in head.named_parameters()]


def spec_of(model: ModelConfig | ModelSpec) -> ModelSpec:
    """A user's spec as it is; a ModelConfig naming one (`spec`, from --model-spec) as that spec,
    imported (models/user_spec.py); any other ModelConfig as the built-in Llama (HF families
    included). Every reader of a run's model goes through here, so a spec named in the settings
    reaches the engine, partition, freezing, checkpoints, export and verify alike."""
    if isinstance(model, ModelSpec):
        return model
    if model.spec is not None:
        from pipezero.models.user_spec import load_spec

        return load_spec(model.spec)
    return LlamaSpec(model)
