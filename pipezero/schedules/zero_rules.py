"""What each ZeRO stage keeps and moves, in one table: the lowering (schedules/lowering.py), the
runtime (zero/), the memory model (memory/) and the planner (planner/) ask these rules, never the stage number. Plain
data beside the plans that follow from it, so the plan layer reads it without torch.

Over the D data-parallel ranks of one pipeline stage (flat buckets, zero/buckets.py):

- stage 0: gradients accumulate in full buckets; after a chunk's last backward of the step each
  bucket is all-reduced (launched as soon as autograd has filled it, overlapping the rest of that
  backward); every rank updates every parameter and holds all of AdamW's state.
- stage 1: each rank updates only its 1/D shard (AdamW state for that shard only), so it needs
  only its shard of the summed gradient: each bucket is reduce-scattered (not all-reduced: the rest
  of an all-reduce's sum was never read, and cost half again the step's bytes), the full gradient
  buckets kept for the whole step; then the updated shards are all-gathered so every rank computes
  with full weights. The same bytes as stage 2, as in the ZeRO paper; stage 2 saves the memory.
- stage 2: gradients are reduce-scattered as at stage 1, and each rank keeps only its gradient
  shard; with grad-reduce `step` the full gradient still accumulates over the step's micro-batches (one
  reduce-scatter a bucket a step), with `microbatch` every backward reduce-scatters into the fp32
  shard and drops the full gradient. Updated shards are all-gathered as at stage 1.
- stage 3: as stage 2, and parameters live only as shards between uses: gathered before a chunk
  (or a layer) computes, released after. The fp32 shard is the master copy the optimizer updates;
  nothing is gathered after the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipezero.config import GradReduce


@dataclass(frozen=True)
class Rules:
    stage: int
    sharded_grads: bool  # keeps only this rank's gradient shard after the reduction (else the full buckets)
    sharded_params: bool  # parameters exist only as shards between uses
    updates_whole: bool  # every rank updates whole buckets (else only its shard)
    gathers_updates: bool  # the updated shards are all-gathered after the step

    @property
    def gathers_weights(self) -> bool:
        """Whether any parameter gather crosses the group (what --quantize-weights compresses)."""
        return self.sharded_params or self.gathers_updates

    @property
    def reduces_to_shard(self) -> bool:
        """Whether a bucket's gradient is reduce-scattered (each rank receives the sum of its own
        shard only): wherever a rank updates only its shard, whether or not it keeps only that shard."""
        return not self.updates_whole

    @property
    def reduction(self) -> str:
        return "reduce-scatter of gradients" if self.reduces_to_shard else "all-reduce of gradients"

    def describe(self) -> str:
        """What the stage keeps and moves, in the words `--zero`'s help uses: read from the flags
        above, so the help cannot say what the code no longer does."""
        keeps = ("parameters, gradients and optimizer state sharded" if self.sharded_params else
                 "gradients and optimizer state sharded" if self.sharded_grads else
                 "optimizer state sharded" if not self.updates_whole else "everything replicated")
        moves = [self.reduction]
        if self.gathers_updates:
            moves.append("all-gather of the updated weights")
        if self.sharded_params:
            moves.append("all-gather of each chunk's (or layer's) parameters before use")
        return f"{self.stage} ({keeps}: {' and '.join(moves)})"

    def reduces_every_backward(self, mode: GradReduce) -> bool:
        """Whether a chunk's every backward reduces (else only its last of the step)."""
        return self.sharded_grads and mode is GradReduce.MICROBATCH


RULES = {
    0: Rules(0, sharded_grads=False, sharded_params=False, updates_whole=True, gathers_updates=False),
    1: Rules(1, sharded_grads=False, sharded_params=False, updates_whole=False, gathers_updates=True),
    2: Rules(2, sharded_grads=True, sharded_params=False, updates_whole=False, gathers_updates=True),
    3: Rules(3, sharded_grads=True, sharded_params=True, updates_whole=False, gathers_updates=False),
}


def help_text() -> str:
    """`--zero`'s help: each stage's line from its rules."""
    return ", ".join(r.describe() for r in RULES.values())
