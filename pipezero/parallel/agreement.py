"""Every rank of a job must run the same settings: checked once, right after the group exists.

Each rank builds its configuration from its own command line, so under an outside torchrun (one
command a node) a flag given differently on one node is possible. Nothing else notices it: a
different `--microbatches` leaves a pipeline waiting for a micro-batch that is never sent (until
`--timeout`), a different `--zero` pairs unlike collectives, and a different `--lr` or `--seed` on
one replica trains silently apart. So the ranks compare a digest of their settings (one small
all-gather, bounded by the timeout) and, when any differs, every rank raises the same one-line
ConfigError naming the first rank and setting that differ, before any step.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist

from pipezero.config import TrainConfig
from pipezero.errors import ConfigError
from pipezero.parallel.collectives import all_gather
from pipezero.parallel.waits import gather_objects, wait_or_raise

# Settings a rank may hold on its own: how many CPU threads it computes with, and the progress bar
# (drawn by rank 0 alone). Everything else shapes the collectives or the numbers.
PER_RANK = frozenset({"run.threads", "run.progress"})


def compared_settings(cfg: TrainConfig, device: torch.device) -> dict[str, Any]:
    """`section.field` -> value of every setting the ranks must share, and the device type each
    resolved (`--device auto` on nodes with and without GPUs would join gloo to NCCL)."""
    flat = {f"{section}.{key}": value for section, fields in cfg.to_dict().items() if isinstance(fields, dict)
            for key, value in fields.items()}
    flat = {k: v for k, v in flat.items() if k not in PER_RANK}
    flat["device (resolved)"] = device.type
    return flat


def check_same_settings(cfg: TrainConfig, device: torch.device, timeout_s: float) -> None:
    """Raise ConfigError on every rank when any rank's settings differ from rank 0's."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = compared_settings(cfg, device)
    digest = hashlib.sha256(json.dumps(mine, sort_keys=True, default=str).encode()).digest()
    shard = torch.frombuffer(bytearray(digest), dtype=torch.int64)  # CPU: gloo carries it on every backend
    world, rank = dist.get_world_size(), dist.get_rank()
    every = torch.empty(world * shard.numel(), dtype=torch.int64)
    wait_or_raise(all_gather(every, shard, None), timeout_s,
                  f"rank {rank}: comparing settings with every rank before the first step")
    digests = every.view(world, -1)
    if bool((digests == digests[0]).all()):
        return
    # Every rank saw the same digests, so all take this path together.
    settings: list[dict[str, Any] | None] = gather_objects(mine, f"rank {rank}: every rank's settings")
    first = settings[0] or {}
    r = next(r for r in range(1, world) if settings[r] != first)
    other = settings[r] or {}
    key = next(k for k in sorted(first.keys() | other.keys()) if first.get(k) != other.get(k))
    raise ConfigError(f"rank {r} runs other settings than rank 0: {key} = {other.get(key)!r} on rank {r}, "
                      f"{first.get(key)!r} on rank 0; start every rank with the same flags and configuration")
