"""Joining the job's process group: the layout checked against the ranks started, and a store of
this attempt's own under torchrun's elastic restarts."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from pipezero.config import Device, ShareDevice, TrainConfig
from pipezero.errors import ConfigError
from pipezero.parallel.agreement import check_same_settings
from pipezero.parallel.device import backend, device_kind, local_world, rank_device, shares_device, sharing_line
from pipezero.slurm import start_ranks_advice


def init_distributed(cfg: TrainConfig) -> tuple[int, torch.device]:
    """Join the process group torchrun describes (if any); return this rank and its device. A
    layout that does not match the number of ranks is refused before any collective runs. Where the
    caller already made a group (tests, benchmarks), "auto" follows its backend, and a gloo group
    takes GPU ranks only when told they share (`--device cuda --share-device on`). Every rank's
    settings must equal rank 0's (parallel/agreement.py), checked once the group exists."""
    p, r = cfg.parallel, cfg.run
    kind = device_kind(r.device)
    forced = r.device is Device.CUDA and r.share_device is ShareDevice.ON
    if dist.is_initialized() and "nccl" not in str(dist.get_backend()) and not forced:
        if r.device is Device.CUDA:
            raise ConfigError(f"--device cuda, but the process group is {dist.get_backend()} only: use --device cpu, "
                              f"or --share-device on (transfers through the host)")
        kind = "cpu"
    shared = staged_rank(cfg, kind)
    device = rank_device(kind, shared)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != p.world_size:
        raise ConfigError(f"--pp {p.pp} x --dp {p.dp} = {p.world_size} ranks, but {world} were started: "
                          f"{start_ranks_advice(os.environ, p.world_size)} (or change --pp/--dp)")
    if world > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=p.timeout_s)
        # With device_id NCCL binds its communicator to this rank's GPU at once; the timeout arms
        # NCCL's watchdog, which bounds the stream-ordered waits (parallel/waits.py).
        nccl = device.type == "cuda" and not shared
        dist.init_process_group(backend(device, shared), timeout=timeout, **attempt_store(timeout),
                                **({"device_id": device} if nccl else {}))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if shared and rank == 0:  # said under --quiet (verify) too: no figure of this run is a multi-GPU one
        print(sharing_line(kind, local_world(), torch.cuda.device_count() if kind == "cuda" else 0), file=sys.stderr,
              flush=True)
    # Settings given differently to one rank (outside torchrun) are refused on every rank at once.
    check_same_settings(cfg, device, p.timeout_s)
    return rank, device


def staged_rank(cfg: TrainConfig, kind: str) -> bool:
    """Whether this rank's transfers go through host buffers (parallel/staging.py): its node's
    ranks share GPUs, or `--share-device on` asks for the path on any device."""
    return shares_device(cfg.run.share_device, kind, local_world(),
                         torch.cuda.device_count() if kind == "cuda" else 0)


def attempt_store(timeout: timedelta) -> dict[str, object]:
    """Under torchrun's elastic agent, a store of this attempt's own: after a restart the agent
    hands the workers the same store again, where the failed attempt's gloo addresses still sit,
    and the new ranks dial dead ports ("Connection refused" in connectFullMesh; seen with torch
    2.13 and torchrun --max-restarts). A prefix per restart keeps the attempts apart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}  # plain env:// rendezvous
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"pipezero/attempt_{attempt}", client),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
