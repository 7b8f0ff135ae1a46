"""Bytes a parameter per rank: what the ZeRO paper predicts, and how our layout differs from it.

Rajbhandari et al. 2020 (ZeRO), sec. 3 and Table 1, with Adam (K = 12 bytes of fp32 master weight,
momentum and variance a parameter under mixed precision):
  mixed precision: stage 0: 2 + 2 + 12 = 16, stage 1: 4 + 12/D, stage 2: 2 + 14/D, stage 3: 16/D.
  plain fp32 (4-byte weights and gradients, 8 bytes of Adam state): 16, 8 + 8/D, 4 + 12/D, 16/D.
pipezero keeps fp32 parameters and gradients whatever `--dtype` says (bf16 is autocast compute, and
gradients accumulate in fp32 across micro-batches), so it always follows the fp32 column. What bf16
does change is the traffic: activations, their gradients, gradient reductions and ZeRO-3's
parameter gathers travel in bf16 (half the bytes); ZeRO-1/2 still gather updated parameters in fp32,
because those buckets are the fp32 masters that compute reads (a bf16 copy would leave each rank
computing norms and embeddings with differently rounded weights).
"""

from __future__ import annotations

from pipezero.config import DType, GradReduce
from pipezero.zero.buckets import Bucket
from pipezero.schedules.zero_rules import Rules


def paper_bytes_per_param(stage: int, dp: int, mixed: bool) -> float:
    if mixed:
        return {0: 16.0, 1: 4 + 12 / dp, 2: 2 + 14 / dp, 3: 16 / dp}[stage]
    return {0: 16.0, 1: 8 + 8 / dp, 2: 4 + 12 / dp, 3: 16 / dp}[stage]


def ours_bytes_per_param(stage: int, dp: int) -> float:
    return paper_bytes_per_param(stage, dp, mixed=False)


def explain(stage: int, dp: int, dtype: DType, grad_reduce: GradReduce = GradReduce.STEP,
            microbatches: int = 1, in_flight: int = 1) -> dict:
    """The paper's and our bytes a parameter, and what `grad_reduce` costs. `in_flight`
    (--buckets-in-flight): reduce-scatters that may still run while backward fills the next bucket,
    so a microbatch-mode rank holds up to `in_flight + 1` full gradient buckets (zero/sharded.py)."""
    mixed = dtype is DType.BF16
    paper = paper_bytes_per_param(stage, dp, mixed)
    ours = ours_bytes_per_param(stage, dp)
    note = "same layout as the paper's fp32 case"
    if mixed:
        note = (f"paper's mixed-precision layout keeps fp16/bf16 weights and gradients; pipezero keeps them in fp32 "
                f"(autocast computes in bf16; communication is bf16 except ZeRO-1/2's parameter gather), so it "
                f"holds {ours - paper:+.2f} bytes a parameter more")
    out = {"paper_bytes_per_param": paper, "ours_bytes_per_param": ours, "note": note,
           "grad_reduce": grad_reduce.value}
    if stage >= 2 and microbatches > 1:
        if grad_reduce is GradReduce.STEP:
            out["grad_reduce_note"] = (f"step: the full fp32 gradient accumulates through the step's {microbatches} "
                                       f"micro-batches, so during a step a rank holds {4 - 4 / dp:+.2f} bytes a "
                                       f"parameter over the paper's stage {stage}; one reduce-scatter a step")
        else:
            out["grad_reduce_note"] = (f"microbatch: each micro-batch's gradient is reduce-scattered into the fp32 "
                                       f"shard as backward produces it (the paper's stage {stage} memory, up to "
                                       f"{in_flight + 1} buckets of full gradient at once); {microbatches} "
                                       f"reduce-scatters a step instead of one")
    return out


def held_bytes(buckets: list[Bucket], rules: Rules, optimizer_bytes: int) -> dict[str, int]:
    """Bytes a rank holds between steps for parameters, gradients and optimizer state. Stage 1-2
    masters are views of the parameters; stage 3's master is the parameter shard."""
    params = sum((b.shard_size if rules.sharded_params else b.padded) * 4 for b in buckets)
    grads = sum((b.shard_size if rules.sharded_grads else b.padded) * 4 for b in buckets)
    # --secondary-shard node: ZeRO-3's share of each bucket kept in the node, 4/N bytes a parameter
    secondary = sum(b.secondary.numel() * 4 for b in buckets if b.secondary is not None)
    return {"params": params, "grads": grads, "optimizer": optimizer_bytes, "secondary": secondary}
