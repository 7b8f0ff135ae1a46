"""The torch.distributed calls pipezero makes that changed names across torch versions, in one place.

Flat all-gather and reduce-scatter are `all_gather_into_tensor` and `reduce_scatter_tensor` on every
torch from the supported minimum (pyproject.toml) to the newest tested; torch 2.13 adds the
`*_single` names and marks the old ones deprecated, but GPU images still ship older torch, so the
old names are what runs everywhere. `MINIMUM_API` lists every `torch.distributed` name pipezero may
use; tests/test_torch_compat.py fails when the code reaches for one outside it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

MINIMUM_TORCH = (2, 5)  # SDPA's enable_gqa (models/llama.py) is the newest API pipezero needs

# Every torch.distributed attribute pipezero uses, each present in torch 2.5 (gloo's async flat
# reduce-scatter since 2.3; the rest older).
MINIMUM_API = frozenset({
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single", "all_gather_object",
    "broadcast", "broadcast_object_list", "isend", "irecv", "barrier", "new_group", "init_process_group",
    "destroy_process_group", "is_initialized", "get_rank", "get_world_size", "get_backend", "get_process_group_ranks",
    "FileStore", "TCPStore", "PrefixStore", "ReduceOp", "ProcessGroup", "Work", "group",
})


# torch >= 2.13 warns that these names are deprecated in favour of names older torch lacks: hush
# exactly that message (a filter, not a context manager, because hooks call these from autograd's
# threads, where swapping the warning state is not safe).
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` "
                        r"is deprecated", category=FutureWarning)


def all_gather(out: torch.Tensor, shard: torch.Tensor, group: Any) -> Any:
    """Start filling `out` (D x shard) with every rank's `shard`, in rank order; returns the work."""
    return dist.all_gather_into_tensor(out, shard, group=group, async_op=True)


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: Any) -> Any:
    """Start summing `full` over the group, this rank keeping its slice in `out`; returns the work."""
    return dist.reduce_scatter_tensor(out, full, group=group, async_op=True)
