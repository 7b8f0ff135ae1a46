"""The runs the memory model (sim/memory.py) is held against, shared by its test and its bench:
train each configuration for its steps with --memory-profile (telemetry/memory_profile.py) and keep
each rank's measured peak of the first step."""

from __future__ import annotations

from dataclasses import replace

from pipezero.config import TrainConfig


def first_step_peaks(rank: int, world: int, configs: list[TrainConfig]) -> list[int]:
    """One rank of a `world`-rank job (parallel/spawn.py run_ranks): this rank's measured peak for
    each of `configs`, in order."""
    from pipezero.engine import train

    out = []
    for cfg in configs:
        res = train(replace(cfg, run=replace(cfg.run, memory_profile=True)))
        out.append(res.measured_peak_bytes or 0)
    return out
