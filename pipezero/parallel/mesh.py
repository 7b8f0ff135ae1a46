"""The pp x dp arrangement of ranks as a value: which stage and replica a rank is, and its groups.

Neighbouring global ranks share a node, so the placement decides which traffic stays on the fast
links inside it. `dp-inner` (the default): global rank = pp_rank * dp + dp_rank, the D replicas of a
stage are neighbours and their gradient collectives stay inside a node when D divides its size.
`pp-inner`: global rank = dp_rank * pp + pp_rank, the P stages of a pipeline are neighbours and the
activations stay inside a node, while gradients cross nodes (better when gradients are light, as in
a small model with long sequences, or the link is fast enough to hide them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipezero.config import Placement


@dataclass(frozen=True)
class Mesh:
    pp: int
    dp: int
    rank: int = 0
    placement: Placement = Placement.DP_INNER

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.pp * self.dp:
            raise ValueError(f"rank {self.rank} outside a {self.pp} x {self.dp} mesh")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.dp if self.placement is Placement.DP_INNER else self.rank % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp if self.placement is Placement.DP_INNER else self.rank // self.pp

    def global_rank(self, pp_rank: int, dp_rank: int) -> int:
        if self.placement is Placement.DP_INNER:
            return pp_rank * self.dp + dp_rank
        return dp_rank * self.pp + pp_rank

    def pp_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline (same replica, every stage)."""
        return [self.global_rank(p, self.dp_rank) for p in range(self.pp)]

    def dp_ranks(self) -> list[int]:
        """Global ranks holding this rank's stage (every replica)."""
        return [self.global_rank(self.pp_rank, d) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Every stage's data-parallel group of global ranks, stages in order."""
        return [[self.global_rank(s, d) for d in range(self.dp)] for s in range(self.pp)]


@dataclass
class Groups:
    """Process groups of one mesh; None where the group would be this rank alone."""

    pp: Any
    dp: Any
    world: Any


def build_groups(mesh: Mesh) -> Groups:
    """Create every pp and dp group of two or more ranks (a collective call: all ranks must call it
    with the same mesh); a group of one rank is not made, as nothing would cross it."""
    if mesh.world_size == 1:
        return Groups(None, None, None)
    pp_group = dp_group = None
    for d in range(mesh.dp if mesh.pp > 1 else 0):
        g = dist.new_group([mesh.global_rank(p, d) for p in range(mesh.pp)])
        if d == mesh.dp_rank:
            pp_group = g
    for p in range(mesh.pp if mesh.dp > 1 else 0):
        g = dist.new_group([mesh.global_rank(p, d) for d in range(mesh.dp)])
        if p == mesh.pp_rank:
            dp_group = g
    return Groups(pp_group, dp_group, dist.group.WORLD)
