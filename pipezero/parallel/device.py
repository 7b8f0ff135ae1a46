"""Where a rank computes, and which torch.distributed backend carries its tensors.

CPU ranks use gloo. CUDA ranks take the GPU named by LOCAL_RANK (torchrun sets it) and join a group
whose backend is "cpu:gloo,cuda:nccl": tensors on the GPU (activations, gradient buckets, parameter
gathers) travel over NCCL, and the few small CPU tensors (per-rank figures, checkpoint bookkeeping)
over gloo, so nothing has to be copied to the GPU just to be counted. The few `torch.cuda` calls
pipezero makes live here, so the rest of the code only passes a `device` around.

Ranks may share a GPU (`--share-device`): NCCL refuses two ranks on one GPU, so such ranks join a
gloo group and every tensor they exchange is staged through host memory (parallel/staging.py); each
is capped to its share of the GPU's memory, so four ranks on one 80 GB GPU are, for memory, a node of
four 20 GB GPUs. What that measures is memory and the CUDA code paths, never multi-GPU throughput.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pipezero.config import Device, ShareDevice
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


def local_device(setting: Device, local_ranks: int, gpus: int,
                 share: ShareDevice = ShareDevice.AUTO) -> tuple[Device, str | None]:
    """The device `--nproc local_ranks` ranks on one machine with `gpus` visible GPUs will use, decided
    in the launcher before any rank starts, and a warning to print, if any. With fewer GPUs than
    ranks they share the GPUs (`--share-device auto`, the default, or on); with `--share-device off`
    `auto` falls back to CPU ranks (gloo, said once) and an explicit `cuda` is refused."""
    if setting is Device.CPU:
        return Device.CPU, None
    if gpus >= local_ranks or (gpus > 0 and share is not ShareDevice.OFF):
        return Device.CUDA, None
    if setting is Device.CUDA:
        raise ConfigError(f"--device cuda with {local_ranks} local ranks needs {local_ranks} GPUs, but torch sees "
                          f"{gpus}: lower --nproc to {gpus} (--pp x --dp), let them share with --share-device auto, "
                          f"or use --device cpu")
    if gpus == 0:
        return Device.CPU, None  # what auto means without a GPU
    return Device.CPU, (f"{local_ranks} local ranks but {gpus} GPU{'s' * (gpus != 1)} and --share-device off: running "
                        f"on CPU (gloo); use --nproc {gpus} (--pp x --dp) to train on the GPUs")


def local_world(env: dict[str, str] | None = None) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE (else WORLD_SIZE, else one)."""
    env = os.environ if env is None else env  # type: ignore[assignment]
    return int(env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE") or 1)


def shares_device(share: ShareDevice, kind: str, local_ranks: int, gpus: int) -> bool:
    """Whether this rank's tensors travel through the host (parallel/staging.py): always with
    `on` (on CPU ranks too: the staging path's test), with `auto` where the node's CUDA ranks
    outnumber its GPUs."""
    if share is ShareDevice.ON:
        return True
    return share is ShareDevice.AUTO and kind == "cuda" and local_ranks > gpus


def gpu_of(local: int, local_ranks: int, gpus: int) -> tuple[int, int]:
    """(GPU, ranks on that GPU) of local rank `local` when `local_ranks` share `gpus` GPUs: in
    contiguous blocks (ranks 0-1 on GPU 0, 2-3 on GPU 1 for 4 on 2), so pipeline neighbours share."""
    index = local * gpus // local_ranks
    return index, sum(1 for r in range(local_ranks) if r * gpus // local_ranks == index)


def share_of_gpu(local_ranks: int, gpus: int) -> float:
    """The memory fraction the fullest GPU's ranks are each capped to (what the fit check allows a rank)."""
    return 1 / max(gpu_of(r, local_ranks, gpus)[1] for r in range(local_ranks)) if local_ranks > gpus else 1.0


def sharing_line(kind: str, local_ranks: int, gpus: int) -> str:
    """The one line a run that shares says at start: what is shared, and what its figures are not."""
    if kind != "cuda":
        return (f"pipezero: --share-device on with CPU ranks: every transfer and collective is copied through "
                f"staging buffers (the shared-GPU path's test); tokens/s is not a figure of any device")
    per = -(-local_ranks // gpus)
    return (f"pipezero: {local_ranks} ranks share {gpus} GPU{'s' * (gpus != 1)} ({per} a GPU, each capped to 1/{per} "
            f"of its memory; transfers and collectives through host memory over gloo): memory and CUDA code paths "
            f"are measured, throughput is not a multi-GPU figure")


def rank_device(kind: str, shared: bool = False) -> torch.device:
    """This process's device; for CUDA the GPU numbered by LOCAL_RANK, made current so every
    allocation without an explicit device lands on it. `shared`: ranks share the node's GPUs
    (`gpu_of`), each allowed its share of the GPU's memory by the caching allocator."""
    if kind == "cpu":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if shared and count > 0:
        index, ranks = gpu_of(local, max(local_world(), local + 1), count)
        torch.cuda.set_device(index)
        torch.cuda.set_per_process_memory_fraction(1 / ranks, index)
        return torch.device("cuda", index)
    if local >= count:
        raise ConfigError(f"local rank {local} needs GPU {local}, but this machine shows {count}: "
                          f"{ranks_per_node_advice(os.environ, count)}")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def backend(device: torch.device, shared: bool = False) -> str:
    """gloo and NCCL on GPUs; gloo alone on CPU ranks and on GPUs shared (NCCL refuses those)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" and not shared else "gloo"


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
