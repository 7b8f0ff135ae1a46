"""Every wait on another rank goes through here: bounded, and failing with what was awaited.

Two kinds of wait. On gloo (CPU tensors) the CPU blocks until the transfer is done, for at most the
timeout, and a miss raises naming the rank and the operation. On NCCL (GPU tensors) the wait is
stream-ordered: `work.wait()` with no timeout makes the current CUDA stream wait for the transfer
while the CPU goes on queueing work. A timeout there would make the CPU poll until the transfer
ends, so nothing could be queued ahead and every wait would stall the launch of the next kernels.
Such a wait is bounded by NCCL's own watchdog instead, armed with the same timeout when the process
group is created (parallel/process_group.py), which aborts the rank naming the collective.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any


class PipelineTimeout(RuntimeError):
    """A wait on a peer ran past the timeout; the message names rank, step and what was awaited."""


def wait_or_raise(work: Any, timeout_s: float, what: str, stream_ordered: bool = False) -> None:
    """Wait for `work`: on the CPU for at most `timeout_s`, or (`stream_ordered`, for NCCL work on
    GPU tensors) by making the current stream wait, which returns at once."""
    t0 = time.monotonic()
    try:
        ok = work.wait() if stream_ordered else work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        took = time.monotonic() - t0
        how = f"timed out after {timeout_s:g}s" if took >= 0.9 * timeout_s else f"failed after {took:.1f}s (peer gone?)"
        raise PipelineTimeout(f"{what}: {how} ({e})") from e
    if ok is False:
        raise PipelineTimeout(f"{what}: timed out after {timeout_s:g}s")


def all_reduced(values: list[float], group: Any, timeout_s: float, what: str, largest: bool = False) -> list[float]:
    """`values` summed (`largest`: their most) over `group`, waiting at most `timeout_s` (a CPU
    tensor: gloo carries it on every backend); a peer that stalls or died fails this rank with
    `what`, as every other wait does. None: no group, the values as they are."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    if group is not None:
        op = dist.ReduceOp.MAX if largest else dist.ReduceOp.SUM
        wait_or_raise(dist.all_reduce(t, op=op, group=group, async_op=True), timeout_s, what)
    return t.tolist()


def gather_objects(obj: Any, what: str) -> list[Any]:
    """Every rank's `obj`, in rank order (`[obj]` without a process group). An object gather has no
    asynchronous form, so the group's own timeout (`--timeout`, set when it was made) bounds it;
    a failure (a peer gone, or that timeout) names `what`, as every other wait does."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    t0 = time.monotonic()
    try:
        dist.all_gather_object(out, obj)
    except RuntimeError as e:  # gloo's and NCCL's errors (DistBackendError) are RuntimeErrors
        raise PipelineTimeout(f"{what}: failed after {time.monotonic() - t0:.1f}s (a peer gone, or past "
                              f"--timeout) ({e})") from e
    return out
