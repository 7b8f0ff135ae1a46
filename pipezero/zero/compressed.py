"""ZeRO's collectives with blockwise-quantized payloads (ZeRO++'s qwZ and qgZ), on any process group.

Each payload travels as one uint8 message a destination (zero/quantize.py: codes then scales), so
a collective moves bytes, never fp32:

- gather (qwZ): every rank encodes its shard once; an all-gather of the messages; every rank
  decodes all D of them, its own too, so where the caller wants it every replica holds the same
  rounded weights.
- reduce-scatter (qgZ): each rank encodes the D slices of its full gradient separately and sends
  slice j to rank j (all_to_all_single); rank j decodes the D messages it got and sums them in fp32.
  (D - 1) messages of S / D elements leave a rank, where gloo's reduce-scatter sends an all-reduce's
  worth of fp32. Two-level (`Hierarchy`): the same exchange inside the node over N pieces of K x S/W,
  then across nodes over K pieces of S/W, each level decoded and summed in fp32 before the next is
  encoded (ZeRO++'s order: the slow link carries one message a node's sum, not one a rank).
- all-reduce (ZeRO-0 with quantized gradients): the reduce-scatter, then each rank encodes its
  summed slice and the messages are all-gathered; every rank decodes the same bytes, so replicas keep
  identical gradients. Two quantizations: each slice's error is its summands' plus one more bound.

`bytes_*` say what a rank sends, the formula Coordinator.bytes_sent adds and tests compare with.
Works are waited for like torch's (`wait(timeout=...)`), so parallel/waits.py bounds them and names
the operation; the decode and sum happen inside the wait, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipezero.parallel.hierarchical import ExchangeWork, HierarchicalWork, Hierarchy, start_on
from pipezero.parallel.staging import DIRECT, Transport
from pipezero.zero.quantize import Bits, decode_many, encode, message_bytes


@dataclass(frozen=True)
class Wire:
    """How one kind of traffic is quantized: int8 or int4 codes, one fp32 scale a `block` elements."""

    bits: Bits
    block: int

    def bytes(self, numel: int) -> int:
        return message_bytes(numel, self.bits, self.block)

    def encode_parts(self, full: torch.Tensor, parts: int, what: str, nonfinite_ok: bool) -> torch.Tensor:
        """`parts` equal slices of `full`, each its own message, end to end."""
        return torch.cat([encode(p, self.bits, self.block, what, nonfinite_ok) for p in full.view(parts, -1)])

    def decode_parts(self, msgs: torch.Tensor, parts: int, numel: int) -> torch.Tensor:
        return decode_many(msgs, parts, numel, self.bits, self.block)


# --- bytes a rank sends ------------------------------------------------------------------------
def bytes_gather(wire: Wire, shard: int, d: int) -> int:
    """An all-gather of D shards of `shard` elements: this rank's message to each of D - 1 peers."""
    return (d - 1) * wire.bytes(shard)


def bytes_reduce_scatter(wire: Wire, padded: int, d: int, h: Hierarchy | None = None) -> int:
    """A quantized reduce-scatter of `padded` elements over D ranks (flat, or two-level over K x N)."""
    if h is None:
        return (d - 1) * wire.bytes(padded // d)
    k, n = h.nodes, h.per_node
    return (n - 1) * wire.bytes(padded // n) + (k - 1) * wire.bytes(padded // (k * n))


def bytes_all_reduce(wire: Wire, padded: int, d: int, h: Hierarchy | None = None) -> int:
    """The reduce-scatter, then the all-gather of each rank's summed slice (across nodes, then inside)."""
    s = padded // d
    gather = bytes_gather(wire, s, d) if h is None else \
        (h.nodes - 1) * wire.bytes(s) + (h.per_node - 1) * h.nodes * wire.bytes(s)
    return bytes_reduce_scatter(wire, padded, d, h) + gather


# --- works -------------------------------------------------------------------------------------
class GatherWork:
    """A started quantized all-gather: `wait` decodes every message into `out` (D x S fp32), keeping
    this rank's own slice as it was when `keep` is given (ZeRO-1/2: the own shard is the master)."""

    def __init__(self, work: Any, got: torch.Tensor, out: torch.Tensor, parts: int, wire: Wire,
                 keep: slice | None) -> None:
        self._work, self._got, self._out, self._parts, self._wire, self._keep = work, got, out, parts, wire, keep
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout=timeout)
        if not self._done:
            s = self._out.numel() // self._parts
            vals = self._wire.decode_parts(self._got, self._parts, s).view(-1)
            if self._keep is None:
                self._out.copy_(vals)
            else:
                self._out[:self._keep.start].copy_(vals[:self._keep.start])
                self._out[self._keep.stop:].copy_(vals[self._keep.stop:])
            self._done = True
        return ok


def start_gather(out: torch.Tensor, shard: torch.Tensor, group: Any, wire: Wire, what: str,
                 keep: slice | None = None, nonfinite_ok: bool = False, transport: Transport = DIRECT) -> GatherWork:
    """Start filling `out` (D x S) with every rank's quantized `shard` (S,), decoded on `wait`."""
    parts = dist.get_world_size(group)
    msg = encode(shard, wire.bits, wire.block, what, nonfinite_ok)
    got = torch.empty(parts * msg.numel(), dtype=torch.uint8, device=shard.device)
    return GatherWork(transport.all_gather(got, msg, group), got, out, parts, wire, keep)


def start_reduce_scatter(out: torch.Tensor, full: torch.Tensor, group: Any, wire: Wire, what: str,
                         transport: Transport = DIRECT) -> ExchangeWork:
    """Start summing `full` (D x S) over `group`, this rank keeping slice `rank` in `out` (S,) fp32:
    the messages travel by one all-to-all; the wait decodes the D received and sums them in fp32,
    once (hierarchical.ExchangeWork, as the unquantized exchange)."""
    parts = dist.get_world_size(group)
    msgs = wire.encode_parts(full, parts, what, nonfinite_ok=True)
    got = torch.empty_like(msgs)

    def finish() -> None:
        torch.sum(wire.decode_parts(got, parts, out.numel()), 0, out=out)

    return ExchangeWork([transport.all_to_all(got, msgs, group)], finish)


class AllReduceWork:
    """A quantized all-reduce over a flat group: its reduce-scatter is in flight; `wait` sums it,
    then encodes this rank's slice, all-gathers the messages and decodes them all into `t`."""

    def __init__(self, first: ExchangeWork, slice_: torch.Tensor, t: torch.Tensor, group: Any, wire: Wire,
                 what: str, transport: Transport) -> None:
        self._first, self._slice, self._t, self._group, self._wire, self._what = first, slice_, t, group, wire, what
        self._transport = transport
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        self._first.wait(timeout)
        second = start_gather(self._t, self._slice, self._group, self._wire, self._what, nonfinite_ok=True,
                              transport=self._transport)
        ok = second.wait(timeout)
        self._done = True
        return ok


def start_all_reduce(t: torch.Tensor, group: Any, wire: Wire, what: str,
                     transport: Transport = DIRECT) -> AllReduceWork:
    """Start summing `t` (D x S, fp32) over `group` in place, every rank ending with the same values."""
    parts = dist.get_world_size(group)
    piece = torch.empty(t.numel() // parts, dtype=torch.float32, device=t.device)
    return AllReduceWork(start_reduce_scatter(piece, t, group, wire, what, transport), piece, t, group, wire, what,
                         transport)


# --- two levels, on the hierarchy's own thread ---------------------------------------------------
def _exchange(full: torch.Tensor, parts: int, group: Any, wire: Wire, what: str) -> torch.Tensor:
    """The quantized reduce-scatter waited for; `full` itself, unquantized, without a group."""
    if group is None:
        return full
    out = torch.empty(full.numel() // parts, dtype=torch.float32, device=full.device)
    start_reduce_scatter(out, full, group, wire, what).wait()
    return out


def reduce_scatter_two_level(out: torch.Tensor, full: torch.Tensor, h: Hierarchy, wire: Wire, what: str) -> None:
    """`out` = slice `group position` of the sum of `full` over the group, as the flat exchange
    leaves it (parallel/hierarchical.py's layout): inside the node first, then across."""
    k, n, s = h.nodes, h.per_node, out.numel()
    by_local = full.view(k, n, s).transpose(0, 1).contiguous().view(-1)  # (N, K, s): local l's piece first
    piece = _exchange(by_local, n, h.intra, wire, what + " inside the node")
    out.copy_(_exchange(piece, k, h.inter, wire, what + " across nodes"))


def _gather_messages(msg: torch.Tensor, group: Any) -> torch.Tensor:
    if group is None:
        return msg
    got = torch.empty(dist.get_world_size(group) * msg.numel(), dtype=torch.uint8, device=msg.device)
    dist.all_gather_into_tensor(got, msg, group=group)
    return got


def all_reduce_two_level(t: torch.Tensor, h: Hierarchy, wire: Wire, what: str) -> None:
    """Sum `t` in place: the two-level quantized reduce-scatter, then this rank's slice encoded once
    and its messages gathered across nodes and inside the node; all W decoded alike everywhere."""
    k, n = h.nodes, h.per_node
    s = t.numel() // (k * n)
    piece = torch.empty(s, dtype=torch.float32, device=t.device)
    reduce_scatter_two_level(piece, t, h, wire, what)
    # K messages: n x N + l
    across = _gather_messages(encode(piece, wire.bits, wire.block, what, nonfinite_ok=True), h.inter)
    every = _gather_messages(across, h.intra)  # (N, K) messages: local l's K first
    per = wire.bytes(s)
    in_order = every.view(n, k, per).transpose(0, 1).reshape(-1)  # (K, N): group position n x N + l
    t.copy_(wire.decode_parts(in_order, k * n, s).view(-1))


def start_reduce_scatter_two_level(out: torch.Tensor, full: torch.Tensor, h: Hierarchy, wire: Wire,
                                   what: str) -> HierarchicalWork:
    return start_on(h, reduce_scatter_two_level, out, full, h, wire, what)


def start_all_reduce_two_level(t: torch.Tensor, h: Hierarchy, wire: Wire, what: str) -> HierarchicalWork:
    return start_on(h, all_reduce_two_level, t, h, wire, what)


