"""Flat buckets: the parameters of a stage chunk laid end to end, padded to a multiple of D.

Each bucket owns one flat fp32 parameter buffer and (while gradients exist) one flat gradient buffer;
the parameters and their `.grad` are views into them, so a collective moves a whole bucket with no
per-tensor calls and no copies. Data-parallel rank d owns the slice [d*S, (d+1)*S) of every bucket
(S = padded size / D). Padding is zeros that no parameter maps to: it is reduced, updated and
gathered like the rest and never read back, so sizes need not divide by D.

A bucket is also the unit of ZeRO's state: besides its buffers it holds this rank's reduced gradient
shard, ZeRO-3's master shard, and the collective in flight on it (a reduction or a gather), so the
coordinator (zero/coordinator.py) and the stage logic (zero/sharded.py) keep no tables beside it.

ZeRO-3 from a pretrained folder builds its buckets from a `FlatSource` instead of the parameters'
values: the layout needs only their shapes, so this rank's master shard is read range by range
(models/hf_weights.py FlatReader) and the full parameters first exist at the first gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch
from torch import nn

from pipezero.schedules.bucket_plan import BucketLayout


@dataclass
class Reduction:
    """A bucket's gradient reduction in flight."""

    work: Any  # None without a group: the result is already there
    out: torch.Tensor | None  # reduce-scatter output, added into the shard gradient on completion
    back: torch.Tensor | None = None  # a low-precision all-reduce's buffer, copied into the gradient


# (parameter name, start, stop) -> elements [start, stop) of that parameter flattened, any float
# dtype (copied into the fp32 master shard)
FlatSource = Callable[[str, int, int], torch.Tensor]


@dataclass
class Gathering:
    """A bucket's all-gather of parameter shards in flight."""

    work: Any
    wire: torch.Tensor | None  # a low-precision gather's buffer, copied into the parameters
    refresh: int = -1  # --secondary-shard: keep this rank's node share once it lands, as of this generation


@dataclass(eq=False)  # identity: buckets are compared and looked up as objects, never by value
class Bucket:
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]  # start of each parameter in the flat buffer
    numel: int  # real elements (without padding)
    dp: int
    dp_rank: int
    flat: torch.Tensor = field(init=False)  # (padded,) fp32; parameters are views into it
    grad: torch.Tensor | None = None  # (padded,) while gradients accumulate
    shard_grad: torch.Tensor | None = None  # stages 2-3: (S,) fp32 reduced gradient shard of the step
    master: torch.Tensor | None = None  # stage 3: (S,) fp32 parameter shard, the only copy between uses
    reduction: Reduction | None = None
    gathering: Gathering | None = None
    tied: bool = False  # holds a tied embedding copy: reduced in the step, after the copies are summed
    arrived: set[int] | None = None  # positions whose gradient is complete, during a backward
    secondary: torch.Tensor | None = None  # --secondary-shard: (padded / N,) this rank's share in its node
    secondary_of: int = -1  # the coordinator's generation (masters' version) `secondary` was cut from
    label: str = ""  # "chunk.k", as the program names it: REDUCE_GRAD(1.0) is chunk 1's first bucket
    source: InitVar[FlatSource | None] = None  # ZeRO-3: read the master shard from here, values unused

    def __post_init__(self, source: FlatSource | None) -> None:
        # keyed by the tensor object itself (tensors hash by identity): a parameter -> its position
        self.position: dict[nn.Parameter, int] = {p: i for i, p in enumerate(self.params)}
        if source is not None:
            self._from_source(source)
            return
        self.flat = torch.zeros(self.padded, device=self.device)
        for p, off in zip(self.params, self.offsets):
            self.flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[off:off + p.numel()].view_as(p)

    def _from_source(self, source: FlatSource) -> None:
        """Only this rank's shard, read from `source`; the full parameters are views of a released
        flat buffer that the first gather fills. Views need a storage to cut, so it is allocated,
        never written, and released at once: on the CPU untouched pages are no resident memory; on
        a GPU the caching allocator keeps the block for the first gather."""
        self.flat = torch.empty(self.padded, device=self.device)
        for p, off in zip(self.params, self.offsets):
            p.data = self.flat[off:off + p.numel()].view_as(p)
        self.release()
        lo, hi = self.shard.start, self.shard.stop
        self.master = torch.zeros(self.shard_size, device=self.device)  # padding stays zero
        for name, p, off in zip(self.names, self.params, self.offsets):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a < b:
                self.master[a - lo:b - lo].copy_(source(name, a - off, b - off))

    def holds(self, p: torch.Tensor) -> bool:
        return p in self.position

    @property
    def present(self) -> bool:
        """Whether the full parameters are in memory (ZeRO-3 releases them between uses)."""
        return self.flat.untyped_storage().size() != 0

    def release(self) -> None:
        """Drop the full parameters' storage. The tensor objects stay (sized zero), so views that
        autograd saved in forward are valid again once `restore` gives the storage back."""
        self.flat.untyped_storage().resize_(0)

    def restore(self) -> None:
        if not self.present:
            self.flat.untyped_storage().resize_(self.padded * self.flat.element_size())

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    @property
    def padded(self) -> int:
        return -(-self.numel // self.dp) * self.dp

    @property
    def shard_size(self) -> int:
        return self.padded // self.dp

    @property
    def shard(self) -> slice:
        return slice(self.dp_rank * self.shard_size, (self.dp_rank + 1) * self.shard_size)

    def attach_grads(self) -> None:
        """Give every parameter a zeroed `.grad` view into one flat gradient buffer."""
        if self.grad is None:
            self.grad = torch.zeros(self.padded, device=self.device)
            for p, off in zip(self.params, self.offsets):
                p.grad = self.grad[off:off + p.numel()].view_as(p)

    def adopt(self, p: nn.Parameter) -> None:
        """Move a gradient autograd (or W) created outside the flat buffer into it, so lazily
        allocated buckets (ZeRO-2/3) still reduce as one tensor."""
        if p.grad is None:
            return
        if self.grad is None:
            self.grad = torch.zeros(self.padded, device=self.device)
        i = self.position[p]
        view = self.grad[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)
        if p.grad.data_ptr() != view.data_ptr():
            view.add_(p.grad)
            p.grad = view

    def detach_grads(self) -> None:
        """Drop the full gradient (ZeRO-2/3 keep only their shard)."""
        self.grad = None
        for p in self.params:
            p.grad = None

    def decay_ranges(self, whole: bool = False) -> list[tuple[int, int]]:
        """Where AdamW's weight decay applies (matrices, not norm gains), as [start, stop) ranges of
        this rank's shard, or of the whole bucket when `whole` (stage 0 updates everything)."""
        lo, hi = (0, self.padded) if whole else (self.shard.start, self.shard.stop)
        out = []
        for p, off in zip(self.params, self.offsets):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if p.dim() >= 2 and a < b:
                out.append((a - lo, b - lo))
        return out


def in_order(buckets: dict[int, list[Bucket]]) -> list[Bucket]:
    """Every chunk's buckets, chunks in order (each chunk's in backward order): the order shards,
    optimizer states and checkpoints are listed in."""
    return [b for c in sorted(buckets) for b in buckets[c]]


def build_buckets(layouts: Sequence[BucketLayout], named: Sequence[tuple[str, nn.Parameter]], dp: int, dp_rank: int,
                  source: FlatSource | None = None) -> list[Bucket]:
    """The plan's buckets of one chunk (schedules/bucket_plan.py decides which tensor goes where, and
    at which offset), made of this chunk's trainable parameters `named`. A tensor the plan lists
    that the chunk lacks (or has in another shape), or a trainable one it leaves out, is an error:
    the plan and the model must be the same model. `source`: ZeRO-3 reads each bucket's master
    shard from it (Bucket)."""
    params = dict(named)
    planned = {t.name for b in layouts for t in b.tensors}
    if missing := [n for n, q in named if q.requires_grad and n not in planned]:
        raise ValueError(f"trainable parameters {missing[:3]} are in no bucket of the plan")
    out = []
    for layout in layouts:
        got = []
        for t in layout.tensors:
            q = params.get(t.name)
            if q is None or tuple(q.shape) != t.shape:
                raise ValueError(f"the plan puts {t.name} {list(t.shape)} in a bucket; the model has "
                                 f"{list(q.shape) if q is not None else 'no such trainable parameter'}")
            got.append(q)
        out.append(Bucket([t.name for t in layout.tensors], got, list(layout.offsets), layout.numel, dp, dp_rank,
                          source=source))
    return out


def shared_params(chunks: dict[int, nn.Module]) -> set[nn.Parameter]:
    """Parameters a chunk uses more than once (a head tied to the embedding in the same chunk)."""
    seen: set[nn.Parameter] = set()
    twice: set[nn.Parameter] = set()
    for m in chunks.values():
        for _, p in m.named_parameters(remove_duplicate=False):
            (twice if p in seen else seen).add(p)
    return twice


def named_by_chunk(chunks: dict[int, nn.Module]) -> dict[int, list[tuple[str, nn.Parameter]]]:
    """Each chunk's trainable parameters, a tied parameter listed once."""
    seen: set[nn.Parameter] = set()  # tensors hash by identity
    out: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for c, m in sorted(chunks.items()):
        out[c] = []
        for n, p in m.named_parameters():
            if p.requires_grad and p not in seen:
                seen.add(p)
                out[c].append((n, p))
    return out

