"""This rank's ZeRO state as a checkpoint sees it, and its rebuilding after a load.

Every ZeRO stage answers with the same slices, a bucket's shard [d*S, (d+1)*S) of fp32 parameters
and AdamW's two moments: that is what lets a checkpoint written at one stage (or D) load at
another (checkpoint/pieces.py maps the slices to tensor names and ranges).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipezero.zero.buckets import Bucket

if TYPE_CHECKING:
    from pipezero.zero.sharded import ZeroDP


def shard_state(zero: "ZeroDP") -> list[tuple[Bucket, dict[str, torch.Tensor]]]:
    """Per bucket, this rank's slice of what a checkpoint holds, each (shard_size,). They are views,
    so loading into them restores the state in place."""
    zero.settle("checkpoint")  # a step's gathers write the full buffers these slices live in
    out = []
    for b, st in zip(zero.all_buckets(), zero.opt.states):
        param = b.master if b.master is not None else b.flat[b.shard]
        moments = (st.exp_avg[b.shard], st.exp_avg_sq[b.shard]) if zero.rules.updates_whole \
            else (st.exp_avg, st.exp_avg_sq)
        out.append((b, {"model": param, "optim.exp_avg": moments[0], "optim.exp_avg_sq": moments[1]}))
    return out


def restore_replicas(zero: "ZeroDP", adam_steps: int) -> None:
    """After loading the shards: rebuild what the stage keeps whole on every rank (parameters below
    stage 3, AdamW moments at stage 0) from the shards of the other dp ranks."""
    zero.opt.step_count = adam_steps
    zero.comm.generation += 1  # new masters: any secondary share (--secondary-shard) is stale
    if not zero.rules.sharded_params:
        for b, st in zip(zero.all_buckets(), zero.opt.states):
            zero.comm.gather(b, b.flat[b.shard].clone())
            if zero.rules.updates_whole and zero.dp_group is not None:
                for full in (st.exp_avg, st.exp_avg_sq):
                    # gathered where the group's backend reads (--offload optimizer keeps them on the host)
                    whole = full.to(b.device)
                    # through the rank's transport: ranks sharing a GPU stage it through the host
                    work = zero.comm.transport.all_gather(whole, whole[b.shard].clone(), zero.dp_group)
                    zero.comm.wait(work, "all-gather of restored optimizer state")
                    full.copy_(whole)
    if zero.host is not None:
        zero.host.refresh()  # the host's copies of the weights, from those just loaded
