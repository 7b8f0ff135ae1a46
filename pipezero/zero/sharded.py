"""ZeRO stages 0-3 over the data-parallel ranks of one pipeline stage, driven by executor hooks.

The executor tells this object when a chunk is about to run forward, before and after each backward,
and whether that backward is the chunk's last of the step. From those moments alone:

- stage 0: gradients accumulate in flat buckets; during a chunk's last backward each bucket's
  all-reduce starts as soon as autograd has produced all of its gradients (a post-accumulate hook
  counts them), overlapping the rest of that backward; every rank updates everything.
- stage 1: the same all-reduce, but each rank updates only its shard (fp32 master and Adam state for
  1/D of the parameters) and the buckets are all-gathered after the step.
- stage 2: gradients are reduce-scattered instead, so each rank keeps only its shard. With
  `grad_reduce=step` the full gradient still accumulates over the step's micro-batches (one
  reduce-scatter a bucket a step, during the chunk's last backward); with `grad_reduce=microbatch`
  every backward reduce-scatters into the fp32 shard and drops the full gradient. Gradient buckets
  are allocated when their first gradient appears and at most two full buckets wait on a
  reduce-scatter at once, so the full gradient never exists all at once at stages 2 and 3.
- stage 3: parameters live only as shards between uses. With `keep_gathered` (default when P > 1)
  a chunk's buckets are all-gathered before its first forward of the step and kept for its
  micro-batches (memory for traffic), then released after its last backward. Without it, buckets
  are whole layers, gathered and released around each use with the next one prefetched
  (zero/layerwise.py). The storage is resized to zero, not reallocated, so autograd's saved views
  stay valid across the gather.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipezero.config import GradReduce, OptimConfig
from pipezero.nonfinite import StepOutcome
from pipezero.parallel.collectives import all_gather, reduce_scatter
from pipezero.parallel.waits import wait_or_raise
from pipezero.telemetry.trace import Tracer
from pipezero.zero.adamw import ShardedAdamW
from pipezero.zero.buckets import Bucket, make_buckets
from pipezero.zero.layerwise import layer_index
from pipezero.zero.tied import TiedCopies


@dataclass
class _Pending:
    work: Any
    bucket: Bucket
    out: torch.Tensor | None  # reduce-scatter output, added into the shard gradient on completion
    back: torch.Tensor | None = None  # a low-precision all-reduce's buffer, copied into the gradient


@dataclass
class _Gather:
    work: Any
    bucket: Bucket
    wire: torch.Tensor | None  # a low-precision gather's buffer, copied into the parameters


@dataclass
class ZeroDP:
    chunk_params: dict[int, list[tuple[str, nn.Parameter]]]
    shared: set[int]  # ids of parameters used more than once in a chunk (tied embeddings)
    stage: int
    dp: int
    dp_rank: int
    dp_group: Any  # None when dp == 1
    optim: OptimConfig
    grad_reduce: GradReduce = GradReduce.STEP
    bucket_mb: float = 25.0
    timeout_s: float = 300.0
    rank: int = 0
    keep_gathered: bool = True  # stage 3: a chunk stays gathered for its step (else layer by layer)
    tied: TiedCopies | None = None  # embedding/head copies in different chunks, summed before reducing
    tracer: Tracer = field(default_factory=Tracer)
    comm_dtype: torch.dtype = torch.float32  # bf16 halves gradient and ZeRO-3 parameter traffic
    device: torch.device = torch.device("cpu")  # where a rank with nothing to train still reduces the norm
    defer_gathers: bool = False  # stages 1-2: the step's all-gathers are waited for by settle (zero/updates.py)
    buckets: dict[int, list[Bucket]] = field(init=False)
    opt: ShardedAdamW = field(init=False)
    bytes_sent: int = 0
    step_no: int = 0
    peak_gathered: int = 0  # stage 3: most parameter bytes gathered at once (see gathered_bytes)
    _pending: list[_Pending] = field(default_factory=list)
    _shard_grad: dict[int, torch.Tensor] = field(default_factory=dict)  # id(bucket) -> (S,) fp32
    _master: dict[int, torch.Tensor] = field(default_factory=dict)  # stage 3: id(bucket) -> (S,)
    _gathered: set[int] = field(default_factory=set)  # stage 3: chunks whose params are present
    _launching: set[int] = field(default_factory=set)  # chunks whose current backward reduces
    _arrived: dict[int, set[int]] = field(default_factory=dict)  # id(bucket) -> ids of params ready
    _launched: set[int] = field(default_factory=set)  # id(bucket) reduced during this backward

    _inflight: dict[int, Any] = field(default_factory=dict)  # id(bucket) -> prefetch all-gather
    _updates: list[_Gather] = field(default_factory=list)  # stages 1-2: the step's gathers, forward order
    _holding: bool = False  # between gather_all and release_all: layer hooks neither gather nor release
    _expect: dict[int, set[int]] = field(default_factory=dict)  # layerwise: id(bucket) -> params to come
    _on_gpu: bool = field(init=False)  # NCCL collectives: waits are stream-ordered (parallel/waits.py)

    @property
    def layerwise(self) -> bool:
        return self.stage == 3 and not self.keep_gathered

    def __post_init__(self) -> None:
        if self.layerwise:  # one bucket a layer, in backward order
            self.buckets = {}
            for c, named in self.chunk_params.items():
                layers: dict[int, list[tuple[str, nn.Parameter]]] = {}
                for n, q in named:
                    layers.setdefault(layer_index(n), []).append((n, q))
                self.buckets[c] = [make_buckets(layers[i], float("inf"), self.dp, self.dp_rank)[0]
                                   for i in sorted(layers, reverse=True)]
        else:
            self.buckets = {c: make_buckets(named, self.bucket_mb, self.dp, self.dp_rank)
                            for c, named in self.chunk_params.items()}
        me = weakref.ref(self)
        tied_ids = {id(q) for q in self.tied.local} if self.tied else set()
        self._deferred = {id(b) for b in self.all_buckets() if any(id(q) in tied_ids for q in b.params)}
        for c, bs in self.buckets.items():
            for b in bs:
                if id(b) in self._deferred or any(id(q) in self.shared for q in b.params):
                    continue  # a parameter used twice accumulates twice: reduce after the backward
                for q in b.params:
                    # A weak reference: a hook stored on a tensor is invisible to the garbage
                    # collector, so a strong one would keep this object and every buffer alive
                    # after the stage is dropped (seen: +1.5 GB per rebuilt `base` stage).
                    q.register_post_accumulate_grad_hook(lambda q, b=b, c=c: me()._grad_ready(c, b, q))
        self._on_gpu = self.device.type == "cuda" or any(b.device.type == "cuda" for b in self.all_buckets())
        self.opt = ShardedAdamW(self.optim)
        for b in self.all_buckets():
            size = b.padded if self.stage == 0 else b.shard_size
            self.opt.add_shard(size, b.decay_ranges(whole=self.stage == 0), b.device)
            if self.stage == 3:
                self._master[id(b)] = b.flat[b.shard].clone()
                _release(b)

    # --- bookkeeping -------------------------------------------------------------------------
    def all_buckets(self) -> list[Bucket]:
        return [b for c in sorted(self.buckets) for b in self.buckets[c]]

    @property
    def _sharded_grads(self) -> bool:
        return self.stage >= 2

    def _wait(self, work: Any, op: str, across: str = "") -> None:
        """Wait for `work`; `across` names the ranks taking part (default: this stage's replicas)."""
        across = across or f"across {self.dp} data-parallel ranks"
        with self.tracer.span(op, "wait", "collectives"):
            wait_or_raise(work, self.timeout_s, f"rank {self.rank}, step {self.step_no}: ZeRO-{self.stage} {op} "
                                                f"{across}", stream_ordered=self._on_gpu)

    # --- executor hooks ----------------------------------------------------------------------
    def begin_step(self) -> None:
        self.step_no += 1
        for b in self.all_buckets():
            if b.grad is not None:
                b.grad.zero_()
        self._shard_grad.clear()  # allocated at the first reduction: not held through the step

    def before_forward(self, chunk: int) -> None:
        if self.stage == 3 and not self.layerwise:
            self._gather_chunk(chunk)

    def _gather_chunk(self, chunk: int) -> None:
        if chunk not in self._gathered:
            for b in self.buckets.get(chunk, []):
                self.gather(b)
            self._gathered.add(chunk)

    # --- stage 3, layer by layer (called from zero/layerwise.py hooks) -------------------------
    def gather(self, b: Bucket) -> None:
        if id(b) in self._inflight:
            self._finish_gather(self._inflight.pop(id(b)))
        elif b.flat.untyped_storage().size() == 0:
            self._gather(b, self._master[id(b)], low_precision=True)
        self._note_gathered()

    def prefetch(self, b: Bucket) -> None:
        if id(b) in self._inflight or b.flat.untyped_storage().size() != 0:
            return
        pending = self._start_gather(b, self._master[id(b)], low_precision=True)
        if pending is not None:
            self._inflight[id(b)] = pending
        self._note_gathered()

    def gathered_bytes(self) -> int:
        """Stage 3: bytes of full parameters present now (buckets whose storage is not released)."""
        return sum(b.flat.untyped_storage().nbytes() for b in self.all_buckets()) if self.stage == 3 else 0

    def _note_gathered(self) -> None:
        self.peak_gathered = max(self.peak_gathered, self.gathered_bytes())

    def release(self, b: Bucket) -> None:
        if self.layerwise and not self._holding and id(b) not in self._inflight:
            _release(b)

    def expect_grads(self, b: Bucket) -> None:
        self._expect[id(b)] = {id(q) for q in b.params}

    def _reduces_now(self, final: bool) -> bool:
        return final or (self._sharded_grads and self.grad_reduce is GradReduce.MICROBATCH)

    def before_backward(self, chunk: int, final: bool) -> None:
        self.before_forward(chunk)  # stage 3: backward needs the full weights too
        if not self._sharded_grads:
            for b in self.buckets.get(chunk, []):
                b.attach_grads()  # stages 0-1 keep full gradients: one buffer for the whole step
        if self._reduces_now(final):
            self._launching.add(chunk)
            for b in self.buckets.get(chunk, []):
                self._arrived[id(b)] = set()

    def _grad_ready(self, chunk: int, b: Bucket, q: nn.Parameter) -> None:
        """Autograd finished accumulating `q`'s gradient: launch its bucket once all have arrived."""
        if self._sharded_grads:
            b.adopt(q)
        expect = self._expect.get(id(b))
        if expect is not None:
            expect.discard(id(q))
            if not expect:  # the layer's backward is done with its weights
                del self._expect[id(b)]
                _release(b)
        if chunk not in self._launching or id(b) in self._launched:
            return
        arrived = self._arrived[id(b)]
        arrived.add(id(q))
        if len(arrived) == len(b.params):
            self._launch(b)
            if self._sharded_grads:
                self._drain(keep_last=1)  # bound the full-gradient buckets alive at once

    def after_input_grad(self, chunk: int) -> None:
        """A B ran, its weight gradients deferred to W. Layer by layer, ZeRO-3 releases the layers B
        gathered, as a fused backward does once their gradients arrive: W needs no weights when B
        stashed (x, dy) (runtime/weight_grad.py), and otherwise its backward hooks gather again."""
        if self.layerwise:
            self._release_layers(chunk)

    def _release_layers(self, chunk: int) -> None:
        """Layer by layer: nothing of `chunk` stays gathered after its backward work (B, W or BW);
        autograd.grad (B, W) never fires the post-accumulate hooks that release during a BW."""
        if self._holding:
            return
        for b in self.buckets.get(chunk, []):
            if id(b) in self._inflight:  # a prefetch still writes into the storage: let it land first
                self._finish_gather(self._inflight.pop(id(b)))
            self._expect.pop(id(b), None)
            _release(b)

    def after_backward(self, chunk: int, final: bool) -> None:
        if self.layerwise:
            self._release_layers(chunk)
        buckets = self.buckets.get(chunk, [])
        for b in buckets:
            if self._sharded_grads:
                for q in b.params:  # gradients written by W, outside autograd's accumulation
                    b.adopt(q)
            if chunk in self._launching and id(b) not in self._launched and id(b) not in self._deferred:
                self._launch(b)
        self._launching.discard(chunk)
        for b in buckets:
            self._launched.discard(id(b))
        if self._sharded_grads and self.grad_reduce is GradReduce.MICROBATCH:
            self._drain()  # the full gradient does not outlive this micro-batch's backward
        if final and self.stage == 3:
            self._drain()  # the reduce-scatters read the gradient, not the parameters; release both
            for b in buckets:
                _release(b)
            self._gathered.discard(chunk)

    def gather_all(self) -> None:
        """Full weights of every chunk, e.g. for a snapshot; undo with release_all."""
        self.settle()
        if self.stage == 3:
            for c in self.buckets:
                self._gather_chunk(c)
            self._holding = True  # rank 0 may now run forwards alone (the text sample)

    def release_all(self) -> None:
        self._holding = False
        if self.stage == 3:
            for c in list(self._gathered):
                for b in self.buckets[c]:
                    _release(b)
            self._gathered.clear()

    # --- collectives -------------------------------------------------------------------------
    def _launch(self, b: Bucket) -> None:
        self._launched.add(id(b))
        if b.grad is None:
            if not self._sharded_grads:
                return
            b.grad = torch.zeros(b.padded, device=b.device)  # no gradient reached this bucket: reduce zeros
        if self.dp_group is None:
            self._pending.append(_Pending(None, b, b.grad[b.shard] if self._sharded_grads else None))
            return
        # bf16 on the wire: the fp32 gradient is rounded once for the reduction, which sums in
        # bf16; the result lands in fp32 (shard or bucket), where micro-batches accumulate.
        wire = b.grad if self.comm_dtype == b.grad.dtype else b.grad.to(self.comm_dtype)
        size = wire.element_size()
        if self._sharded_grads:
            out = torch.empty(b.shard_size, dtype=self.comm_dtype, device=b.device)
            work = reduce_scatter(out, wire, self.dp_group)
            self.bytes_sent += b.padded * size * (self.dp - 1) // self.dp
            self._pending.append(_Pending(work, b, out))
        else:
            work = dist.all_reduce(wire, group=self.dp_group, async_op=True)
            self.bytes_sent += 2 * b.padded * size * (self.dp - 1) // self.dp
            self._pending.append(_Pending(work, b, None, None if wire is b.grad else wire))

    def _drain(self, keep_last: int = 0) -> None:
        """Wait for the launched collectives, all but the newest `keep_last`."""
        done, self._pending = (self._pending[:-keep_last], self._pending[-keep_last:]) if keep_last \
            else (self._pending, [])
        for p in done:
            if p.work is not None:
                what = "reduce-scatter of gradients" if self._sharded_grads else "all-reduce of gradients"
                self._wait(p.work, what)
            if p.back is not None:
                p.bucket.grad.copy_(p.back)  # type: ignore[union-attr]
            if p.out is not None:
                if id(p.bucket) in self._shard_grad:
                    self._shard_grad[id(p.bucket)].add_(p.out)
                elif p.out.dtype != torch.float32:
                    self._shard_grad[id(p.bucket)] = p.out.float()
                else:
                    # without a group p.out is a view of the gradient bucket about to be dropped
                    self._shard_grad[id(p.bucket)] = p.out if p.work is not None else p.out.clone()
                p.bucket.detach_grads()

    def _start_gather(self, b: Bucket, shard: torch.Tensor, low_precision: bool = False) -> _Gather | None:
        """Give the bucket its storage back and start filling it from the shards; what to finish,
        or None when there is no group (the shard is the whole bucket). `low_precision` gathers in
        `comm_dtype`: only for ZeRO-3's compute copies, whose every element (this rank's too) is
        then rounded alike, while the fp32 master shard stays exact."""
        if b.flat.untyped_storage().size() == 0:
            b.flat.untyped_storage().resize_(b.padded * b.flat.element_size())
        if self.dp_group is None:
            b.flat.copy_(shard)
            return None
        if low_precision and self.comm_dtype != b.flat.dtype:
            wire = torch.empty(b.padded, dtype=self.comm_dtype, device=b.device)
            self.bytes_sent += b.padded * wire.element_size() * (self.dp - 1) // self.dp
            work = all_gather(wire, shard.to(self.comm_dtype), self.dp_group)
            return _Gather(work, b, wire)
        self.bytes_sent += b.padded * 4 * (self.dp - 1) // self.dp
        return _Gather(all_gather(b.flat, shard.contiguous(), self.dp_group), b, None)

    def _finish_gather(self, g: _Gather) -> None:
        self._wait(g.work, "all-gather of parameters")
        if g.wire is not None:
            g.bucket.flat.copy_(g.wire)

    def _gather(self, b: Bucket, shard: torch.Tensor, low_precision: bool = False) -> None:
        pending = self._start_gather(b, shard, low_precision)
        if pending is not None:
            self._finish_gather(pending)

    # --- the optimizer step ------------------------------------------------------------------
    def _shards(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(parameter shard to update, its gradient, the slice counted once in the norm)."""
        params, grads, counted = [], [], []
        for b in self.all_buckets():
            if self.stage == 0:
                g = b.grad if b.grad is not None else torch.zeros(b.padded, device=b.device)
                params.append(b.flat)
                grads.append(g)
                counted.append(g[b.shard])
            elif self.stage == 1:
                g = b.grad[b.shard] if b.grad is not None else torch.zeros(b.shard_size, device=b.device)
                params.append(b.flat[b.shard])
                grads.append(g)
                counted.append(g)
            else:
                g = self._shard_grad.get(id(b))
                if g is None:
                    g = self._shard_grad[id(b)] = torch.zeros(b.shard_size, device=b.device)
                params.append(self._master[id(b)] if self.stage == 3 else b.flat[b.shard])
                grads.append(g)
                counted.append(g)
            head = self.tied.head if self.tied else None
            if head is not None and id(head) in b.index:  # the shared weight counts once in the norm
                i = b.index[id(head)]
                lo, hi = max(b.offsets[i], b.shard.start), min(b.offsets[i] + head.numel(), b.shard.stop)
                if lo < hi:
                    counted[-1] = counted[-1].clone()
                    counted[-1][lo - b.shard.start:hi - b.shard.start] = 0
        return params, grads, counted

    def step(self, lr: float, max_norm: float, norm_group: Any, loss: torch.Tensor | float = 0.0) -> StepOutcome:
        """Finish the reductions, clip by the global norm over every shard of every stage, update
        this rank's shards, and make full parameters available again (stages 1 and 2).

        `loss` is this rank's share of the step's loss; it is summed with the norm in one
        all-reduce, so every rank sees the same loss and norm and skips a non-finite step together
        (no loss scaling in fp32/bf16 to absorb it): parameters and AdamW state stay as they were.
        Reading those two numbers is the step's one wait for the device.
        """
        if self.tied is not None:  # tied copies first: their buckets were held back for this
            self.tied.sum_grads(self.timeout_s, f"rank {self.rank}, step {self.step_no}: sum of tied embedding "
                                                f"gradients between the first and last pipeline rank")
            for b in self.all_buckets():
                if id(b) in self._deferred:
                    if self._sharded_grads:
                        for q in b.params:
                            b.adopt(q)
                    self._launch(b)
        self._drain()
        params, grads, counted = self._shards()
        device = params[0].device if params else self.device  # frozen or empty chunks: no parameters
        # Accumulated in fp64 (fp32 partial norms differ between layouts by enough that the clipped,
        # Adam-amplified updates drift apart by 1e-5), cast inside the reduction: no fp64 copy.
        local = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in counted]).pow(2).sum() if counted \
            else torch.zeros((), dtype=torch.float64, device=device)
        total = torch.stack([local, torch.as_tensor(loss, dtype=torch.float64, device=device)])
        if norm_group is not None:
            work = dist.all_reduce(total, group=norm_group, async_op=True)
            # the world group: every stage's norm and loss, not only this stage's replicas
            self._wait(work, "all-reduce of the gradient norm and loss",
                       f"across all {dist.get_world_size(norm_group)} ranks")
        norm_sq, loss_sum, local_sq = torch.cat([total, local.view(1)]).tolist()  # one read from the device
        norm = math.sqrt(norm_sq)  # a sum of squares: never negative; nan and inf pass through
        outcome = StepOutcome(norm, loss_sum, math.isfinite(norm) and math.isfinite(loss_sum), math.isfinite(local_sq))
        if not outcome.applied:
            return outcome
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0 and grads:  # a rank whose chunks hold no parameters has none
                torch._foreach_mul_(grads, coef)
        with self.tracer.span("optimizer", "optim"):
            self.opt.step(params, grads, lr)
        if self.stage in (1, 2):
            # Started now, waited for by the first forward that reads each bucket (settle): the
            # gathers overlap the next step's first layers. Issued in forward order (buckets are
            # in backward order within a chunk), so the first layers' weights come first.
            for c in sorted(self.buckets):
                for b in reversed(self.buckets[c]):
                    if (g := self._start_gather(b, b.flat[b.shard].clone())) is not None:
                        self._updates.append(g)
            if not self.defer_gathers:
                self.settle()
        return outcome

    def settle(self, b: Bucket | None = None) -> None:
        """Wait for the updated parameters (stages 1-2) of bucket `b` and those gathered before it,
        or of every bucket: whatever reads full parameters between steps calls this first."""
        if b is not None and all(g.bucket is not b for g in self._updates):
            return
        while self._updates:
            g = self._updates.pop(0)
            self._finish_gather(g)
            if g.bucket is b:
                return

    # --- checkpoints -------------------------------------------------------------------------
    def shard_state(self) -> list[tuple[Bucket, dict[str, torch.Tensor]]]:
        """Per bucket, this rank's slice [shard] of what a checkpoint holds: fp32 parameters and
        AdamW's two moments, each (shard_size,). They are views, so loading into them restores the
        state in place; every stage answers with the same slices, which is what lets a checkpoint
        written at one ZeRO stage load at another."""
        self.settle()  # a step's gathers write the full buffers these slices live in
        out = []
        for b, st in zip(self.all_buckets(), self.opt.states):
            param = self._master[id(b)] if self.stage == 3 else b.flat[b.shard]
            moments = (st.exp_avg[b.shard], st.exp_avg_sq[b.shard]) if self.stage == 0 \
                else (st.exp_avg, st.exp_avg_sq)
            out.append((b, {"model": param, "optim.exp_avg": moments[0], "optim.exp_avg_sq": moments[1]}))
        return out

    def restore_replicas(self, adam_steps: int) -> None:
        """After loading the shards: rebuild what this stage keeps whole on every rank (parameters
        below stage 3, AdamW moments at stage 0) from the shards of the other dp ranks."""
        self.opt.step_count = adam_steps
        if self.stage == 3:
            return
        for b, st in zip(self.all_buckets(), self.opt.states):
            self._gather(b, b.flat[b.shard].clone())
            if self.stage == 0 and self.dp_group is not None:
                for full in (st.exp_avg, st.exp_avg_sq):
                    work = all_gather(full, full[b.shard].clone(), self.dp_group)
                    self._wait(work, "all-gather of restored optimizer state")

    # --- accounting --------------------------------------------------------------------------
    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps for parameters, gradients and optimizer state."""
        bs = self.all_buckets()
        params = sum((b.shard_size if self.stage == 3 else b.padded) * 4 for b in bs)
        if self.stage >= 2:
            grads = sum(b.shard_size * 4 for b in bs)
        else:
            grads = sum(b.padded * 4 for b in bs)
        # stage 1-2 masters are views of the parameters; stage 3's master is the parameter shard
        return {"params": params, "grads": grads, "optimizer": self.opt.state_bytes()}


def _release(b: Bucket) -> None:
    b.flat.untyped_storage().resize_(0)


def shared_params(chunks: dict[int, nn.Module]) -> set[int]:
    ids: list[int] = [id(p) for m in chunks.values() for _, p in m.named_parameters(remove_duplicate=False)]
    return {i for i in ids if ids.count(i) > 1}


def named_by_chunk(chunks: dict[int, nn.Module]) -> dict[int, list[tuple[str, nn.Parameter]]]:
    """Each chunk's trainable parameters, a tied parameter listed once."""
    seen: set[int] = set()
    out: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for c, m in sorted(chunks.items()):
        out[c] = []
        for n, p in m.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out[c].append((n, p))
    return out

