"""The collectives of one pipeline stage's data-parallel group: start them, keep them in order, wait.

ZeRO's collective actions are of three kinds: a bucket's gradient reduction (all-reduce, or
reduce-scatter when gradients are sharded), a bucket's all-gather of parameter shards, and the
step's all-reduce of the gradient norm and loss over the world. This object starts them (async),
records each on its bucket, and waits for them oldest first, every wait bounded by the timeout and
named by rank, step and the program instruction that started it (`REDUCE_GRAD(1.0): reduce-scatter
of gradients`, on the trace's collectives row too): a replica that stopped answering is an error,
not a hang. It
decides nothing about *when*; zero/sharded.py (the executor's hooks) and the optimizer step say that.
"""

from __future__ import annotations

from functools import partial
from dataclasses import dataclass, field
from typing import Any

import torch

from pipezero.parallel.hierarchical import (Hierarchy, start_all_reduce, start_exchange, start_gather_exchange,
                                           start_reduce_scatter)
from pipezero.parallel.staging import Direct, Transport
from pipezero.parallel.waits import wait_or_raise
from pipezero.runtime.flight import FlightRecord
from pipezero.schedules.played import PlayEvent, Played
from pipezero.schedules.zero_rules import Rules
from pipezero.telemetry.trace import Tracer
from pipezero.zero import compressed
from pipezero.zero.buckets import Bucket, Gathering, Reduction
from pipezero.zero.compressed import Wire


@dataclass
class Coordinator:
    rules: Rules
    dp: int
    group: Any  # None when dp == 1: every collective is a local copy
    timeout_s: float
    rank: int
    tracer: Tracer
    comm_dtype: torch.dtype  # bf16 halves gradient and ZeRO-3 parameter traffic
    on_gpu: bool  # NCCL collectives: waits are stream-ordered (parallel/waits.py)
    hierarchy: Hierarchy | None = None  # --hierarchical: gradient reductions inside the node, then across
    weights: Wire | None = None  # --quantize-weights: gathers of parameters travel blockwise-quantized
    grads: Wire | None = None  # --quantize-grads: gradient reductions travel blockwise-quantized
    node: Hierarchy | None = None  # --secondary-shard node: this rank's node (its own subgroups) for ZeRO-3
    generation: int = 0  # version of the master shards: a secondary share cut from an older one is stale
    bytes_sent: int = 0  # as the wire carries them: quantized messages count their codes and scales
    reducing: list[Bucket] = field(default_factory=list)  # reductions in flight, oldest first
    updating: list[Bucket] = field(default_factory=list)  # stages 1-2: the step's gathers, forward order
    flight: FlightRecord = field(default_factory=lambda: FlightRecord(-1, -1))  # where the rank is (doctor.py)
    # What this rank played of its program's collectives since the step began, in order: each start,
    # each wait (a reduction's, a gather's) and each release, one a bucket, named as the program names it. Cleared by `new_step`;
    # tests/training.py holds every step's against the program (schedules/played.py `expected`).
    played: list[Played] = field(default_factory=list)
    # The instruction being played, as the record names a wait's place (played.py `Played.place`):
    # `#i`, or `#i@moment` inside compute instruction i; "" outside every instruction of a program
    place: str = ""
    # How tensors travel (parallel/staging.py): through host buffers where ranks share a GPU; None:
    # straight to torch.distributed
    transport: Transport | None = None

    def __post_init__(self) -> None:
        if self.transport is None:
            self.transport = Direct(torch.device("cuda" if self.on_gpu else "cpu"))

    def new_step(self) -> None:
        """A step's record begins: with the waits readers outside the programs made since the last
        program (a checkpoint's, say), which the record holds to the gathers that program left."""
        self.played[:] = self.played[outside_since(self.played):]

    @property
    def issued(self) -> list[str]:
        """The collectives started since the step began, by name, in order."""
        return [p.name for p in self.played if p.event is PlayEvent.START]

    def note_start(self, name: str, nbytes: int, wire: str, group: str = "dp", placed: bool = False) -> None:
        """A collective started; `placed`: with the instruction under way (`place`), for a start
        only one instruction may make (OPTIM_STEP's all-reduce: the step's own, never the engine's)."""
        self.played.append(Played(PlayEvent.START, name, nbytes, group, wire, self.tracer.step,
                                  self.place if placed else ""))

    def note_wait(self, b: Bucket, idle: bool = False) -> None:
        """A wait for bucket `b`'s gather, at the instruction under way (`place`); `idle`: it found
        nothing in flight."""
        self.played.append(Played(PlayEvent.WAIT, f"UNSHARD({b.label})", step=self.tracer.step, place=self.place,
                                  idle=idle))

    def note_release(self, b: Bucket) -> None:
        self.played.append(Played(PlayEvent.RELEASE, f"RESHARD({b.label})", step=self.tracer.step))

    def wait(self, work: Any, op: str, across: str = "") -> None:
        """Wait for `work`; `across` names the ranks taking part (default: this stage's replicas)."""
        across = across or f"across {self.dp} data-parallel ranks"
        with self.tracer.span(op, "wait", "collectives"), self.flight.awaiting(op, **awaited_of(op)):
            wait_or_raise(work, self.timeout_s, f"rank {self.rank}, step {self.tracer.step}: ZeRO-{self.rules.stage} "
                                                f"{op} {across}", stream_ordered=self.transport.stream_ordered)

    # --- gradient reductions -----------------------------------------------------------------
    def reduce(self, b: Bucket) -> None:
        """Start reducing `b`'s gradient (zeros when no gradient reached a sharded bucket): a
        reduce-scatter wherever a rank updates only its shard (ZeRO-1 too, whose summed shard is then
        copied into its full bucket), else an all-reduce."""
        sharded, to_shard = self.rules.sharded_grads, self.rules.reduces_to_shard
        if b.grad is None:
            if not sharded:  # stages 0-1 attach a whole-step gradient buffer before any backward
                raise RuntimeError(f"rank {self.rank}, step {self.tracer.step}: REDUCE_GRAD({b.label}) before any "
                                   f"backward of its chunk: the program reduces a bucket that holds no gradient")
            b.grad = torch.zeros(b.padded, device=b.device)
        if b.reduction is not None:
            raise RuntimeError(f"rank {self.rank}: bucket {b.names[0]}... reduced twice in one backward")
        w = self.grads
        self.note_start(f"REDUCE_GRAD({b.label})", w.bytes(b.padded) if w else b.padded * self.comm_dtype.itemsize,
                        f"int{int(w.bits)}" if w else _name(self.comm_dtype))
        self.reducing.append(b)
        if self.group is None:
            b.reduction = Reduction(None, b.grad[b.shard] if sharded else None)
            return
        if self.grads is not None:
            self._reduce_quantized(b)
            return
        # bf16 on the wire: the fp32 gradient is rounded once for the reduction, which sums in
        # bf16; the result lands in fp32 (shard or bucket), where micro-batches accumulate.
        wire = b.grad if self.comm_dtype == b.grad.dtype else b.grad.to(self.comm_dtype)
        nbytes, h, t = b.padded * wire.element_size(), self.hierarchy, self.transport
        if to_shard:
            out = torch.empty(b.shard_size, dtype=self.comm_dtype, device=b.device)
            # gloo's reduce-scatter is an all-reduce and a copy (an all-reduce's bytes): on CPU ranks
            # each rank sends every other its slice instead, (D - 1) / D of the bucket, and sums what
            # it received (0.74x of gloo's time at D=2 and 0.45x at D=4 on 25 MB, loopback, measured)
            work = start_reduce_scatter(out, wire, h) if h else t.reduce_scatter(out, wire, self.group) \
                if t.native else start_exchange(out, wire, self.group, t)
            self.bytes_sent += h.bytes_sent(nbytes, False) if h else nbytes * (self.dp - 1) // self.dp
            b.reduction = Reduction(work, out)
        else:
            work = start_all_reduce(wire, h) if h else t.all_reduce(wire, self.group)
            self.bytes_sent += h.bytes_sent(nbytes, True) if h else 2 * nbytes * (self.dp - 1) // self.dp
            b.reduction = Reduction(work, None, None if wire is b.grad else wire)

    def _reduce_quantized(self, b: Bucket) -> None:
        """qgZ (zero/compressed.py): the fp32 gradient quantized blockwise, exchanged, summed in fp32;
        at ZeRO-0, where every rank updates whole buckets, the summed slices are gathered back,
        quantized again."""
        w, h, grad, t = self.grads, self.hierarchy, b.grad, self.transport
        assert w is not None and grad is not None and t is not None
        what = f"rank {self.rank}: gradient bucket {b.label} ({b.names[0]}, ...)"
        if self.rules.reduces_to_shard:
            out = torch.empty(b.shard_size, device=b.device)
            work = compressed.start_reduce_scatter_two_level(out, grad, h, w, what) if h \
                else compressed.start_reduce_scatter(out, grad, self.group, w, what, t)
            self.bytes_sent += compressed.bytes_reduce_scatter(w, b.padded, self.dp, h)
            b.reduction = Reduction(work, out)
        else:
            work = compressed.start_all_reduce_two_level(grad, h, w, what) if h \
                else compressed.start_all_reduce(grad, self.group, w, what, t)
            self.bytes_sent += compressed.bytes_all_reduce(w, b.padded, self.dp, h)
            b.reduction = Reduction(work, None)

    def drain(self, keep_last: int = 0) -> None:
        """Wait for the reductions in flight, all but the newest `keep_last`; a sharded result is
        added into the bucket's fp32 gradient shard and the full gradient dropped (ZeRO-1's lands in
        its shard of the full bucket, kept for the step)."""
        done, self.reducing = (self.reducing[:-keep_last], self.reducing[-keep_last:]) if keep_last \
            else (self.reducing, [])
        for b in done:
            r, b.reduction = b.reduction, None
            assert r is not None
            self.played.append(Played(PlayEvent.WAIT, f"REDUCE_GRAD({b.label})", step=self.tracer.step,
                                      place=self.place))
            if r.work is not None:
                self.wait(r.work, f"REDUCE_GRAD({b.label}): {self.rules.reduction}")
            if r.back is not None:
                b.grad.copy_(r.back)  # type: ignore[union-attr]
            if r.out is not None and not self.rules.sharded_grads:  # ZeRO-1: its summed shard, in place
                b.grad[b.shard].copy_(r.out)  # type: ignore[index]
            elif r.out is not None:
                if b.shard_grad is not None:
                    b.shard_grad.add_(r.out)
                elif r.out.dtype != torch.float32:
                    b.shard_grad = r.out.float()
                else:
                    # without a group r.out is a view of the gradient bucket about to be dropped
                    b.shard_grad = r.out if r.work is not None else r.out.clone()
                b.detach_grads()

    # --- parameter gathers -------------------------------------------------------------------
    def start_gather(self, b: Bucket, shard: torch.Tensor, low_precision: bool = False, keep_own: bool = False,
                     from_node: bool = False) -> None:
        """Give the bucket its storage back and start filling it from the shards (`b.gathering`);
        without a group the shard is the whole bucket and is copied at once. `low_precision`
        gathers in `comm_dtype`, or quantized with --quantize-weights: only for ZeRO-3's compute
        copies, whose every element (this rank's too) is then rounded alike, while the fp32 master
        shard stays exact. `keep_own` (ZeRO-1/2's updated weights, whose own shard of `flat` is the
        master) quantizes with --quantize-weights but leaves this rank's own shard exact. `from_node`
        (hpZ, where the program says so): from the fp32 shares this rank's node kept of the bucket's
        first gather of the step, nothing across nodes."""
        b.restore()
        if from_node:
            if self.node is None or b.secondary_of != self.generation:
                raise RuntimeError(f"rank {self.rank}, step {self.tracer.step}: UNSHARD({b.label}, node) before any "
                                   f"gather across the nodes left this node its shares of the current weights")
            self.note_start(f"UNSHARD({b.label})", b.padded * 4, "fp32", "node")
            self._start_node_gather(b)
            return
        quantized = self.weights is not None and (low_precision or keep_own)
        wire = self.comm_dtype if low_precision else torch.float32
        self.note_start(f"UNSHARD({b.label})",
                        self.weights.bytes(b.padded) if quantized else b.padded * wire.itemsize,  # type: ignore[union-attr]
                        f"int{int(self.weights.bits)}" if quantized else _name(wire))  # type: ignore[union-attr]
        if self.group is None:
            b.flat.copy_(shard)
            b.gathering = Gathering(None, None)  # nothing to wait for, but a wait the program places
            return
        self._start_gather(b, shard, low_precision, keep_own)
        if low_precision and self.node is not None:  # hpZ: keep this node's share of what lands
            b.gathering.refresh = self.generation  # type: ignore[union-attr]

    def _start_gather(self, b: Bucket, shard: torch.Tensor, low_precision: bool, keep_own: bool) -> None:
        if self.weights is not None and (low_precision or keep_own):
            self.bytes_sent += compressed.bytes_gather(self.weights, b.shard_size, self.dp)
            what = f"rank {self.rank}: parameter bucket {b.label} ({b.names[0]}, ...)"
            work = compressed.start_gather(b.flat, shard, self.group, self.weights, what, b.shard if keep_own else None,
                                           transport=self.transport)
            b.gathering = Gathering(work, None)
            return
        # CPU ranks gather by direct exchange: gloo's all-gather would hold a copy of the whole
        # bucket while it runs (parallel/hierarchical.start_gather_exchange)
        t = self.transport
        gather = t.all_gather if t.native else partial(start_gather_exchange, transport=t)
        if low_precision and self.comm_dtype != b.flat.dtype:
            wire = torch.empty(b.padded, dtype=self.comm_dtype, device=b.device)
            self.bytes_sent += b.padded * wire.element_size() * (self.dp - 1) // self.dp
            b.gathering = Gathering(gather(wire, shard.to(self.comm_dtype), self.group), wire)
            return
        self.bytes_sent += b.padded * 4 * (self.dp - 1) // self.dp
        b.gathering = Gathering(gather(b.flat, shard.contiguous(), self.group), None)

    def _start_node_gather(self, b: Bucket) -> None:
        """hpZ: the bucket from its N shares in this rank's node, fp32, as the step's first gather
        left them (so every replica still computes with the same values): nothing crosses nodes."""
        h = self.node
        assert h is not None and b.secondary is not None
        self.bytes_sent += (h.per_node - 1) * b.secondary.numel() * 4
        b.gathering = Gathering(self.transport.all_gather(b.flat, b.secondary, h.intra), None)

    def finish_gather(self, b: Bucket) -> None:
        g, b.gathering = b.gathering, None
        if g is None:  # every caller waits only for a gather it started (sharded.py `_wait` names the instruction)
            raise RuntimeError(f"rank {self.rank}, step {self.tracer.step}: a wait for bucket {b.label}'s gather, none "
                               f"of which is in flight")
        self.note_wait(b)
        if g.work is not None:
            self.wait(g.work, f"UNSHARD({b.label}): all-gather of parameters")
        if g.wire is not None:
            b.flat.copy_(g.wire)
        if g.refresh >= 0:  # hpZ: keep this rank's share of its node's copy for the step's later gathers
            h = self.node
            assert h is not None
            part = b.padded // h.per_node
            if b.secondary is None:
                b.secondary = torch.empty(part, device=b.device)
            b.secondary.copy_(b.flat[h.local * part:(h.local + 1) * part])
            b.secondary_of = g.refresh  # the masters it was gathered from, even if a step came since

    def gather(self, b: Bucket, shard: torch.Tensor, low_precision: bool = False, from_node: bool = False) -> None:
        self.start_gather(b, shard, low_precision, from_node=from_node)
        self.finish_gather(b)

    def start_updates(self, buckets: list[Bucket]) -> None:
        """Stages 1-2, after the step: start gathering every bucket's updated shard, in the order
        given (forward order: the first layers' weights come first). `settle` waits for them.
        In place: each bucket sends its own shard of `flat`, which nothing writes before `settle`.
        A copy of the shard would be alive for every bucket until its gather is waited for, 4/D
        bytes a parameter (it halved ZeRO-1's saving at D=2; tests/test_zero_memory.py)."""
        for b in buckets:
            self.start_gather(b, b.flat[b.shard], keep_own=True)
            if b.gathering is not None:
                self.updating.append(b)

    def wait_update(self, b: Bucket) -> None:
        """A program's WAIT for bucket `b`'s updated parameters (stages 1-2): its gather, if one is
        in flight (none on the first step, after a skipped one, or where something outside a program
        settled it); the wait is in the record either way, where the program placed it."""
        if b in self.updating:
            self.updating.remove(b)
            self.finish_gather(b)
        else:
            self.note_wait(b, idle=True)

    def settle(self, reader: str = "") -> None:
        """Wait for every gather of updated parameters in flight (stages 1-2): a program's blocking
        UNSHARD, or `reader` outside every program (played.py OUTSIDE_READERS: a checkpoint, the end
        of the run), its waits recorded as that reader's."""
        place = self.place
        if reader:
            self.place = f"outside: {reader}"
        try:
            while self.updating:
                self.finish_gather(self.updating.pop(0))
        finally:
            self.place = place


def outside_since(played: list[Played]) -> int:
    """Where the waits of readers outside every program begin at the end of `played` (its length: none)."""
    k = len(played)
    while k and played[k - 1].place.startswith("outside"):
        k -= 1
    return k


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def awaited_of(op: str) -> dict[str, object]:
    """The program instruction a wait's `op` names, as the flight record keeps it: `REDUCE_GRAD(1.0):
    ...` is chunk 1's bucket 0; `OPTIM_STEP: ...` the step's all-reduce over the world."""
    head = op.split(":", 1)[0]
    name, _, where = head.partition("(")
    if name == "OPTIM_STEP":
        return {"op": name}
    if name in ("REDUCE_GRAD", "UNSHARD") and where.endswith(")"):
        chunk, _, bucket = where[:-1].partition(".")
        if chunk.isdigit():
            return {"op": name, "chunk": int(chunk), "bucket": int(bucket) if bucket.isdigit() else None}
    return {"op": "other"}
