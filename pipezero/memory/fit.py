"""The fit check `train` runs before any rank starts: every rank's predicted peak (memory/model.py)
against the memory a rank may use (`--gpu-memory GIB`; on CUDA by default the device's memory).
A layout that does not fit is refused in one line naming the rank, what fills it, and the fastest
layouts the planner finds that fit on the same number of ranks, so an out-of-memory error never
arrives mid-run."""

from __future__ import annotations

from dataclasses import replace

from pipezero.config import Device, DType, TrainConfig
from pipezero.errors import ConfigError
from pipezero.schedules.limits import FIT_MARGIN
from pipezero.memory.model import RankMemory, predict
from pipezero.memory.partition import resolve

GIB = 2**30


def rank_limit_gib(cfg: TrainConfig, local_ranks: int = 1) -> tuple[float | None, bool]:
    """(GiB a rank may use, whether ranks run on CUDA): --gpu-memory, else on CUDA the device's
    memory, or where `local_ranks` share the node's GPUs (`--share-device`) the share each rank is
    capped to (parallel/device.py `rank_device`), else (CPU) no limit."""
    cuda = cfg.run.device is Device.CUDA
    if cfg.run.device is Device.AUTO:
        import torch

        cuda = torch.cuda.is_available()
    if cfg.run.gpu_memory_gib is not None or not cuda:
        return cfg.run.gpu_memory_gib, cuda
    import torch

    from pipezero.parallel.device import shares_device, share_of_gpu

    total = torch.cuda.get_device_properties(0).total_memory / GIB
    gpus = torch.cuda.device_count()
    if shares_device(cfg.run.share_device, "cuda", local_ranks, gpus):
        return total * share_of_gpu(local_ranks, gpus), cuda
    return total, cuda


def check_fit(cfg: TrainConfig, limit_gib: float | None, cuda: bool,
              named: str | None = None) -> list[RankMemory] | None:
    """Raise ConfigError when some rank's predicted peak exceeds `limit_gib` less the model's
    `FIT_MARGIN`; the prediction otherwise (None without a limit, or for a model of one's own, whose
    layers the model does not know). `named`: what the limit is, for the message (`limit_name`)."""
    if limit_gib is None or cfg.model.spec is not None:
        return None
    ranks = predict(resolve(cfg, cuda), cuda)
    admitted = limit_gib * (1 - FIT_MARGIN)
    over = [r for r in ranks if r.peak_bytes > admitted * GIB]
    if not over:
        return ranks
    worst = max(over, key=lambda r: r.peak_bytes)
    parts = ", ".join(f"{c} {b / GIB:.2f}" for c, b in worst.biggest())
    # a peak outside the training step names its phase and what lowers it
    phase = {"eval": " in the held-out evaluation (fewer run.eval_batches lower it)",
             "sample": " in the end-of-run text sample (fewer --sample-tokens lower it)"}.get(worst.at.split(":")[0], "")
    named = named or f"--gpu-memory {limit_gib:g} GiB"
    raise ConfigError(f"the layout does not fit {named}: rank {worst.rank} would peak at "
                      f"{worst.peak_bytes / GIB:.2f} GiB{phase} ({parts} GiB; {len(over)} of {len(ranks)} ranks over "
                      f"{admitted:.3g} GiB, the limit less the model's {FIT_MARGIN:.0%} margin); "
                      f"{alternatives(cfg, admitted, cuda)}")


def limit_name(cfg: TrainConfig, local_ranks: int) -> str | None:
    """What the fit check's limit is where ranks share a GPU and no --gpu-memory was given: a
    rank's share, which a user did not type (None elsewhere: the flag's own name says it)."""
    if cfg.run.gpu_memory_gib is not None:
        return None
    import torch

    from pipezero.parallel.device import share_of_gpu, shares_device

    if not torch.cuda.is_available():
        return None
    gpus = torch.cuda.device_count()
    if not shares_device(cfg.run.share_device, "cuda", local_ranks, gpus) or share_of_gpu(local_ranks, gpus) == 1:
        return None
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    share = share_of_gpu(local_ranks, gpus)
    return (f"a rank's share of the GPU, {total * share:g} GiB (1/{round(1 / share)} of {total:g} GiB: "
            f"{local_ranks} ranks share {gpus} GPU{'s' * (gpus != 1)}; --gpu-memory GIB checks another limit)")


def alternatives(cfg: TrainConfig, limit_gib: float, cuda: bool, top: int = 3) -> str:
    """The planner's fastest layouts that fit on the same ranks, as train flags."""
    from pipezero.planner.layouts import Cluster
    from pipezero.planner.search import plan

    world = cfg.parallel.world_size
    cluster = Cluster(gpus=world, gpu_memory_gib=limit_gib, node_size=world, cpu=not cuda, headroom=1.0,
                      wire_bytes=2 if cfg.run.dtype is DType.BF16 else 4)
    try:
        fits, _ = plan(replace(cfg.model), cluster, cfg.data.seq_len, cfg.global_batch)
    except ValueError:
        fits = []
    if not fits:
        return f"no layout of {world} ranks fits with global batch {cfg.global_batch}: more ranks or a smaller model"
    shown = [flags(e.layout) for e in fits[:top]]
    return f"layouts that fit on {world} ranks, fastest first: " + "; ".join(shown)


def flags(lay) -> str:  # a planner Layout as train's flags
    out = f"--pp {lay.pp} --dp {lay.dp} --zero {lay.zero} --schedule {lay.schedule.value} " \
          f"--microbatches {lay.microbatches} --micro-batch-size {lay.micro_batch}"
    if lay.virtual > 1:
        out += f" --virtual-stages {lay.virtual}"
    if lay.recompute:
        out += " --recompute"
    if lay.grad_reduce.value != "step":
        out += f" --grad-reduce {lay.grad_reduce.value}"
    if lay.partition.value != "uniform":
        out += f" --partition {lay.partition.value}"
    if lay.offload:
        out += " --offload optimizer"
    return out
