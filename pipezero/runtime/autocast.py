"""Mixed precision as a context: bf16 autocast for matmuls, fp32 parameters, gradients and loss.

Autocast's cast cache is off. It keeps each fp32 weight's bf16 copy from its first use to the end
of the autocast region, which saves a cast only where one forward uses a weight twice (none of
pipezero's do), and costs where nothing else keeps the copies: an evaluation's forward (no
autograd) and a --recompute block's (the checkpoint saves nothing) would hold the whole chunk's
bf16 weights until the chunk returns (12.6 GiB for 7b at P = 1). A training forward without
recompute keeps the same copies either way: autograd saves them for the backward.
"""

from __future__ import annotations

import contextlib

import torch

from pipezero.config import DType


def autocast(dtype: DType, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    if dtype is DType.BF16:
        return torch.autocast(device_type, dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()
