"""The vocabulary of a pipeline schedule: actions, chunk placements, and the schedule value itself.

A schedule is data: for each pipeline rank, the ordered actions it runs. The runtime plays those lists
and the checker-simulator proves and times them; neither adds policy. Communication is not listed: it
follows from the placement (an F of chunk c on one rank feeds chunk c+1 wherever that lives).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property


class Op(str, enum.Enum):
    F = "F"  # forward
    B = "B"  # backward for the chunk's inputs only (weight gradients deferred to W)
    W = "W"  # backward for the chunk's weights
    BW = "BW"  # full backward: B and W at once


@dataclass(frozen=True, order=True)
class Action:
    chunk: int  # global stage-chunk index, 0 .. P*V-1 in model order
    op: Op
    mb: int  # micro-batch index

    def __str__(self) -> str:  # "2F5": chunk 2, forward, micro-batch 5
        return f"{self.chunk}{self.op.value}{self.mb}"

    __repr__ = __str__


class ChunkPlacement(str, enum.Enum):
    """How stage chunks map to ranks (P ranks, V chunks each)."""

    LOOP = "loop"  # rank r holds r, r+P, r+2P, ... (one chunk a rank when V=1)
    V_SHAPE = "v"  # V=2: rank r holds r and 2P-1-r, so the last chunk sits beside the first


def chunks_of_rank(placement: ChunkPlacement, pp: int, virtual: int, rank: int) -> tuple[int, ...]:
    if placement is ChunkPlacement.V_SHAPE:
        if virtual != 2:
            raise ValueError("the V-shape placement holds exactly two chunks a rank")
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + v * pp for v in range(virtual))


@dataclass(frozen=True)
class Schedule:
    name: str
    pp: int
    microbatches: int
    virtual: int
    placement: ChunkPlacement
    actions: tuple[tuple[Action, ...], ...]  # actions[rank] in execution order

    @property
    def n_chunks(self) -> int:
        return self.pp * self.virtual

    @cached_property
    def rank_of_chunk(self) -> dict[int, int]:
        return {c: r for r in range(self.pp) for c in chunks_of_rank(self.placement, self.pp, self.virtual, r)}

    def chunks(self, rank: int) -> tuple[int, ...]:
        return chunks_of_rank(self.placement, self.pp, self.virtual, rank)

    def grid(self, mark: tuple[int, int] | None = None) -> str:
        """One line a rank, actions in order; `mark=(rank, index)` points at an offending action."""
        lines = []
        for r, acts in enumerate(self.actions):
            cells = [f"{str(a):>5}" for a in acts]
            line = f"rank {r}: " + " ".join(cells)
            if mark and mark[0] == r:
                line += f"   <-- ERROR HERE (action #{mark[1]}: {acts[mark[1]] if mark[1] < len(acts) else 'end'})"
            lines.append(line)
        return "\n".join(lines)
