"""ZeRO-1/2: each layer waits for its own updated weights, not the whole model.

After the optimizer step every replica all-gathers the updated shards of every bucket. Waiting for
all of them at the end of the step leaves that traffic exposed (nothing computes meanwhile);
instead the program's UNSHARDs after OPTIM_STEP only start them (none blocks under --overlap-gather),
in forward order, and a forward pre-hook on every module holding parameters waits for that module's
buckets (and the ones issued before them) the first time it runs. So the gathers of later layers travel while the first layers of the next step
compute. Anything else that reads full parameters between steps (checkpoints, snapshots, the text
sample) calls `settle()` first.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from torch import nn

from pipezero.zero.buckets import Bucket


class Settler(Protocol):
    def all_buckets(self) -> Iterable[Bucket]: ...
    def settle(self, bucket: Bucket | None = None) -> None: ...


def install(zero: Settler, chunks: dict[int, nn.Module]) -> None:
    """Hook every module that holds parameters to wait for its buckets' gathers before it runs."""
    buckets = list(zero.all_buckets())
    for chunk in chunks.values():
        for module in chunk.modules():
            own = [b for b in buckets if any(b.holds(q) for q in module.parameters(recurse=False))]
            if own:
                module.register_forward_pre_hook(_waiter(zero, own))


def _waiter(zero: Settler, own: list[Bucket]):
    def pre_forward(_m: nn.Module, _args: tuple) -> None:
        for b in own:
            zero.settle(b)
    return pre_forward
