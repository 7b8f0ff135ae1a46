"""The optimizer step on this rank's shards: global gradient norm, clipping, AdamW.

Every stage updates the same slices the same way (zero/adamw.py is fused AdamW element for element),
which is why any layout trains the model one process trains. What differs is where a stage finds
its shard of parameters and gradient (schedules/zero_rules.py): stage 0 updates whole buckets, stage 1 the
shard of its full gradient, stages 2-3 their reduced gradient shard, stage 3 into its master shard.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipezero.nonfinite import StepOutcome
from pipezero.zero.adamw import ShardedAdamW
from pipezero.zero.buckets import Bucket
from pipezero.zero.coordinator import Coordinator
from pipezero.schedules.program import Group
from pipezero.schedules.zero_rules import Rules


def shards(buckets: list[Bucket], rules: Rules, head: nn.Parameter | None) -> tuple[
        list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(parameter to update, its gradient, the slice counted once in the norm), a bucket each.
    `head`: the tied head's copy of the embedding, which the norm leaves out (it counts once)."""
    params, grads, counted = [], [], []
    for b in buckets:
        p, g, c = slices(b, rules)
        params.append(p)
        grads.append(g)
        if head is not None and b.holds(head):
            i = b.position[head]
            lo, hi = max(b.offsets[i], b.shard.start), min(b.offsets[i] + head.numel(), b.shard.stop)
            if lo < hi:
                c = c.clone()
                c[lo - b.shard.start:hi - b.shard.start] = 0
        counted.append(c)
    return params, grads, counted


def slices(b: Bucket, rules: Rules) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bucket `b`'s (parameter to update, its gradient, the part of it counted in the norm)."""
    if rules.updates_whole:
        g = b.grad if b.grad is not None else torch.zeros(b.padded, device=b.device)
        return b.flat, g, g[b.shard]
    if not rules.sharded_grads:
        g = b.grad[b.shard] if b.grad is not None else torch.zeros(b.shard_size, device=b.device)
        return b.flat[b.shard], g, g
    if b.shard_grad is None:  # no gradient reached it this step
        b.shard_grad = torch.zeros(b.shard_size, device=b.device)
    return updated(b, rules), b.shard_grad, b.shard_grad


def updated(b: Bucket, rules: Rules) -> torch.Tensor:
    """The fp32 elements of bucket `b` this rank updates: the whole bucket where every rank updates
    whole buckets, else its shard, which at ZeRO-3 is the master shard."""
    if rules.updates_whole:
        return b.flat
    return b.master if rules.sharded_params else b.flat[b.shard]  # type: ignore[return-value]


def clip_and_update(buckets: list[Bucket], rules: Rules, opt: ShardedAdamW, coord: Coordinator, lr: float,
                    max_norm: float, norm_group: Any, loss: torch.Tensor | float, head: nn.Parameter | None,
                    device: torch.device) -> StepOutcome:
    """Clip by the global norm over every shard of every stage and update this rank's shards, once
    every reduction has landed (`global_norm`)."""
    outcome, coef = global_norm(buckets, rules, coord, max_norm, norm_group, loss, head, device)
    if not outcome.applied:
        return outcome
    _, grads, _ = shards(buckets, rules, head)
    if coef < 1.0 and grads:  # a rank whose chunks hold no parameters has none
        torch._foreach_mul_(grads, coef)
    params = [updated(b, rules) for b in buckets]
    with coord.tracer.span("optimizer", "optim"):
        opt.step(params, grads, lr)
    return outcome


def global_norm(buckets: list[Bucket], rules: Rules, coord: Coordinator, max_norm: float, norm_group: Any,
                loss: torch.Tensor | float, head: nn.Parameter | None,
                device: torch.device) -> tuple[StepOutcome, float]:
    """The step's outcome and the factor that clips its gradients (1.0: none), from the global norm
    over every shard of every stage.

    `loss` is this rank's share of the step's loss; it is summed with the norm in one all-reduce,
    so every rank sees the same loss and norm and skips a non-finite step together (no loss scaling
    in fp32/bf16 to absorb it): parameters and AdamW state stay as they were. Reading those two
    numbers is the step's one wait for the device."""
    _, _, counted = shards(buckets, rules, head)
    device = buckets[0].device if buckets else device  # frozen or empty chunks: no parameters
    # Accumulated in fp64 (fp32 partial norms differ between layouts by enough that the clipped,
    # Adam-amplified updates drift apart by 1e-5), cast inside the reduction: no fp64 copy.
    local = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in counted]).pow(2).sum() if counted \
        else torch.zeros((), dtype=torch.float64, device=device)
    total = torch.stack([local, torch.as_tensor(loss, dtype=torch.float64, device=device)])
    # in the record at OPTIM_STEP's place whatever the world's size, as LOSS_SUM is: played anywhere
    # else (by the caller after its program, say) the record departs from the program
    coord.note_start("OPTIM_STEP", total.numel() * total.element_size(), "fp64", Group.WORLD.value, placed=True)
    if norm_group is not None:
        work = coord.transport.all_reduce(total, norm_group)  # type: ignore[union-attr]  # parallel/staging.py
        # the world group: every stage's norm and loss, not only this stage's replicas
        coord.wait(work, "OPTIM_STEP: all-reduce of the gradient norm and loss",
                   f"across all {dist.get_world_size(norm_group)} ranks")
    norm_sq, loss_sum, local_sq = torch.cat([total, local.view(1)]).tolist()  # one read from the device
    norm = math.sqrt(norm_sq)  # a sum of squares: never negative; nan and inf pass through
    outcome = StepOutcome(norm, loss_sum, math.isfinite(norm) and math.isfinite(loss_sum), math.isfinite(local_sq))
    coef = max_norm / (norm + 1e-6) if max_norm > 0 else 1.0
    return outcome, min(coef, 1.0)
