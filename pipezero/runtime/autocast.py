"""Mixed precision as a context: bf16 autocast for matmuls, fp32 parameters, gradients and loss."""

from __future__ import annotations

import contextlib

import torch

from pipezero.config import DType


def autocast(dtype: DType, device_type: str = "cpu") -> contextlib.AbstractContextManager:
    if dtype is DType.BF16:
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
