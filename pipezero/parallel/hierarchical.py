"""Two-level (node, then across nodes) all-reduce and reduce-scatter over torch.distributed subgroups.

Why: a flat ring over K nodes x N ranks crosses each node's uplink with the bytes of every rank of
that node. gloo's ring all-reduce of S bytes sends 2 (W - 1) / W x S a rank and its reduce-scatter
is an all-reduce followed by a copy (the same bytes), so with W = K x N ranks in node order a node's
uplink carries 2 (W - 1) / W x S: 1.5 S at 2 x 2. Reducing inside the node first leaves each rank a
1/N piece to exchange with its peers of the same local rank on the other nodes, so the uplink carries
N x 2 (K - 1) / K x S / N = 2 (K - 1) / K x S (S at K = 2: 1.5x fewer bytes) for an all-reduce, and
(K - 1) / K x S for a reduce-scatter done as a direct exchange (S / 2: 3x fewer than gloo's). The
intra-node steps move N times more bytes than that across memory, which costs CPU time.

When it pays: N > 1 ranks of one group share a node whose uplink is the bottleneck (the bytes cut
is (W - 1) / W against (K - 1) / K of a flat ring, gone when N = 1 or when every rank of the group
is on one node), and the intra-node traffic is cheap beside the link (memory or NVLink against a
slow network). Measured by bench/cluster_hierarchical.py on 2 emulated nodes x 2 ranks, buckets of
1-25 MiB: the all-reduce 1.43-1.53x faster than gloo's flat ring at 100mbit and 1.10-1.52x at
500mbit, the reduce-scatter 1.1-3.0x faster than gloo's; with no shaped link between the ranks, up
to 3x slower (three collectives and their copies on the same cores). Nor does it pay where placement
already keeps the group inside one node (`--placement dp-inner` with D <= ranks a node). At N = 1
the exchange alone still halves gloo's reduce-scatter bytes (measured 2.0x faster at D=2, 100mbit).

Reduce-scatter keeps the flat collective's output: group position j = n x N + l (node n, local rank
l) ends with slice j of W. Each level's reduce-scatter is a direct exchange (each member sends every
other its slice, then sums the K or N pieces), which sends (G - 1) / G of the buffer a rank, where
gloo's `reduce_scatter_tensor` sends a whole all-reduce's worth.

Ranks of one node are those torchrun puts there: global rank g is on node g // ranks_per_node.
Every rank of the world calls `build_hierarchy` with the same groups (it creates process groups),
and each group must have the same number of members on each of its nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from pipezero.parallel.staging import DIRECT, Transport


@dataclass
class Hierarchy:
    """One rank's view of a group split into K nodes of N members: the two subgroups it belongs to."""

    nodes: int  # K
    per_node: int  # N
    node: int  # this rank's node, 0..K-1, in group order
    local: int  # this rank's place in its node, 0..N-1
    intra: Any  # the N members of this node (None when N == 1)
    inter: Any  # the K members of other nodes with the same local place (None when K == 1)
    # Collectives run one after another on this rank's own thread, so `start_*` can return at once
    # while the three levels follow each other, and every member issues them in the same order.
    _pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "pz-hier"), repr=False)

    @property
    def size(self) -> int:
        return self.nodes * self.per_node

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def bytes_sent(self, nbytes: int, all_reduce: bool) -> int:
        """Bytes this rank sends reducing `nbytes`: the node's exchange ((N - 1) / N of the buffer),
        then its 1/N piece across nodes (an exchange, or a ring all-reduce), then for an all-reduce
        the node's all-gather of the pieces."""
        k, n = self.nodes, self.per_node
        inside = nbytes * (n - 1) // n
        across = nbytes // n * (2 if all_reduce else 1) * (k - 1) // k
        return inside + across + (inside if all_reduce else 0)


def split_by_node(ranks: Sequence[int], ranks_per_node: int) -> list[list[int]]:
    """The group's members on each node it touches, nodes in order (global rank g is on node
    g // ranks_per_node)."""
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        by_node.setdefault(r // ranks_per_node, []).append(r)
    return [by_node[n] for n in sorted(by_node)]


def build_hierarchy(groups: Sequence[Sequence[int]], ranks_per_node: int,
                    timeout: timedelta | None = None) -> Hierarchy | None:
    """Split each group of global ranks (the dp groups of a mesh, say) by node, and return this
    rank's split (None when it is in none). Every rank of the world calls it with the same `groups`:
    `new_group` is collective over the whole world, so every subgroup is created everywhere, in one
    order. `timeout` bounds every collective of the subgroups, those on the hierarchy's own thread
    too (a dead peer ends them rather than leaving the thread waiting)."""
    splits = []
    for ranks in groups:  # every group checked before any subgroup is created
        members = split_by_node(ranks, ranks_per_node)
        if len({len(m) for m in members}) != 1:
            raise ValueError(f"group {list(ranks)} has unequal members a node ({[len(m) for m in members]}): "
                             "a two-level collective needs the same number on every node")
        splits.append(members)
    me = dist.get_rank()
    mine: Hierarchy | None = None
    for members in splits:
        k, n = len(members), len(members[0])
        node = next((i for i, m in enumerate(members) if me in m), None)
        local = members[node].index(me) if node is not None else None
        intra = inter = None
        for i, m in enumerate(members):
            g = dist.new_group(m, timeout=timeout) if n > 1 else None
            if i == node:
                intra = g
        for j in range(n):
            g = dist.new_group([m[j] for m in members], timeout=timeout) if k > 1 else None
            if j == local:
                inter = g
        if node is not None and local is not None:
            mine = Hierarchy(k, n, node, local, intra, inter)
    return mine


class ExchangeWork:
    """A started exchange (`start_exchange`, `start_gather_exchange`): its sends and receives,
    waited for like torch's `Work` (`wait(timeout=...)`, the timeout spanning them all); a
    reduce-scatter's wait also sums the received slices into `out`, once."""

    def __init__(self, works: list[Any], finish: Callable[[], None] | None = None) -> None:
        self._works, self._finish = works, finish

    def wait(self, timeout: timedelta | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout.total_seconds()
        ok = True
        for w in self._works:
            left = None if end is None else timedelta(seconds=max(0.0, end - time.monotonic()))
            ok = (w.wait() if left is None else w.wait(timeout=left)) is not False and ok
        if self._finish is not None:
            self._finish()
            self._finish = None
        return ok

    def get_future(self) -> Any:
        """Done when every send and receive is (the sum, if any, waits for `wait`); raises where
        the backend's point-to-point works have no future."""
        return torch.futures.collect_all([w.get_future() for w in self._works])


# p2p tags of the exchanges: a reduce-scatter's and a gather's messages between the same two
# members never match each other, whatever the two have in flight (each kind is posted in one
# order on every member, as every member plays the same program)
REDUCE_TAG, GATHER_TAG = 1, 2


def start_exchange(out: torch.Tensor, full: torch.Tensor, group: Any, transport: Transport = DIRECT) -> ExchangeWork:
    """Start summing `full` over `group`, this member keeping its slice in `out` (what
    `dist.reduce_scatter_tensor` leaves): each member sends every other its slice once, (G - 1) / G
    of the buffer, and sums the G slices when waited for. gloo's reduce-scatter sends an
    all-reduce's bytes instead, twice as many at G = 2.

    Receives land in a buffer of the G - 1 other members' slices (at G = 2 in `out` itself), never
    in one the size of `full`: in flight, a bucket's reduction holds (G - 1) / G of the bucket
    beside it, not all of it (all_to_all_single's output, the whole bucket, cost ZeRO-2 and -3 a
    bucket's bytes for each reduction in flight). The sum is in member order, as before. Sends and
    receives go through `transport` (parallel/staging.py: host buffers where ranks share a GPU)."""
    parts = dist.get_world_size(group)
    if full.numel() != out.numel() * parts:
        raise ValueError(f"exchange: {full.numel()} elements do not split into {parts} x {out.numel()}")
    me, ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
    slices = full.view(parts, -1)
    got = out.view(1, -1) if parts == 2 else torch.empty(parts - 1, out.numel(), dtype=out.dtype, device=out.device)
    peers = [j for j in range(parts) if j != me]
    works = [transport.irecv(got[i], ranks[j], group, REDUCE_TAG) for i, j in enumerate(peers)]
    works += [transport.isend(slices[j], ranks[j], group, REDUCE_TAG) for j in peers]

    def finish() -> None:
        if parts == 2:  # out holds the other member's slice: one addition (commutative), rounded once
            out.add_(slices[me])
            return
        # in member order, accumulated in fp32 and rounded once, as torch.sum of the G slices did
        acc = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
        acc.copy_(slices[0] if me == 0 else got[0])
        for j in range(1, parts):
            acc.add_(slices[me] if j == me else got[peers.index(j)])
        if acc is not out:
            out.copy_(acc)

    return ExchangeWork(works, finish)


def start_gather_exchange(out: torch.Tensor, shard: torch.Tensor, group: Any,
                          transport: Transport = DIRECT) -> ExchangeWork:
    """Start filling `out` (G x shard) with every member's `shard`, in member order, as
    `dist.all_gather_into_tensor` does: each member sends its shard to every other, which receives
    it in place, into its slice of `out`. gloo's all-gather receives into a flat buffer the size of
    `out` and copies it over, a whole bucket's bytes more while it runs (ZeRO-1/2's gathers of
    updated weights, two at once on gloo's threads, and ZeRO-3's of every layer)."""
    parts = dist.get_world_size(group)
    if out.numel() != shard.numel() * parts:
        raise ValueError(f"gather: {out.numel()} elements do not split into {parts} x {shard.numel()}")
    me, ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
    slices = out.view(parts, -1)
    if slices[me].data_ptr() != shard.data_ptr():  # ZeRO-1/2 send their own slice of `out`
        slices[me].copy_(shard.reshape(-1))
    peers = [j for j in range(parts) if j != me]
    works = [transport.irecv(slices[j], ranks[j], group, GATHER_TAG) for j in peers]
    works += [transport.isend(slices[me], ranks[j], group, GATHER_TAG) for j in peers]
    return ExchangeWork(works)


def _reduce_scatter_exchange(full: torch.Tensor, parts: int, group: Any) -> torch.Tensor:
    """`start_exchange` waited for, returning this member's summed 1/parts slice (`full` itself
    when there is no group)."""
    if group is None:
        return full
    out = torch.empty(full.numel() // parts, dtype=full.dtype, device=full.device)
    start_exchange(out, full, group).wait()
    return out


def reduce_scatter(out: torch.Tensor, full: torch.Tensor, h: Hierarchy) -> None:
    """out (S / W,) = slice `group position` of the sum of `full` (S,) over the group, as
    `dist.reduce_scatter_tensor` leaves it; S must be a multiple of W (ZeRO pads its buckets so)."""
    k, n = h.nodes, h.per_node
    if full.numel() != out.numel() * h.size:
        raise ValueError(f"reduce_scatter: {full.numel()} elements do not split into {h.size} x {out.numel()}")
    s = out.numel()
    # (K, N, s) -> (N, K, s): local place l's intra-node slice holds the K slices n x N + l
    by_local = full.view(k, n, s).transpose(0, 1).contiguous().view(-1)
    piece = _reduce_scatter_exchange(by_local, n, h.intra)  # (K x s,): summed over this node
    out.copy_(_reduce_scatter_exchange(piece, k, h.inter))  # (s,): summed over every node


def all_reduce(t: torch.Tensor, h: Hierarchy) -> None:
    """Sum `t` over the group in place: reduce-scatter inside the node, all-reduce of the 1/N piece
    across nodes, all-gather inside the node."""
    n = h.per_node
    flat = t.view(-1)
    pad = -flat.numel() % n
    work = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
    piece = _reduce_scatter_exchange(work, n, h.intra)
    if h.inter is not None:
        dist.all_reduce(piece, group=h.inter)
    if h.intra is not None:
        gathered = torch.empty_like(work)
        dist.all_gather_into_tensor(gathered, piece.contiguous(), group=h.intra)
        work = gathered
    else:
        work = piece
    if work.data_ptr() != flat.data_ptr():
        flat.copy_(work[: flat.numel()])


class HierarchicalWork:
    """A started two-level collective, waited for like torch's `Work` (`wait(timeout=...)` raises
    RuntimeError when it has not ended in time, as gloo's does), so parallel/waits.py can bound it."""

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            self._future.result(None if timeout is None else timeout.total_seconds())
        except FutureTimeout as e:
            raise RuntimeError(f"two-level collective still running after {timeout}") from e
        return True

    def is_completed(self) -> bool:
        return self._future.done()


def start_on(h: Hierarchy, fn: Callable[..., None], *args: Any) -> HierarchicalWork:
    """`fn(*args)` on this rank's collective thread, after the collectives started before it."""
    return HierarchicalWork(h._pool.submit(fn, *args))


def start_all_reduce(t: torch.Tensor, h: Hierarchy) -> HierarchicalWork:
    """`all_reduce` on this rank's collective thread; returns at once."""
    return start_on(h, all_reduce, t, h)


def start_reduce_scatter(out: torch.Tensor, full: torch.Tensor, h: Hierarchy) -> HierarchicalWork:
    """`reduce_scatter` on this rank's collective thread; returns at once."""
    return start_on(h, reduce_scatter, out, full, h)
