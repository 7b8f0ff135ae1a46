"""The runs the memory model (memory/model.py) is held against, shared by its test and its bench:
train each configuration for its steps with --memory-profile (telemetry/memory_profile.py) and keep
each rank's measured peak by phase: the first step (`train`), the first held-out evaluation
(`eval`) and the end-of-run text sample (`sample`, when the run samples)."""

from __future__ import annotations

from dataclasses import replace

from pipezero.config import TrainConfig


def phase_peaks(rank: int, world: int, configs: list[TrainConfig]) -> list[dict[str, int]]:
    """One rank of a `world`-rank job (bench/rank_spawner.py run_ranks): this rank's measured peak of
    each phase for each of `configs`, in order (the rank's peak is the most of them)."""
    from pipezero.engine import train

    out = []
    for cfg in configs:
        res = train(replace(cfg, run=replace(cfg.run, memory_profile=True)))
        out.append(dict(res.measured_phases))
    return out
