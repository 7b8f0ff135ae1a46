"""Decoder-only models built as an ordered list of layers, so a pipeline stage is a slice of it.

`ModelSpec` (spec.py) is the protocol the engine sees; `LlamaSpec` the built-in family."""

from pipezero.models.chunk import StageChunk, build_chunk, compile_blocks
from pipezero.models.llama import Block, Embedding, Head
from pipezero.models.llama_spec import LlamaSpec, spec_of
from pipezero.models.presets import PRESETS, apply_preset, flops_per_token, layer_param_counts, param_count
from pipezero.models.spec import ModelSpec, lm_loss

__all__ = [
    "Block", "Embedding", "Head", "StageChunk", "build_chunk", "compile_blocks", "lm_loss",
    "LlamaSpec", "ModelSpec", "spec_of",
    "PRESETS", "apply_preset", "flops_per_token", "layer_param_counts", "param_count",
]
