"""Steps whose loss or gradient norm is not finite: skipped on every rank, reported, and bounded.

bf16 and fp32 have no loss scaling to absorb an overflow, so a non-finite step is dropped whole
(ZeroDP.step leaves parameters and AdamW state as they were, and every rank decides alike because
the loss and the norm arrive in one all-reduce). This module says which pipeline stages went bad
and stops the run after too many such steps in a row.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch.distributed as dist

from pipezero.parallel.waits import gather_objects


@dataclass(frozen=True)
class StepOutcome:
    """What ZeroDP.step saw: the numbers every rank agrees on, and whether this rank's were finite."""

    grad_norm: float  # global, before clipping
    loss: float  # summed over every rank: the global batch's mean token loss
    applied: bool  # False: the norm or loss was not finite and the step was skipped on every rank
    local_grads_finite: bool  # this rank's gradients (to name the stage that went bad)


def finite_or_none(x: float) -> float | None:
    """metrics.jsonl stays strict JSON: a non-finite value is written as null."""
    return x if math.isfinite(x) else None


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row: the run stops instead of spinning on garbage."""


def report_nonfinite(outcome: StepOutcome, local_loss: float, step: int, pp_rank: int,
                     in_a_row: int, limit: int) -> None:
    """Say which pipeline stages produced the non-finite loss or gradients of a skipped step
    (every rank takes part), and stop the run after `limit` such steps in a row."""
    mine = (pp_rank, math.isfinite(local_loss), outcome.local_grads_finite)
    where = f"rank {dist.get_rank()}, " if dist.is_initialized() else ""
    flags = gather_objects(mine, f"{where}step {step}: non-finite step: which stages produced it")
    bad_loss = sorted({s for s, loss_ok, _ in flags if not loss_ok})
    bad_grads = sorted({s for s, _, grads_ok in flags if not grads_ok})
    what = "; ".join(x for x in (f"loss on stage {bad_loss}" if bad_loss else "",
                                 f"gradients on stage {bad_grads}" if bad_grads else "") if x)
    message = (f"step {step}: non-finite {what or 'global norm'} (loss {outcome.loss}, grad norm "
               f"{outcome.grad_norm}); step skipped, {in_a_row} in a row (limit --max-bad-steps {limit})")
    if (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"pipezero: warning: {message}", file=sys.stderr, flush=True)
    if in_a_row >= limit:
        raise TrainingDiverged(f"{message}: stopping; lower the learning rate, check the data, or resume "
                               f"from an earlier checkpoint")
