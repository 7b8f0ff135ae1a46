"""ZeRO stage 0: plain data parallelism, gradients summed across replicas in flat buckets.

Gradients are copied into flat buffers of about `bucket_mb` each, so there is one collective a
bucket instead of one a tensor; the loss is already divided by the global token count, so a sum
(not a mean) gives the global gradient.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> Iterator[list[torch.nn.Parameter]]:
    bucket: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        bucket.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def allreduce_grads(params: Sequence[torch.nn.Parameter], group: Any, bucket_mb: float, timeout_s: float,
                    what: str) -> None:
    """Sum `.grad` of `params` over `group` (None = nothing to do); parameters without a gradient
    contribute zeros, so every replica issues the same collectives."""
    if group is None or not params:
        return
    pending = []
    for bucket in buckets(params, int(bucket_mb * 2**20)):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        pending.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))
    for work, flat, bucket in pending:
        if not work.wait(timeout=timedelta(seconds=timeout_s)):
            raise RuntimeError(f"{what}: gradient all-reduce timed out after {timeout_s:g}s")
        offset = 0
        for p in bucket:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
