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

from pipezero.config import Device
from pipezero.errors import ConfigError
from pipezero.slurm import ranks_per_node_advice


def device_kind(setting: Device) -> str:
    """"cpu" or "cuda" for a --device setting; "auto" takes CUDA when torch sees a GPU."""
    if setting is Device.AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting is Device.CUDA and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no CUDA device (a CPU build of torch, or no GPU "
                          "visible): use --device cpu")
    return setting.value


def local_device(setting: Device, local_ranks: int, gpus: int) -> tuple[Device, str | None]:
    """The device `--nproc local_ranks` ranks on one machine with `gpus` visible GPUs will use, decided
    in the launcher before any rank starts, and a warning to print, if any. `auto` falls back to CPU
    ranks when there are fewer GPUs than ranks (the quickstart's --nproc 4 then runs on a one-GPU
    laptop too, on gloo, and says so); an explicit `cuda` is refused instead."""
    if setting is Device.CPU:
        return Device.CPU, None
    if gpus >= local_ranks:
        return Device.CUDA, None
    if setting is Device.CUDA:
        raise ConfigError(f"--device cuda with {local_ranks} local ranks needs {local_ranks} GPUs, but torch sees "
                          f"{gpus}: lower --nproc to {gpus} (--pp x --dp) or use --device cpu")
    if gpus == 0:
        return Device.CPU, None  # what auto means without a GPU
    return Device.CPU, (f"{local_ranks} local ranks but {gpus} GPU{'s' * (gpus != 1)}: running on CPU (gloo); "
                        f"use --nproc {gpus} (--pp x --dp) to train on the GPUs")


def rank_device(kind: str) -> torch.device:
    """This process's device; for CUDA the GPU numbered by LOCAL_RANK, made current so NCCL and
    every allocation without an explicit device land on it."""
    if kind == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local >= count:
        raise ConfigError(f"local rank {local} needs GPU {local}, but this machine shows {count}: "
                          f"{ranks_per_node_advice(os.environ, count)}")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def backend(device: torch.device) -> str:
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def synchronizer(device: torch.device) -> Callable[[], None] | None:
    """What waits for the device's queued work (None on CPU, where work is done when it returns)."""
    return torch.cuda.synchronize if device.type == "cuda" else None


class PeakMemory:
    """Peak device memory by phase of the run (training steps, evaluation), allocated (tensors) and
    reserved (the allocator's cache: what the card lost). Each `mark` folds the peak since the last
    mark into a phase and starts afresh, so evaluation's allocations do not hide in the training
    figure and the first step's one-off ones can be dropped. Nothing on CPU (see peak RSS)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, dict[str, int]] = {}

    def mark(self, phase: str | None) -> None:
        if self.device.type != "cuda":
            return
        if phase is not None:
            now = {"allocated": torch.cuda.max_memory_allocated(self.device),
                   "reserved": torch.cuda.max_memory_reserved(self.device)}
            old = self.phases.get(phase, {})
            self.phases[phase] = {k: max(v, old.get(k, 0)) for k, v in now.items()}
        torch.cuda.reset_peak_memory_stats(self.device)


def use_tf32(device: torch.device) -> None:
    """fp32 matmuls on tensor cores (TF32: 10-bit mantissa products, fp32 accumulation), as
    cuDNN's convolutions already do by default; without it fp32 runs use a fraction of the card."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


class ComputeClock:
    """The device's busy time over a step: CUDA events around every compute action, read after the
    step's final synchronisation. With stream-ordered waits the CPU never blocks on a peer, so the
    GPU's idle time between actions is the bubble. On CPU it records nothing (the CPU-side wait
    time measures the bubble there)."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._open: torch.cuda.Event | None = None

    def start(self) -> None:
        if self.enabled:
            self._open = torch.cuda.Event(enable_timing=True)
            self._open.record()

    def stop(self) -> None:
        if self.enabled and self._open is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._open, end))
            self._open = None

    def busy_share(self) -> float | None:
        """Share of the time from the first action's start to the last one's end that the device
        spent in actions; None when nothing was timed. Synchronises on the last event."""
        if not self._spans:
            return None
        spans, self._spans = self._spans, []
        spans[-1][1].synchronize()
        busy = sum(a.elapsed_time(b) for a, b in spans)
        whole = spans[0][0].elapsed_time(spans[-1][1])
        return min(1.0, busy / whole) if whole > 0 else 1.0
