"""Pick a training layout: enumerate (P, D, ZeRO stage, schedule, V, micro-batch size and count,
recompute), drop what does not fit in memory, estimate step time, rank what is left.

Memory per rank (bytes), for the heaviest pipeline stage holding Ψ parameters:
  model states, ZeRO paper (Rajbhandari et al. 2020, mixed-precision Adam): 16Ψ at stage 0,
  (4 + 12/D)Ψ at stage 1, (2 + 14/D)Ψ at stage 2, 16Ψ/D at stage 3;
  activations: the schedule's peak in-flight micro-batches (from the simulator, in units of one
  stage) x layers of the stage x per-layer bytes, Korthikanti et al. 2022 with flash attention:
  34·s·b·h bf16 bytes a layer, 2·s·b·h with full recomputation (only each layer's input kept).
Step time: the simulator's step time at F:B:W = 1:1:1 (1:2:1 with recomputation) in units of one
stage forward of one micro-batch, that unit from FLOPs at an assumed model-FLOPs utilisation, every
action (F, B, W, or a fused BW) also paying a fixed `overhead_s`, a pipeline hop from activation
bytes over the link for each boundary between chunks the first micro-batch crosses on its way
forward and back, plus the data-parallel traffic that compute does not hide (`dp_traffic`), as
the code moves it (zero/stages.py): ZeRO-0 one all-reduce of the gradient, ZeRO-1 an all-reduce and
an all-gather of the updated weights, ZeRO-2 a reduce-scatter and that all-gather, ZeRO-3 gathers of
the parameters (once a step when P > 1, for every forward and backward when P = 1) and a
reduce-scatter. Reductions run during the last backward of the step, bucket by bucket; the
updated weights' gathers ahead of the next first forward (sim/overlap.py); the step is never
shorter than the link's busy time. A ring all-reduce sends 2(D-1)/D of the bytes a rank, a
reduce-scatter or all-gather (D-1)/D; on CPU ranks (gloo) the reduce-scatter sends an
all-reduce's bytes, a node's ranks share its one link (a flat ring in node order crosses it once a
group), and `--hierarchical` is a candidate: the two-level reduction of parallel/hierarchical.py,
an exchange inside the node then across, (g-1)/g of the bytes on the node's fast path and
(n-1)/n of a 1/g piece on the link for g ranks of a group on each of n nodes.
Ranks that share a host's CPU cores (the emulated cluster: `cores`) slow each other's compute by
busy ranks / cores, where a pipeline's ranks are busy 1 - bubble of the step, less where a stage is
lighter than the heaviest (the head's FLOPs are on the last stage only). Inside a node of such a
host the CPU copies a collective's bytes (loopback): it slows alike and hides behind nothing; the
bytes crossing its links cost those cores `net_cpu_s_per_gb` too.
ZeRO-2/3 with several micro-batches come in both gradient-reduction modes: `step` holds the full
gradient through the step (2Ψ(1 - 1/D) more bytes than the paper's stage) for one reduce-scatter;
`microbatch` keeps the paper's memory at M reduce-scatters a step, each holding its backward up
where more than one bucket is outstanding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from pipezero.config import GradReduce, ModelConfig, Placement, ScheduleKind
from pipezero.models.presets import block_params, layer_param_counts
from pipezero.parallel.hierarchical import split_by_node
from pipezero.parallel.mesh import Mesh
from pipezero.schedules.check import CostModel, simulate
from pipezero.schedules.registry import SCHEDULES, build_schedule, check_layout
from pipezero.sim.overlap import gather_before, reduce_during
from pipezero.zero.accounting import paper_bytes_per_param

GIB = 2**30


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_gib: float
    node_size: int = 8
    intra_gbps: float = 300.0  # GB/s within a node
    inter_gbps: float = 25.0  # GB/s between nodes, per GPU
    tflops: float = 989.0  # dense bf16 peak per GPU
    mfu: float = 0.45  # achieved share of peak in the compute of one stage
    headroom: float = 0.9  # usable share of memory (allocator, buffers, fragmentation)
    wire_bytes: int = 2  # bytes an element of gradients and activations on the wire (bf16; fp32 runs: 4)
    # fixed seconds every action (a forward, backward or split half of one) costs beyond its FLOPs
    # (launches, Python): negligible for large micro-batches on a GPU, but on CPU with small ones it
    # decides (measured on the emulated cluster: B=1 x M=8 ran 2-4x slower than FLOPs alone
    # predicted); it is why a fused BW beats its B and W apart when the bubble is not the limit
    overhead_s: float = 0.0
    # CPU ranks on gloo (`--device cpu`): its reduce-scatter sends an all-reduce's bytes, a node's
    # ranks share one link (inter_gbps x node_size), and --hierarchical can be chosen
    cpu: bool = False
    # CPU cores all ranks share (0: a device each); the emulated cluster runs every rank on one host
    cores: int = 0
    # host CPU-seconds per GB crossing a node's link, taken from the cores that compute (0 where NICs
    # carry it); the emulated cluster's veth, bridge and tbf run in the host's kernel: 11-14 measured
    # by bench/link_probe.py (`cpu_s`) at 200 and 500mbit
    net_cpu_s_per_gb: float = 0.0
    bucket_mb: float = 25.0  # the run's gradient bucket (train --bucket-mb): the unit of overlap


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    zero: int
    schedule: ScheduleKind
    virtual: int
    micro_batch: int
    microbatches: int
    recompute: bool
    grad_reduce: GradReduce = GradReduce.STEP
    placement: Placement = Placement.DP_INNER
    hierarchical: bool = False


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    model_states_gib: float
    activations_gib: float
    step_time_s: float
    bubble: float
    dp_comm_s: float  # data-parallel collectives' time that compute does not hide
    tokens_per_s: float

    @property
    def memory_gib(self) -> float:
        return self.model_states_gib + self.activations_gib


def model_from_params(n: float) -> ModelConfig:
    """A Llama-like shape of about `n` parameters (depth by size, width from 12·L·d² ≈ n)."""
    layers = 12 if n < 5e8 else 24 if n < 3e9 else 40 if n < 2e10 else 80 if n < 1.2e11 else 120
    dim = max(128, int(round(math.sqrt(n / (12 * layers)) / 128)) * 128)
    return ModelConfig(preset=f"{n / 1e9:.1f}B", vocab_size=32000, dim=dim, n_layers=layers,
                       n_heads=max(1, dim // 128), max_seq_len=4096)


@lru_cache(maxsize=4096)
def _sim(kind: ScheduleKind, pp: int, m: int, v: int, recompute: bool,
         per_action: float) -> tuple[float, float, float]:
    """(step time in stage-forward units, bubble, peak in-flight activation memory in stages), each
    action costing `per_action` units more (rounded by the caller, so that layouts share the cache)."""
    res = simulate(build_schedule(kind, pp, m, v), CostModel(1.0, 2.0 if recompute else 1.0, 1.0,
                                                             per_action=per_action))
    return res.step_time, res.bubble, max(res.peak_activation_memory)


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


def collective_s(cluster: Cluster, lay: Layout, nbytes: float) -> dict[str, float]:
    """Seconds of each data-parallel collective over `nbytes` for the layout's groups."""
    d, split = lay.dp, dp_split(cluster.node_size, lay.pp, lay.dp, lay.placement)
    bw = link_gbps(cluster, lay)[1]
    if cluster.cpu and split and split[1] > 1:  # one shared link a node: a group's ring crosses it once
        bw = cluster.inter_gbps * split[0]
    ring = (d - 1) / d * nbytes / (bw * 1e9)
    took = {"all_reduce": 2 * ring, "all_gather": ring, "reduce_scatter": 2 * ring if cluster.cpu else ring}
    if lay.hierarchical and split:
        g, n = split
        inside = (g - 1) / g * nbytes / (cluster.intra_gbps * 1e9)
        across = (n - 1) / n * nbytes / g / (cluster.inter_gbps * 1e9)
        took["reduce_scatter"] = inside + across
        took["all_reduce"] = 2 * inside + 2 * across  # then the node gathers its pieces back
    return took


def estimate(model: ModelConfig, seq_len: int, global_batch: int, cluster: Cluster, lay: Layout) -> Estimate:
    layers = layer_param_counts(model)
    per_stage_layers = math.ceil(model.n_layers / lay.pp)
    # Heaviest stage: its share of blocks plus the embedding or the head (with tied embeddings the
    # last stage keeps a copy of the table), whichever is bigger; one stage holds both.
    ends = (layers[0] + layers[-1] if lay.pp == 1 else
            max(layers[0], layers[-1] + (layers[0] if model.tie_embeddings else 0)))
    psi = per_stage_layers * block_params(model) + ends
    states = paper_bytes_per_param(lay.zero, lay.dp, mixed=True) * psi
    per_microbatch = lay.grad_reduce is GradReduce.MICROBATCH and lay.zero >= 2 and lay.microbatches > 1
    if lay.zero >= 2 and lay.microbatches > 1 and not per_microbatch:
        states += 2 * psi * (1 - 1 / lay.dp)  # the whole bf16 gradient lives through the step
    per_layer_act = (2 if lay.recompute else 34) * seq_len * lay.micro_batch * model.dim
    # the bubble and memory without fixed costs (the same cached simulation as below when there are none)
    _, bubble, peak_stages = _sim(lay.schedule, lay.pp, lay.microbatches, lay.virtual, lay.recompute, 0.0)
    acts = peak_stages * per_stage_layers * per_layer_act
    if lay.recompute:  # one micro-batch's full activations exist while its backward recomputes
        acts += 34 * seq_len * lay.micro_batch * model.dim
    tokens_mb = seq_len * lay.micro_batch
    flops_f = 2.0 * (per_stage_layers * (block_params(model) - 2 * model.dim)) * tokens_mb
    flops_f += 4.0 * per_stage_layers * seq_len * tokens_mb * model.dim  # attention scores and values
    # the head: on the last stage, which with even blocks is the slowest and sets the pace (small
    # models: a 4096 x 128 head is 2.5x a block's matmuls; ignoring it ranked P=2 far too high)
    head_f = 2.0 * model.vocab_size * model.dim * tokens_mb
    flops_f += head_f
    t_f = flops_f / (cluster.tflops * 1e12 * cluster.mfu)  # > 0: every stage has blocks or the head
    # the fixed cost is an action's: a fused BW pays it once, B and W apart twice, V chunks V times
    step_units = _sim(lay.schedule, lay.pp, lay.microbatches, lay.virtual, lay.recompute,
                      round(cluster.overhead_s / t_f, 3))[0]
    if cluster.cores:  # ranks on one host's cores: a rank computes slower while others are busy too
        # a stage lighter than the heaviest idles for the difference (the first has no head)
        block_f = (flops_f - head_f) / per_stage_layers
        lighter = (model.n_layers * block_f + head_f) / lay.pp / flops_f
        share = max(1.0, cluster.gpus * (1.0 - bubble) * lighter / cluster.cores)
        t_f *= share
        # inside a node bytes move by the CPU copying them (loopback), as slowly as compute
        cluster = replace(cluster, intra_gbps=cluster.intra_gbps / share)
    pp_bw, _ = link_gbps(cluster, lay)
    hop = cluster.wire_bytes * tokens_mb * model.dim / (pp_bw * 1e9)
    # the first micro-batch crosses every boundary between chunks forward, and back: V·P - 1 each way
    compute = step_units * t_f + 2 * (lay.virtual * lay.pp - 1) * hop
    dp_comm, link_s, crossing = dp_traffic(cluster, lay, psi, t_f)
    step = max(compute + dp_comm, link_s)  # the link carries every collective of the step, one at a time
    if cluster.net_cpu_s_per_gb:
        # the network's CPU work runs while its bytes move: what moves behind compute takes cores from
        # it, what moves while every rank waits runs on idle cores (pipeline hops: behind compute)
        behind = crossing * (1.0 - dp_comm / link_s) if link_s else 0.0
        if pp_bw == cluster.inter_gbps:  # every boundary between chunks crosses a link, both ways
            behind += (lay.virtual * lay.pp - 1) * 2 * lay.microbatches * lay.dp * hop * pp_bw * 1e9
        step += cluster.net_cpu_s_per_gb * behind / 1e9 / (cluster.cores or cluster.gpus)
    return Estimate(lay, states / GIB, acts / GIB, step, bubble, dp_comm, global_batch * seq_len / step)


def dp_traffic(cluster: Cluster, lay: Layout, psi: float, t_f: float) -> tuple[float, float, float]:
    """(exposed seconds, seconds on the link, bytes crossing node links, the whole job) of a step's
    data-parallel collectives, placed as the runtime places them (zero/stages.py): gradients
    reduced during a chunk's last backward of the step (every backward with grad-reduce
    `microbatch`), ZeRO-1/2's updated weights gathered ahead of the next step's first forward,
    ZeRO-3's parameters gathered once a step and kept when P > 1, layer by layer for every forward
    and backward when P = 1. Stage 0's first forward and last backward set the pace (sim/overlap.py
    plays them bucket by bucket); the other stages have the pipeline's fill and drain to spare."""
    if lay.dp == 1:
        return 0.0, 0.0, 0.0
    m = lay.microbatches
    took = collective_s(cluster, lay, cluster.wire_bytes * psi)
    k = max(1, math.ceil(psi * 4 / (cluster.bucket_mb * 2**20)))  # buckets are cut in fp32 (zero/buckets.py)
    forward, backward = t_f, (3.0 if lay.recompute else 2.0) * t_f  # B (with its forward again) and W
    split = dp_split(cluster.node_size, lay.pp, lay.dp, lay.placement)
    if cluster.cores and split and split[1] == 1:
        # inside a node of a host whose cores all compute, a collective is the CPU copying bytes
        # (loopback): it takes the cores from compute for as long as it runs, so none of it hides
        forward = backward = 0.0
    every = lay.zero >= 2 and lay.grad_reduce is GradReduce.MICROBATCH and m > 1
    reductions = m if every else 1
    if lay.zero < 2:
        counts = {"all_reduce": 1, "all_gather": lay.zero}
        last = reduce_during(took["all_reduce"], backward, k)
        exposed = last.exposed_s + (gather_before(took["all_gather"], forward, k) if lay.zero else 0.0)
    else:
        bound = 1  # train's default --buckets-in-flight
        early = (m - 1) * reduce_during(took["reduce_scatter"], backward, k, bound).stall_s if every else 0.0
        if lay.zero == 2:
            counts = {"reduce_scatter": reductions, "all_gather": 1}
            last = reduce_during(took["reduce_scatter"], backward, k, bound)
            exposed = last.exposed_s + early + gather_before(took["all_gather"], forward, k)
        elif lay.pp > 1:  # a chunk gathered before its first forward (stage 0 waits for all of it), kept
            counts = {"reduce_scatter": reductions, "all_gather": 1}
            exposed = took["all_gather"] + early + reduce_during(took["reduce_scatter"], backward, k, bound).exposed_s
        else:  # layer by layer: every forward and backward gathers again; the last also reduces
            counts = {"reduce_scatter": reductions, "all_gather": 2 * m}
            ag, rs = took["all_gather"], took["reduce_scatter"]
            exposed = m * gather_before(ag, forward, k) + (m - 1) * (
                reduce_during(ag + rs, backward, k, bound).stall_s if every else gather_before(ag, backward, k))
            exposed += reduce_during(ag + rs, backward, k, bound).exposed_s
    link = sum(took[c] * n for c, n in counts.items())
    crossing = sum(crossing_bytes(cluster, lay, cluster.wire_bytes * psi)[c] * n for c, n in counts.items())
    return exposed, link, crossing


def crossing_bytes(cluster: Cluster, lay: Layout, nbytes: float) -> dict[str, float]:
    """Bytes one collective of each kind over `nbytes` sends across node links, all the job's
    data-parallel groups together: a flat ring in node order has n of its D hops crossing a link,
    each carrying (D-1)/D of the buffer a pass; the two-level reduction's exchange across sends
    (n-1)/n of each node's reduced buffer, n - 1 buffers a group. Groups that split unevenly count
    every hop as crossing."""
    d, split = lay.dp, dp_split(cluster.node_size, lay.pp, lay.dp, lay.placement)
    passes = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 2 if cluster.cpu else 1}
    if split is None:
        hops = d if link_gbps(cluster, lay)[1] == cluster.inter_gbps else 0
        return {c: lay.pp * hops * p * (d - 1) / d * nbytes for c, p in passes.items()}
    _, n = split
    flat = {c: lay.pp * (n if n > 1 else 0) * p * (d - 1) / d * nbytes for c, p in passes.items()}
    if lay.hierarchical and n > 1:
        flat["reduce_scatter"] = lay.pp * (n - 1) * nbytes
        flat["all_reduce"] = 2 * flat["reduce_scatter"]
    return flat


def candidate_layouts(model: ModelConfig, cluster: Cluster, global_batch: int) -> list[Layout]:
    out = []
    for pp in range(1, min(cluster.gpus, model.n_layers) + 1):
        if cluster.gpus % pp:
            continue
        dp = cluster.gpus // pp
        # both placements differ only where some group crosses nodes
        places = list(Placement) if pp > 1 and dp > 1 and cluster.gpus > cluster.node_size else [Placement.DP_INNER]
        if global_batch % dp:
            continue
        # --hierarchical (gloo only) where a group has the same ranks, two or more, on each of its
        # nodes. With one rank a node it is the exchange alone, which on the emulated cluster ran a
        # training step no faster than gloo's reduce-scatter (its transfer alone: 1-2x the wire time,
        # the ring's 1.05x), so it is not offered there.
        two_level = {}
        for place in places:
            split = dp_split(cluster.node_size, pp, dp, place)
            two_level[place] = (False, True) if cluster.cpu and split and min(split) > 1 else (False,)
        for mbs in (1, 2, 4, 8):
            per_rank = global_batch // dp
            if per_rank % mbs:
                continue
            m = per_rank // mbs
            for kind in SCHEDULES if pp > 1 else [ScheduleKind.ONE_F_ONE_B]:
                for v in (1, 2, 4):
                    if v * pp > model.n_layers:
                        continue
                    try:
                        check_layout(kind, pp, m, v)
                    except ValueError:
                        continue
                    if pp * m * v > 20000:  # beyond what the simulator plays in a planner's time
                        continue
                    for zero in (0, 1, 2, 3):
                        if dp == 1 and zero:
                            continue
                        modes = [GradReduce.STEP, GradReduce.MICROBATCH] if zero >= 2 and m > 1 else [GradReduce.STEP]
                        for recompute in (False, True):
                            out.extend(Layout(pp, dp, zero, kind, v, mbs, m, recompute, mode, place, hier)
                                       for mode in modes for place in places for hier in two_level[place])
    return out


def plan(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int) -> tuple[list[Estimate], int]:
    """Layouts that fit, fastest first, and how many were considered."""
    layouts = candidate_layouts(model, cluster, global_batch)
    fits = []
    for lay in layouts:
        est = estimate(model, seq_len, global_batch, cluster, lay)
        if est.memory_gib <= cluster.gpu_memory_gib * cluster.headroom:
            fits.append(est)
    fits.sort(key=lambda e: (e.step_time_s, e.memory_gib))
    return fits, len(layouts)


def reason(best: Estimate, e: Estimate, cluster: Cluster) -> str:
    free = cluster.gpu_memory_gib * cluster.headroom - e.memory_gib
    parts = [f"bubble {e.bubble:.1%}", f"{free:.1f} GiB to spare"]
    if e.dp_comm_s:
        parts.append(f"DP traffic not hidden {e.dp_comm_s * 1e3:.0f} ms")
    if e.layout.recompute:
        parts.append("recompute buys memory for ~1/3 more compute")
    if e.layout.hierarchical:
        parts.append("gradients reduced inside each node first")
    if e.layout.grad_reduce is GradReduce.MICROBATCH:
        parts.append(f"gradients reduced each micro-batch: sharded memory, {e.layout.microbatches}x traffic")
    if e is not best:
        parts.append(f"{e.step_time_s / best.step_time_s - 1:+.1%} vs best")
    return ", ".join(parts)
