"""What a layout's data-parallel collectives cost on a cluster, as the code moves them
(schedules/zero_rules.py): ZeRO-0 one all-reduce of the gradient, ZeRO-1 and ZeRO-2 a reduce-scatter and an
all-gather of the updated weights (ZeRO-2 may reduce after every backward), ZeRO-3 gathers of the parameters
(once a step when P > 1, for every forward and backward when P = 1) and a reduce-scatter.
Reductions run during the last backward of the step, bucket by bucket; the updated weights' gathers
ahead of the next first forward (planner/overlap.py says how much of each hides).

A ring all-reduce sends 2(D-1)/D of the bytes a rank, a reduce-scatter or all-gather (D-1)/D (on
CPU ranks the reduce-scatter is a direct exchange of slices, zero/coordinator.py, because gloo's own
sends an all-reduce's bytes, and so are the gathers but --quantize-weights' ones: a rank's (D-1)/D
too, but with g ranks of a group on each node a node's link carries g(D-g)/D of the buffer, not a
ring's (D-1)/D); on CPU ranks a node's ranks share its one link
(a flat ring in node order crosses it once a group), and `--hierarchical` is a candidate: the
two-level reduction of parallel/hierarchical.py, an exchange inside the node then across, (g-1)/g
of the bytes on the node's fast path and (n-1)/n of a 1/g piece on the link for g ranks of a group
on each of n nodes. On a host whose cores every rank shares, a collective inside a node is the CPU
copying bytes (loopback) and hides behind nothing.

Each bucket's collective also pays a message's latency (the probe's: the nodes' where a group spans
them) for each of its ring's steps one after another (`latency_s`), which a step of many small
buckets feels.

Quantized traffic (zero/compressed.py) is priced by the bytes it sends: `--quantize-weights` gathers
bits / 8 + 4 / block bytes an element, `--quantize-grads` reduces at that width, its reduce-scatter an
exchange and its all-reduce that exchange and a gather.
"""

from __future__ import annotations

import math
from functools import lru_cache

from pipezero.config import Placement
from pipezero.parallel.hierarchical import split_by_node
from pipezero.parallel.mesh import Mesh
from pipezero.schedules.zero_rules import RULES
from pipezero.planner.layouts import Cluster, Layout
from pipezero.planner.overlap import gather_before, reduce_during
from pipezero.zero.quantize import Bits, message_bytes


def link_gbps(cluster: Cluster, lay: Layout) -> tuple[float, float]:
    """(pipeline, data-parallel) bandwidth per GPU. The placement's inner group (neighbouring
    ranks) stays inside a node when it fits one and divides it; the outer group only when the whole
    job fits one node."""
    inner, outer = (lay.dp, lay.pp) if lay.placement is Placement.DP_INNER else (lay.pp, lay.dp)
    inner_bw = cluster.intra_gbps if cluster.node_size % inner == 0 else cluster.inter_gbps
    outer_bw = cluster.intra_gbps if inner * outer <= cluster.node_size else cluster.inter_gbps
    return (outer_bw, inner_bw) if lay.placement is Placement.DP_INNER else (inner_bw, outer_bw)


@lru_cache(maxsize=4096)
def dp_split(node_size: int, pp: int, dp: int, placement: Placement) -> tuple[int, int] | None:
    """(ranks of a data-parallel group on each node it touches, nodes it spans), the same for every
    group, or None where the groups split unevenly (the two-level reduction refuses those)."""
    shapes = set()
    for group in Mesh(pp, dp, placement=placement).dp_groups():
        members = split_by_node(group, node_size)
        shapes |= {(len(m), len(members)) for m in members}
    return shapes.pop() if len(shapes) == 1 else None


def element_bytes(bits: int, block: int) -> float:
    """Bytes an element of a quantized message: the code and its share of the block's fp32 scale."""
    return message_bytes(block, Bits(bits), block) / block


def payload_bytes(cluster: Cluster, lay: Layout, psi: float) -> dict[str, float]:
    """Bytes of the buffer each kind of collective moves for `psi` parameters, as it travels."""
    plain = cluster.wire_bytes * psi
    grads = psi * element_bytes(lay.grad_bits, lay.quant_block) if lay.grad_bits else plain
    gathers = psi * element_bytes(lay.weight_bits, lay.quant_block) if lay.weight_bits else plain
    return {"all_reduce": grads, "all_gather": gathers, "reduce_scatter": grads}


def collective_s(cluster: Cluster, lay: Layout, nbytes: float) -> dict[str, float]:
    """Seconds of each data-parallel collective over `nbytes` for the layout's groups."""
    d, split = lay.dp, dp_split(cluster.node_size, lay.pp, lay.dp, lay.placement)
    bw = link_gbps(cluster, lay)[1]
    if cluster.cpu and split and split[1] > 1:  # one shared link a node: a group's ring crosses it once
        bw = cluster.inter_gbps * split[0]
    ring = (d - 1) / d * nbytes / (bw * 1e9)
    took = {"all_reduce": 2 * ring, "all_gather": ring, "reduce_scatter": ring}
    if cluster.cpu and split and split[1] > 1:
        # direct exchanges (a CPU rank's reduce-scatters, and its gathers but quantized ones, which
        # are gloo's ring): each of a node's g ranks sends its 1/D slice to the D - g ranks elsewhere,
        # g (D - g) / D of the buffer on the node's link, 4/3 of a ring pass at 2 nodes x 2
        g = split[0]
        exchange = g * (d - g) / d * nbytes / (bw * 1e9)
        took["reduce_scatter"] = exchange
        if not lay.weight_bits:
            took["all_gather"] = exchange
        if lay.grad_bits:  # quantized all-reduce: the exchange, then gloo's gather of the coded sums
            took["all_reduce"] = exchange + ring
    if lay.hierarchical and split:
        g, n = split
        inside = (g - 1) / g * nbytes / (cluster.intra_gbps * 1e9)
        across = (n - 1) / n * nbytes / g / (cluster.inter_gbps * 1e9)
        took["reduce_scatter"] = inside + across
        took["all_reduce"] = 2 * inside + 2 * across  # then the node gathers its pieces back
    return took


def latency_s(cluster: Cluster, lay: Layout) -> dict[str, float]:
    """Fixed seconds of one bucket's collective of each kind: a message's latency (the nodes' where
    the group spans them) for each of a ring's steps one after another, 2(D-1) for an all-reduce and
    D-1 for a gather or reduce-scatter; the two-level reduction's g-1 inside the node, then n-1 across."""
    d, split = lay.dp, dp_split(cluster.node_size, lay.pp, lay.dp, lay.placement)
    lat = cluster.inter_latency_s if split is None or split[1] > 1 else cluster.intra_latency_s
    out = {"all_reduce": 2 * (d - 1) * lat, "all_gather": (d - 1) * lat, "reduce_scatter": (d - 1) * lat}
    if lay.hierarchical and split:
        g, n = split
        out["reduce_scatter"] = (g - 1) * cluster.intra_latency_s + (n - 1) * cluster.inter_latency_s
        out["all_reduce"] = 2 * out["reduce_scatter"]
    return out


def dp_traffic(cluster: Cluster, lay: Layout, psi: float, t_f: float,
               kept: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float, float]:
    """(exposed seconds, seconds on the link, bytes crossing node links, the whole job) of a step's
    data-parallel collectives, placed as the runtime places them (schedules/zero_rules.py): gradients
    reduced during a chunk's last backward of the step (every backward with grad-reduce
    `microbatch`), ZeRO-1/2's updated weights gathered ahead of the next step's first forward,
    ZeRO-3's parameters gathered once a step and kept when P > 1, layer by layer for every forward
    and backward when P = 1. Stage 0's first forward and last backward set the pace (planner/overlap.py
    plays them bucket by bucket); the other stages have the pipeline's fill and drain to spare.
    `kept` (front, tail): the shares of the parameters --zero3-prefetch keeps gathered from a
    backward into the next forward and from a forward into its backward (planner.kept_shares)."""
    if lay.dp == 1:
        return 0.0, 0.0, 0.0
    m = lay.microbatches
    payload = payload_bytes(cluster, lay, psi)
    k = max(1, math.ceil(psi * 4 / (cluster.bucket_mb * 2**20)))  # buckets are cut in fp32 (zero/buckets.py)
    split = dp_split(cluster.node_size, lay.pp, lay.dp, lay.placement)
    fixed = latency_s(cluster, lay)
    took = {c: collective_s(cluster, lay, n)[c] + k * fixed[c] for c, n in payload.items()}
    forward, backward = t_f, (3.0 if lay.recompute else 2.0) * t_f  # B (with its forward again) and W
    if cluster.cores and split and split[1] == 1:
        # inside a node of a host whose cores all compute, a collective is the CPU copying bytes
        # (loopback): it takes the cores from compute for as long as it runs, so none of it hides
        forward = backward = 0.0
    rules = RULES[lay.zero]
    every = rules.reduces_every_backward(lay.grad_reduce) and m > 1
    reductions = m if every else 1
    if not rules.reduces_to_shard:
        counts = {"all_reduce": 1, "all_gather": int(rules.gathers_updates)}
        last = reduce_during(took["all_reduce"], backward, k)
        exposed = last.exposed_s + (gather_before(took["all_gather"], forward, k) if rules.gathers_updates else 0.0)
    else:
        bound = lay.in_flight
        early = (m - 1) * reduce_during(took["reduce_scatter"], backward, k, bound).stall_s if every else 0.0
        if not rules.sharded_params:
            counts = {"reduce_scatter": reductions, "all_gather": 1}
            last = reduce_during(took["reduce_scatter"], backward, k, bound)
            exposed = last.exposed_s + early + gather_before(took["all_gather"], forward, k)
        elif lay.pp > 1:  # a chunk gathered before its first forward (stage 0 waits for all of it), kept
            counts = {"reduce_scatter": reductions, "all_gather": 1}
            exposed = took["all_gather"] + early + reduce_during(took["reduce_scatter"], backward, k, bound).exposed_s
        else:  # layer by layer: every forward and backward gathers again (but what --zero3-prefetch
            # keeps gathered across an action's end); the last also reduces
            front, tail = kept
            counts = {"reduce_scatter": reductions, "all_gather": 2 * m - m * tail - (m - 1) * front}
            ag, rs = took["all_gather"], took["reduce_scatter"]
            later = ag
            if lay.secondary and split:  # hpZ: after the first, from the node's fp32 shares (zero/coordinator.py)
                g = split[0]
                later = took["node_gather"] = ((g - 1) / g * 4 * psi / (cluster.intra_gbps * 1e9)
                                               + k * (g - 1) * cluster.intra_latency_s)
                counts.update(all_gather=1, node_gather=2 * m - 1 - m * tail - (m - 1) * front)
            fwd, bwd = later * (1 - front), later * (1 - tail)  # a later forward's, a backward's gathers
            if lay.secondary and split and cluster.cores:
                # hpZ's gathers inside the node are the host's CPU copying (loopback), on the cores that
                # compute: they hide behind nothing (P=1 all8 on the emulated 2 x 2: the planner was
                # 0.07 s a step short at both rates, -19% at 200mbit)
                exposed = gather_before(ag, forward, k) + (m - 1) * fwd + m * bwd + (m - 1) * (
                    reduce_during(rs, backward, k, bound).stall_s if every else 0.0)
                exposed += reduce_during(rs, backward, k, bound).exposed_s
            else:
                exposed = gather_before(ag, forward, k) + (m - 1) * gather_before(fwd, forward, k) + (m - 1) * (
                    reduce_during(bwd + rs, backward, k, bound).stall_s if every else gather_before(bwd, backward, k))
                exposed += reduce_during(bwd + rs, backward, k, bound).exposed_s
    counts.pop("node_gather", None)  # inside the node: neither on the link nor crossing it
    link = sum(took[c] * n for c, n in counts.items())
    crossing = sum(crossing_bytes(cluster, lay, payload[c])[c] * n for c, n in counts.items())
    return exposed, link, crossing


def crossing_bytes(cluster: Cluster, lay: Layout, nbytes: float) -> dict[str, float]:
    """Bytes one collective of each kind over `nbytes` sends across node links, all the job's
    data-parallel groups together: a flat ring in node order has n of its D hops crossing a link,
    each carrying (D-1)/D of the buffer a pass, a CPU rank's direct exchange (D - g) buffers a group
    for g of its ranks a node (measured on the emulated 2 x 2: 136.8 MB a step crossing where the ring
    said 100.3); the two-level reduction's exchange across sends
    (n-1)/n of each node's reduced buffer, n - 1 buffers a group. Groups that split unevenly count
    every hop as crossing."""
    d, split = lay.dp, dp_split(cluster.node_size, lay.pp, lay.dp, lay.placement)
    passes = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    if split is None:
        hops = d if link_gbps(cluster, lay)[1] == cluster.inter_gbps else 0
        return {c: lay.pp * hops * p * (d - 1) / d * nbytes for c, p in passes.items()}
    g, n = split
    flat = {c: lay.pp * (n if n > 1 else 0) * p * (d - 1) / d * nbytes for c, p in passes.items()}
    if cluster.cpu and n > 1:  # direct exchanges (collective_s): every rank's slices to the D - g ranks elsewhere
        exchange = lay.pp * (d - g) * nbytes
        ring = flat["all_gather"]
        flat["reduce_scatter"] = exchange
        if not lay.weight_bits:
            flat["all_gather"] = exchange
        if lay.grad_bits:
            flat["all_reduce"] = exchange + ring
    if lay.hierarchical and n > 1:
        flat["reduce_scatter"] = lay.pp * (n - 1) * nbytes
        flat["all_reduce"] = 2 * flat["reduce_scatter"]
    return flat
