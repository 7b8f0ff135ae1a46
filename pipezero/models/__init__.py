"""Decoder-only models built as an ordered list of layers, so a pipeline stage is a slice of it."""

from pipezero.models.llama import Block, Embedding, Head, StageChunk, build_chunk, compile_blocks, lm_loss
from pipezero.models.presets import PRESETS, apply_preset, flops_per_token, layer_param_counts, param_count

__all__ = [
    "Block", "Embedding", "Head", "StageChunk", "build_chunk", "compile_blocks", "lm_loss",
    "PRESETS", "apply_preset", "flops_per_token", "layer_param_counts", "param_count",
]
