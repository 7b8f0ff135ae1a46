"""The learning-rate schedule: a pure function of the step (the optimizer itself is zero/adamw.py)."""

from __future__ import annotations

import math

from pipezero.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warm-up to `lr` over `warmup_steps`, then cosine decay to `min_lr` at `max_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def short_of_peak(cfg: OptimConfig, max_steps: int) -> str | None:
    """A run that ends inside its warm-up never trains at the rate it names (the large presets warm
    up over 2000 steps): a line saying so, or None."""
    if max_steps >= cfg.warmup_steps:
        return None
    top = lr_at(max_steps - 1, cfg, max_steps)
    return (f"the warm-up ({cfg.warmup_steps} steps) is longer than the run ({max_steps}): the learning rate "
            f"reaches {top:.3g}, not its peak {cfg.lr:g}; --warmup-steps sets it")
