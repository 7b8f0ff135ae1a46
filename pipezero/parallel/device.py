"""Where a rank computes, and which torch.distributed backend carries its tensors.

CPU ranks use gloo. CUDA ranks take the GPU named by LOCAL_RANK (torchrun sets it) and join a group
whose backend is "cpu:gloo,cuda:nccl": tensors on the GPU (activations, gradient buckets, parameter
gathers) travel over NCCL, and the few small CPU tensors (per-rank figures, checkpoint bookkeeping)
over gloo, so nothing has to be copied to the GPU just to be counted.
"""

from __future__ import annotations

import os

import torch

from pipezero.config import ConfigError

DEVICES = ("auto", "cpu", "cuda")


def device_kind(setting: str) -> str:
    """"cpu" or "cuda" for a --device setting; "auto" takes CUDA when torch sees a GPU."""
    if setting not in DEVICES:
        raise ConfigError(f"--device {setting!r}: choose one of {', '.join(DEVICES)}")
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no CUDA device (a CPU build of torch, or no GPU "
                          "visible): use --device cpu")
    return setting


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
