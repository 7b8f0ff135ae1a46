"""Rotary position embeddings in the rotate-half layout: a head's halves (x[..., :hd/2],
x[..., hd/2:]) are rotated as pairs, which is also how transformers lays out Llama, Mistral and
Qwen2, so their q and k projections load without any permutation."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, llama3: list[float] | None = None,
                        dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rotary frequencies (head_dim // 2,). The built-in models compute them and their angles in
    fp64; a Hugging Face model in fp32, rounded as transformers rounds them, which is what lets its
    logits match transformers' to 1e-5 (fp64 angles differ from fp32 ones by ~1e-7 x position).
    With `llama3` (factor, low_freq_factor, high_freq_factor, original context), long wavelengths
    are slowed by `factor` and the band between the two cut-offs is blended, as Llama 3.1 was trained."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype) / head_dim)
    if llama3 is None:
        return inv
    factor, low, high, context = llama3
    wavelen = 2 * math.pi / inv
    slowed = torch.where(wavelen > context / low, inv / factor, inv)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    middle = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(middle, blended, slowed)


def rotary_tables(inv_freq: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position x frequency, each (length, head_dim // 2), computed in inv_freq's
    dtype and returned in fp32."""
    angles = torch.outer(torch.arange(length, dtype=inv_freq.dtype, device=inv_freq.device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) of x: (B, H, T, hd) by position angles (T, hd/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)
