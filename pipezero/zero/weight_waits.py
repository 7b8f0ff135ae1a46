"""ZeRO-1/2 with --overlap-gather: module hooks that report the moments where a program waits for
the updated weights.

After the optimizer step every replica all-gathers the updated shards of every bucket. Waiting for
all of them at the end of the step leaves that traffic exposed (nothing computes meanwhile), so the
program's UNSHARDs after OPTIM_STEP only start them, in forward order, and the next program (the
next step's, or an evaluation's or the text sample's in between) waits for each with a WAIT inside
its chunk's first forward, at the `fwd` moment of the first layer that reads the bucket
(schedules/lowering.py `update_waits`). So the gathers of later layers travel while the first
layers compute.

These hooks, like zero/layerwise.py's for ZeRO-3, only say that a layer's forward is about to run
and which buckets it reads; ZeroDP (`moment`) plays what the program placed there and raises if the
layer reads a bucket whose gather is still in flight. They decide nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from pipezero.schedules.layer_plan import Moment, Trigger
from pipezero.zero.buckets import Bucket
from pipezero.zero.layerwise import Moments


def install(zero: Moments, chunks: dict[int, nn.Module], reads: Mapping[int, Mapping[int, tuple[int, ...]]]) -> None:
    """Hook every layer of every chunk that reads a bucket (bucket plan `reads`: layer -> buckets)
    to report its `fwd` moment."""
    for c, chunk in chunks.items():
        for index, ks in reads[c].items():
            _hook_layer(zero, chunk.layers[str(index)], index, [zero.buckets[c][k] for k in ks])


def _hook_layer(zero: Moments, layer: nn.Module, index: int, uses: list[Bucket]) -> None:
    def pre_forward(_m: nn.Module, _args: tuple) -> None:
        zero.moment(Trigger(Moment.FORWARD, index), uses, f"layer {index}")

    layer.register_forward_pre_hook(pre_forward)
