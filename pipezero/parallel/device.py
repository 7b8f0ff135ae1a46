"""Where a rank computes, and which torch.distributed backend carries its tensors.

CPU ranks use gloo. CUDA ranks take the GPU named by LOCAL_RANK (torchrun sets it) and join a group
whose backend is "cpu:gloo,cuda:nccl": tensors on the GPU (activations, gradient buckets, parameter
gathers) travel over NCCL, and the few small CPU tensors (per-rank figures, checkpoint bookkeeping)
over gloo, so nothing has to be copied to the GPU just to be counted. The few `torch.cuda` calls
pipezero makes live here, so the rest of the code only passes a `device` around.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pipezero.config import ConfigError, Device


def device_kind(setting: Device) -> str:
    """"cpu" or "cuda" for a --device setting; "auto" takes CUDA when torch sees a GPU."""
    if setting is Device.AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting is Device.CUDA and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no CUDA device (a CPU build of torch, or no GPU "
                          "visible): use --device cpu")
    return setting.value


def rank_device(kind: str) -> torch.device:
    """This process's device; for CUDA the GPU numbered by LOCAL_RANK, made current so NCCL and
    every allocation without an explicit device land on it."""
    if kind == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local >= count:
        raise ConfigError(f"local rank {local} needs GPU {local}, but this machine shows {count}: start at most "
                          f"{count} ranks a machine (--nproc / torchrun --nproc-per-node)")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def synchronizer(device: torch.device) -> Callable[[], None] | None:
    """What waits for the device's queued work (None on CPU, where work is done when it returns)."""
    return torch.cuda.synchronize if device.type == "cuda" else None


def peak_allocated(device: torch.device) -> int | None:
    """Most bytes the caching allocator handed out on the device (None on CPU: see peak RSS)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
