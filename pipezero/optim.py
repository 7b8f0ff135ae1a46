"""Optimizer construction and the learning-rate schedule (pure function of the step)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from pipezero.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `max_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def decay_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: decaying norm gains pulls them toward zero for no benefit."""
    decay, keep = [], []
    for _, p in named:
        if p.requires_grad:
            (decay if p.dim() >= 2 else keep).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_adamw(named: Iterable[tuple[str, nn.Parameter]], cfg: OptimConfig) -> torch.optim.Optimizer | None:
    """AdamW over the given parameters; None when a stage owns no trainable parameter."""
    groups = decay_groups(named, cfg.weight_decay)
    if not groups:
        return None
    # foreach=False: the same arithmetic order on every layout, so sharded and unsharded runs agree.
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
