"""Tied input and output embeddings when the two ends of the model sit in different chunks.

Each chunk then owns its own copy, initialised equal (models/llama.py draws the tied head from the
embedding's generator). One step's gradient of the shared weight is the sum of both copies'
gradients: copies on one rank are added locally, copies on the first and last pipeline rank are
all-reduced between those two. Both copies then take the same AdamW step and stay equal; the
gradient norm counts the shared weight once (the head's copy is left out of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipezero.parallel.mesh import Mesh
from pipezero.parallel.staging import Direct, Transport
from pipezero.parallel.waits import wait_or_raise


@dataclass
class TiedCopies:
    local: list[nn.Parameter]  # this rank's copies (0, 1 or 2)
    head: nn.Parameter | None  # the copy left out of the gradient norm, if held here
    group: Any  # the first and last pipeline rank of this replica; None when one rank holds both
    transport: Transport = field(default_factory=Direct)  # parallel/staging.py; set with the stage's

    @property
    def nbytes(self) -> int:
        """The fp32 gradient of one copy: what the sum moves between the ends."""
        return self.local[0].numel() * 4 if self.local else 0

    def sum_grads(self, timeout_s: float, what: str) -> None:
        if not self.local:
            return
        total = sum((p.grad if p.grad is not None else torch.zeros_like(p)) for p in self.local)
        if self.group is not None:
            work = self.transport.all_reduce(total, self.group)
            wait_or_raise(work, timeout_s, what, stream_ordered=total.is_cuda and self.transport.stream_ordered)
        for p in self.local:
            if p.grad is None:
                p.grad = total.clone()
            else:
                p.grad.copy_(total)


def find_tied(named: dict[str, nn.Parameter], names: tuple[str, str]) -> tuple[list[nn.Parameter], nn.Parameter | None]:
    """This rank's copies of the tied weight `names` (the model spec's: for the built-in model the
    embedding `layers.0.weight` and the head's `layers.{L+1}.proj.weight`) when they are distinct
    tensors, and the second (head's) copy."""
    emb, head = named.get(names[0]), named.get(names[1])
    local = [p for p in (emb, head) if p is not None]
    return local, head


def tie_group(mesh: Mesh) -> Any:
    """Create (collectively, on every rank) the first/last-rank pair of each replica; return ours.
    The pair's global ranks come from the mesh: under `--placement pp-inner` a replica's stages are
    neighbours (d x P and d x P + P - 1), and pairing by the dp-inner arithmetic would sum the
    embedding gradients of two replicas of one stage instead."""
    if mesh.pp == 1:
        return None
    mine = None
    for d in range(mesh.dp):
        pair = [mesh.global_rank(0, d), mesh.global_rank(mesh.pp - 1, d)]
        g = dist.new_group(pair)
        if mesh.rank in pair:
            mine = g
    return mine
