"""A Llama-style decoder as a flat list of layers: [Embedding, Block x n_layers, Head].

Each layer maps one tensor to one tensor, so any contiguous slice of the list is a pipeline stage
chunk (models/chunk.py) and the activations between chunks are a single (B, T, dim) tensor. Packed
documents add per-token document ids (B, T), which every rank holds with its micro-batch: each
chunk turns them into a `DocMask` once and its blocks attend within documents only. Each layer is
initialised from its own seeded generator so a layer's initial weights do not depend on which rank
builds it. models/llama_spec.py presents all this to the engine as a ModelSpec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipezero.config import ModelConfig
from pipezero.models.presets import ffn_dim
from pipezero.models.rotary import apply_rotary, inverse_frequencies, rotary_tables


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm, its fp32 weight rounded to the input's dtype as autocast rounds every other
    weight. Being an `nn.RMSNorm`, split backward's W knows its weight gradient (runtime/weight_grad.py)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim), in x's dtype
        # One fused kernel where torch has one; it accumulates the mean of squares in fp32 whatever
        # x's dtype, so a bf16 residual stream loses nothing there.
        return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)


@dataclass(frozen=True)
class DocMask:
    """Block-diagonal causal attention for packed documents, from per-token document ids."""

    allowed: torch.Tensor  # (B, 1, T, T) bool: query t may see key u (same document, u <= t)
    positions: torch.Tensor  # (B, T) int64: position inside its document, for rotary angles

    @classmethod
    def of(cls, docs: torch.Tensor) -> "DocMask":  # docs: (B, T) int64, non-decreasing along T
        t = docs.shape[1]
        idx = torch.arange(t, device=docs.device).expand_as(docs)
        starts = torch.ones_like(docs, dtype=torch.bool)
        starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
        first = torch.cummax(torch.where(starts, idx, 0), dim=1).values  # each token's document start
        causal = torch.ones(t, t, dtype=torch.bool, device=docs.device).tril()
        return cls(((docs[:, :, None] == docs[:, None, :]) & causal)[:, None], idx - first)


def window_of(cfg: ModelConfig, block: int) -> int | None:
    """The sliding window of block `block` (0-based): Mistral's on every block, Qwen2's on the
    blocks its layer_types name (`window_layers`); None: the block attends to every earlier key."""
    if cfg.window_layers is not None and block not in cfg.window_layers:
        return None
    return cfg.sliding_window


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, block: int = 0) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        self.window = window_of(cfg, block)
        qkv, hd = cfg.qkv_bias, self.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=qkv)
        self.wk = nn.Linear(cfg.dim, self.n_kv * hd, bias=qkv)
        self.wv = nn.Linear(cfg.dim, self.n_kv * hd, bias=qkv)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=cfg.out_bias)
        # Derived from the shape, so not parameters or buffers: checkpoints hold weights only, and a
        # chunk built on the meta device (hf_weights) needs nothing recomputed. The cos/sin tables
        # grow to the longest sequence seen rather than max_seq_len (131072 for some checkpoints:
        # 64 MB a layer).
        hf = cfg.pretrained is not None  # transformers' rounding for its models (inverse_frequencies)
        self.rope = (hd, cfg.rope_theta, cfg.rope_llama3, torch.float32 if hf else torch.float64)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def rotary(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [0, length): (length, hd/2) each."""
        if self._tables is None or self._tables[0].shape[0] < length or self._tables[0].device != device:
            self._tables = rotary_tables(inverse_frequencies(*self.rope).to(device), length)
        cos, sin = self._tables
        return cos[:length], sin[:length]

    def band(self, t: int, device: torch.device) -> torch.Tensor | None:
        """The sliding window as a (T, T) bool mask (query t sees keys t-W+1..t), or None when
        every key of a T-token sequence is inside the window anyway."""
        if self.window is None or t <= self.window:
            return None
        idx = torch.arange(t, device=device)
        gap = idx[:, None] - idx[None, :]
        return (gap >= 0) & (gap < self.window)

    def forward(self, x: torch.Tensor, mask: DocMask | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.wv(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        gqa = self.n_kv != self.n_heads
        band = self.band(t, x.device)
        if mask is None:  # one causal sequence a row
            cos, sin = self.rotary(t, x.device)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if band is None:  # the fast path
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=gqa)
            return self.wo(y.transpose(1, 2).reshape(b, t, -1))
        cos, sin = self.rotary(t, x.device)
        cos, sin = cos[mask.positions][:, None], sin[mask.positions][:, None]  # (B, 1, T, hd/2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        allowed = mask.allowed if band is None else mask.allowed & band
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = ffn_dim(cfg)
        bias = cfg.mlp_bias
        self.w1 = nn.Linear(cfg.dim, hidden, bias=bias)  # gate
        self.w3 = nn.Linear(cfg.dim, hidden, bias=bias)  # up
        self.w2 = nn.Linear(hidden, cfg.dim, bias=bias)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, block: int = 0) -> None:  # block: 0-based, for a per-block window
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, block)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, mask: DocMask | None = None) -> torch.Tensor:  # (B, T, dim) -> (B, T, dim)
        x = x + self.attn(self.attn_norm(x), mask)
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, dim)
        x = F.embedding(tokens, self.weight)
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            # Under bf16 autocast the residual stream itself is bf16 (autocast leaves embeddings and
            # additions alone, so it would stay fp32): half the activation memory and traffic, the
            # elementwise work at half the bytes. Weights, gradients and AdamW stay fp32.
            x = x.to(torch.get_autocast_dtype(kind))
        return x


class Head(nn.Module):
    """Final RMSNorm and the LM projection to vocabulary logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, dim) -> (B, T, vocab)
        return self.proj(self.norm(x))


def build_layer(cfg: ModelConfig, index: int) -> nn.Module:
    if index == 0:
        return Embedding(cfg)
    if index == cfg.n_layers + 1:
        return Head(cfg)
    return Block(cfg, index - 1)


def init_layer(layer: nn.Module, index: int, cfg: ModelConfig, seed: int) -> None:
    """Initialise from a generator seeded by (seed, layer index): independent of the layout.

    A tied head draws from the embedding's generator so both copies start equal when they live
    on different pipeline ranks.
    """
    tied_head = isinstance(layer, Head) and cfg.tie_embeddings
    gen = torch.Generator().manual_seed(seed * 1_000_003 + (0 if tied_head else index))
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2: scale projections into the residual
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name.endswith(".bias"):
                p.zero_()
                continue
            std = residual_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
            p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))
