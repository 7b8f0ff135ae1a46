"""Pick a training layout: enumerate (P, D, ZeRO stage, schedule, V, micro-batch size and count,
recompute), drop what does not fit in memory, estimate step time, rank what is left.

Memory per rank: the memory model's peak (memory/model.py: the lowered program walked over byte
counts, pipezero's fp32 weights, gradients and AdamW whatever the compute dtype), of the heavier of
the first and last pipeline rank; it holds states (parameters, gradients, optimizer, ZeRO-3's
gathered weights) apart from the rest (activations, transfers, collective buffers).
Step time: the simulator's step time at F:B:W = 1:1:1 (1:2:1 with recomputation) in units of one
stage forward of one micro-batch, that unit from FLOPs at an assumed model-FLOPs utilisation, every
action (F, B, W, or a fused BW) also paying a fixed `overhead_s`, the unit the heaviest pipeline
rank's (its layers cut as the run cuts them), each boundary between chunks a hop of one
micro-batch's activation bytes over the link the placement puts it on, and that link's latency
(inside a node or between nodes, `hop_seconds`), played by the simulator as the schedule waits on it and queues on it
(schedules/check.py: a 1F1B rank waits a round trip across a slow boundary where GPipe streams
through it), plus the data-parallel traffic that compute does not hide (planner/traffic.py); the
step is never shorter than the data-parallel link's busy time.
Ranks that share a host's CPU cores (the emulated cluster: `cores`) slow each other's compute by
busy ranks / cores, where a pipeline's ranks are busy 1 - bubble of the step (its compute played
alone: a rank waiting for a hop counts as busy, which prices the step no shorter), less where a stage is
lighter than the heaviest (the head's FLOPs are on the last stage only). Inside a node of such a
host the CPU copies a collective's bytes (loopback): it slows alike; the bytes crossing its links
cost those cores `net_cpu_s_per_gb` too.
ZeRO-2/3 with several micro-batches come in both gradient-reduction modes: `step` holds the full
gradient through the step (2Ψ(1 - 1/D) more bytes than the paper's stage) for one reduce-scatter;
`microbatch` keeps the paper's memory at M reduce-scatters a step, each holding its backward up
where more than one bucket is outstanding.
Where few layouts fit, those that do not are tried with the optimizer offloaded (`offloaded`,
memory/offload.py): a device peak 8 bytes an updated parameter lower, a node's host holding 16 (its
ranks counted each as the one that offloads most), and the step longer by the host copies and the
CPU's AdamW, priced as exposed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from pipezero.config import BUCKETS_IN_FLIGHT, GradReduce, ModelConfig, Partition, Placement, ScheduleKind
from pipezero.models.presets import block_params, layer_costs, layer_param_counts, unit_param_counts
from pipezero.schedules.check import CostModel, simulate
from pipezero.schedules.compile import proven_of
from pipezero.schedules.registry import SCHEDULES, SPLIT_BACKWARD, build_schedule, check_layout
from pipezero.schedules.zero_rules import RULES
from pipezero.schedules import limits
from pipezero.planner.layouts import Cluster, Layout
from pipezero.memory.model import layout_memory
from pipezero.memory.partition import balanced_layout
from pipezero.memory.offload import DEVICE_SAVED, HOST_BYTES, HostLink
from pipezero.parallel.mesh import Mesh
from pipezero.planner.traffic import dp_split, dp_traffic

GIB = 2**30


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    model_states_gib: float
    activations_gib: float
    step_time_s: float
    bubble: float  # idle share of the pipeline's played step: ranks blocked on peers, hops and fixed costs included
    dp_comm_s: float  # data-parallel collectives' time that compute does not hide
    tokens_per_s: float
    crossing_bytes: float = 0.0  # a step's data-parallel bytes crossing node links, the whole job
    # --offload optimizer (memory/offload.py): host GiB a node's ranks hold, and the seconds the host
    # copies and the CPU's AdamW add to the step (both 0 without offload)
    host_gib: float = 0.0
    offload_s: float = 0.0
    saved_gib: float = 0.0  # device GiB offload takes off the heaviest rank (AdamW's moments)

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
def _sim(kind: ScheduleKind, pp: int, m: int, v: int, recompute: bool, per_action: float,
         hop: tuple[float, ...] | None = None) -> tuple[float, float, float]:
    """(step time in stage-forward units, bubble, peak in-flight activation memory in stages), each
    action costing `per_action` units more and each boundary between chunks its `hop` (None: free;
    both rounded by the caller, so that layouts share the cache). At F=B=W=1 with no fixed cost and
    free hops it is the play that proved the schedule, made once already."""
    hop = hop if hop is not None and any(hop) else None
    cost = CostModel(1.0, 2.0 if recompute else 1.0, 1.0, per_action=per_action, hop=hop)
    res = proven_of(kind, pp, m, v).predicted if cost == CostModel() else simulate(build_schedule(kind, pp, m, v), cost)
    return res.step_time, res.bubble, max(res.peak_activation_memory)


def rank_flops(model: ModelConfig, seq_len: int, lay: Layout, counts: list[int] | None = None) -> list[float]:
    """Each pipeline rank's forward FLOPs a token, its chunks of [embedding, blocks..., head] cut as
    the run cuts them (parallel/partition.py `cut_bounds`, by `lay.partition`, or `counts` layers a chunk)
    and placed on ranks as its schedule places them."""
    from pipezero.parallel.partition import cut_bounds

    costs = [c / 3 for c in layer_costs(model, seq_len)]  # forward: a third of forward and backward
    bounds = cut_bounds(layer_param_counts(model), lambda: costs, lay.pp * lay.virtual, lay.partition, counts)
    placed = chunk_ranks(lay.schedule, lay.pp, lay.microbatches, lay.virtual)
    out = [0.0] * lay.pp
    for chunk, (start, stop) in enumerate(bounds):
        out[placed[chunk]] += sum(costs[start:stop])
    return out


def chunk_ranks(kind: ScheduleKind, pp: int, m: int, virtual: int) -> tuple[int, ...]:
    """The pipeline rank of each chunk, in model order: with one chunk a rank, chunk r on rank r."""
    return tuple(range(pp)) if virtual == 1 else _chunk_ranks(kind, pp, virtual, m)


@lru_cache(maxsize=256)
def _chunk_ranks(kind: ScheduleKind, pp: int, virtual: int, m: int) -> tuple[int, ...]:
    placed = build_schedule(kind, pp, m, virtual).rank_of_chunk  # the placement: the same at any M
    return tuple(placed[c] for c in range(pp * virtual))


@dataclass(frozen=True)
class Boundary:
    """Where a pipeline's hop between two chunks on different ranks goes."""

    across: bool  # between nodes (else inside one)
    senders: int  # ranks of the sending node that cross it at once, a replica each (1 inside a node)


@lru_cache(maxsize=4096)
def boundaries(node_size: int, lay: Layout) -> tuple[Boundary | None, ...]:
    """Each boundary between consecutive chunks a micro-batch crosses, in model order (None: two
    chunks of one rank, the V-shape's turn, no hop), its pipeline's ranks on nodes of `node_size`
    as the mesh numbers them (placement)."""
    mesh = Mesh(lay.pp, lay.dp, placement=lay.placement)
    placed = chunk_ranks(lay.schedule, lay.pp, lay.microbatches, lay.virtual)
    out: list[Boundary | None] = []
    for a, b in zip(placed, placed[1:]):
        ends = [(mesh.global_rank(a, d) // node_size, mesh.global_rank(b, d) // node_size) for d in range(lay.dp)]
        node = ends[0][0]
        out.append(None if a == b else Boundary(False, 1) if node == ends[0][1] else
                   Boundary(True, sum(1 for here, there in ends if here == node and there != node)))
    return tuple(out)


def hop_seconds(cluster: Cluster, lay: Layout, nbytes: float) -> tuple[float, ...]:
    """Seconds one transfer of `nbytes` (a micro-batch's activation, or its gradient) holds the link of
    each boundary between chunks: the node's rate inside a node; between nodes a GPU's own link, or
    on CPU ranks, which share their node's one link (inter_gbps a rank), the node's link split among
    the ranks that send across the boundary at once; each transfer also pays its link's latency."""
    out = []
    for b in boundaries(cluster.node_size, lay):
        if b is None:
            out.append(0.0)
            continue
        gbps = (cluster.intra_gbps if not b.across else
                cluster.inter_gbps * (cluster.node_size / b.senders if cluster.cpu else 1.0))
        out.append((cluster.inter_latency_s if b.across else cluster.intra_latency_s) + nbytes / (gbps * 1e9))
    return tuple(out)


def kept_shares(layers: list[int], lay: Layout) -> tuple[float, float]:
    """(front, tail): the shares of a layer-by-layer ZeRO-3 model's parameters whose gathers an action
    hands to the next one at --zero3-prefetch N (zero/sharded.py keeps them gathered): a forward
    keeps its last N - 1 units for its backward, a backward its first N - 1 for the next
    micro-batch's forward (none across the optimizer step, none with recompute). `layers`: each
    unit's parameters (a layer's, or with --zero3-unit sublayer a block's part's)."""
    keep = min(lay.prefetch - 1, len(layers))
    if not RULES[lay.zero].sharded_params or lay.pp != 1 or lay.recompute or keep <= 0:
        return 0.0, 0.0
    total = sum(layers)
    return sum(layers[:keep]) / total, sum(layers[-keep:]) / total


def estimate(model: ModelConfig, seq_len: int, global_batch: int, cluster: Cluster, lay: Layout,
             limit_gib: float | None = None) -> Estimate | None:
    """`lay`'s memory and step time on `cluster`. `limit_gib`: None instead where its memory is over
    this many GiB, found by memory walks that stop there (most of a request's candidates do not fit,
    and a walk is most of an estimate's time)."""
    layers = layer_param_counts(model)
    per_stage_layers = math.ceil(model.n_layers / lay.pp)
    # Heaviest stage: its share of blocks plus the embedding or the head (with tied embeddings the
    # last stage keeps a copy of the table), whichever is bigger; one stage holds both.
    ends = (layers[0] + layers[-1] if lay.pp == 1 else
            max(layers[0], layers[-1] + (layers[0] if model.tie_embeddings else 0)))
    psi = per_stage_layers * block_params(model) + ends
    # memory: the heaviest rank's peak from the memory model (memory/model.py), split into model
    # states (parameters, gradients, optimizer, ZeRO-3's gathered weights) and the rest
    split = dp_split(cluster.node_size, lay.pp, lay.dp, lay.placement)
    counts = None  # layers a chunk: the partition policy's (uniform, by count) unless cut by memory
    if lay.partition is Partition.MEMORY:  # every rank walked; the rank with most blocks sets the pace
        cut = balanced_layout(model, seq_len, lay, cluster.wire_bytes == 2, not cluster.cpu, cluster.bucket_mb)
        peak, per_stage_layers, psi, counts = cut.peak, max(1, cut.blocks), cut.params, list(cut.counts)
    else:
        # the walks may stop where the peak and hpZ's copy (below) pass the limit; the margin covers
        # the rounding of the sum in GiB
        stop = (None if limit_gib is None else
                limit_gib * GIB * (1 + 1e-9) - (4 * psi / split[0] if lay.secondary and split else 0))
        peak = layout_memory(model, seq_len, lay, cluster.wire_bytes == 2, not cluster.cpu, cluster.bucket_mb, stop)
        if stop is not None and peak.peak_bytes > stop:
            return None
    states = sum(peak.categories[c] for c in ("params", "gathered", "grads", "optimizer"))
    updated = peak.host_peak_bytes // HOST_BYTES  # elements the rank offloading most updates (0: no offload)
    acts = peak.peak_bytes - states
    if lay.secondary and split:  # hpZ: each rank keeps 1/g of its stage's parameters in fp32
        states += 4 * psi / split[0]
    tokens_mb = seq_len * lay.micro_batch
    # the heaviest rank sets the pace, its layers as the run cuts them (small models: a 4096 x 128
    # head is 2.3x a block's matmuls; ignoring it ranked P=2 far too high, and adding it to an
    # even share of blocks priced 4 blocks over P=4 at a block and the head, where the run's cut
    # gives the head a stage alone)
    per_rank = rank_flops(model, seq_len, lay, counts)
    flops_f = max(per_rank) * tokens_mb
    t_f = flops_f / (cluster.tflops * 1e12 * cluster.mfu)  # > 0: every stage has blocks or the head
    # the fixed cost is an action's: a fused BW pays it once, B and W apart twice, V chunks V times
    per_action = round(cluster.overhead_s / t_f, 3)
    if cluster.cores:  # ranks on one host's cores: a rank computes slower while others are busy too
        # how busy: the bubble of compute alone (no fixed costs, free hops); a stage lighter than the
        # heaviest idles for the difference (the first has no head)
        _, bubble, _ = _sim(lay.schedule, lay.pp, lay.microbatches, lay.virtual, lay.recompute, 0.0)
        lighter = sum(per_rank) / lay.pp / max(per_rank)
        share = max(1.0, cluster.gpus * (1.0 - bubble) * lighter / cluster.cores)
        t_f *= share
        # inside a node bytes move by the CPU copying them (loopback), as slowly as compute
        cluster = replace(cluster, intra_gbps=cluster.intra_gbps / share)
    hop_bytes = cluster.wire_bytes * tokens_mb * model.dim  # one micro-batch's activations (or their gradient)
    # the pipeline's step: its schedule played with each boundary's hop (in units of t_f, rounded as
    # `per_action` is) where the run waits for it, and the bubble that leaves (blocked on peers)
    hops = tuple(round(h / t_f, 3) for h in hop_seconds(cluster, lay, hop_bytes))
    step_units, bubble, _ = _sim(lay.schedule, lay.pp, lay.microbatches, lay.virtual, lay.recompute, per_action, hops)
    compute = step_units * t_f
    across = sum(1 for b in boundaries(cluster.node_size, lay) if b is not None and b.across)
    units = unit_param_counts(model, lay.sublayer) if lay.sublayer else layers
    dp_comm, link_s, crossing = dp_traffic(cluster, lay, psi, t_f, kept_shares(units, lay))
    step = max(compute + dp_comm, link_s)  # the link carries every collective of the step, one at a time
    if cluster.net_cpu_s_per_gb:
        # the network's CPU work runs while its bytes move: what moves behind compute takes cores from
        # it, what moves while every rank waits runs on idle cores (pipeline hops: behind compute)
        behind = crossing * (1.0 - dp_comm / link_s) if link_s else 0.0
        behind += across * 2 * lay.microbatches * lay.dp * hop_bytes  # each boundary between nodes, both ways
        step += cluster.net_cpu_s_per_gb * behind / 1e9 / (cluster.cores or cluster.gpus)
    # offload: each rank's gradients down, weights up and AdamW on the CPU, priced as exposed
    offload_s = sum(HostLink(cluster.pcie_gbps, cluster.adamw_params_s).step_seconds(updated))
    step += offload_s
    host = peak.host_peak_bytes * min(cluster.node_size, cluster.gpus)  # every rank of a node as the heaviest
    return Estimate(lay, states / GIB, acts / GIB, step, bubble, dp_comm, global_batch * seq_len / step, crossing,
                    host / GIB, offload_s, updated * DEVICE_SAVED / GIB)


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
                    for zero in (0, 1, 2, 3):
                        if dp == 1 and zero:
                            continue
                        modes = [GradReduce.STEP, GradReduce.MICROBATCH] if RULES[zero].sharded_grads and m > 1 else [GradReduce.STEP]
                        for recompute in (False, True):
                            out.extend(Layout(pp, dp, zero, kind, v, mbs, m, recompute, mode, place, hier)
                                       for mode in modes for place in places for hier in two_level[place])
    return out


@dataclass(frozen=True)
class Ranking:
    """A search's answer: the layouts that fit, fastest first, and those it could not weigh or fit."""

    fits: list[Estimate]  # fastest first
    considered: int  # layouts estimated
    skipped: int  # layouts whose simulation did not fit in the budget (the most micro-batches)
    played: int  # budget spent
    # offloaded layouts that fit the devices but not the hosts (`--host-memory`), least host first
    host_short: list[Estimate] = field(default_factory=list)
    # where none fits the devices even offloaded: the offloaded layout nearest to fitting them
    device_short: Estimate | None = None


def sim_actions(lay: Layout) -> int:
    """Actions one simulation of the layout's schedule plays (B and W apart: three a micro-batch)."""
    return lay.pp * lay.microbatches * lay.virtual * (3 if lay.schedule in SPLIT_BACKWARD else 2)


def affordable(layouts: list[Layout], budget: int, fixed_cost: bool, shared_cores: bool) -> tuple[list[Layout], int]:
    """The layouts whose simulations fit in `budget`, cheapest simulation first (layouts sharing one
    are estimated together), and the budget they spend; the rest all play more actions. Layouts of
    one schedule shape share its plays: where an action pays a fixed cost (`fixed_cost`) or a
    pipeline hops between ranks, one a placement (each puts the boundaries on other links), and the
    play of compute alone where there is no such play or ranks share cores (`shared_cores`: how busy
    they are)."""
    by_sim: dict[tuple, list[Layout]] = {}
    for lay in layouts:
        by_sim.setdefault((sim_actions(lay), lay.schedule.value, lay.pp, lay.microbatches, lay.virtual,
                           lay.recompute), []).append(lay)
    chosen, spent = [], 0
    for key in sorted(by_sim):
        priced = len({lay.placement for lay in by_sim[key]}) if fixed_cost or key[2] > 1 else 0
        plays = priced + (1 if shared_cores or not priced else 0)
        cost = key[0] * plays + limits.LAYOUT_COST * len(by_sim[key])
        if spent + cost > budget:
            break
        chosen += by_sim[key]
        spent += cost
    return chosen, spent


def with_options(lay: Layout, cluster: Cluster, weight_bits: int, grad_bits: int, block: int,
                 secondary: bool, in_flight: int = BUCKETS_IN_FLIGHT) -> Layout:
    """`lay` with the run's --quantize-weights / --quantize-grads / --secondary-shard where it has
    what they change (train refuses them where it has none: D = 1, weights at ZeRO-0, a secondary
    shard but for ZeRO-3 layer by layer over 2 or more nodes of 2 or more ranks), and the run's
    --buckets-in-flight."""
    rules = RULES[lay.zero]
    split = dp_split(cluster.node_size, lay.pp, lay.dp, lay.placement)
    hpz = secondary and rules.sharded_params and lay.pp == 1 and split is not None and min(split) > 1
    return replace(lay, weight_bits=weight_bits if lay.dp > 1 and rules.gathers_weights else 0,
                   grad_bits=grad_bits if lay.dp > 1 else 0, quant_block=block, secondary=hpz, in_flight=in_flight)


# `plan --compress auto` proposes int8 traffic only where it saves at least this share of a step: the
# quantization costs held-out loss (0.1-0.3% at int8 on the cluster bench, more at int4, which is not proposed)
COMPRESS_GAIN = 0.05


def compressed(lay: Layout, cluster: Cluster, quant_block: int) -> Layout | None:
    """`lay` with every option that has something to compress in it, at int8 (weight gathers,
    gradient reductions, hpZ where it applies), or None where none has."""
    out = with_options(lay, cluster, 8, 8, quant_block, True)
    return None if (out.weight_bits, out.grad_bits, out.secondary) == (0, 0, False) else out


def proposed(estimates: list[Estimate]) -> list[Estimate]:
    """Of each layout and its compressed twin, the twin where it is at least `COMPRESS_GAIN` faster
    (or where only the twin fits), else the layout as it is."""
    groups: dict[Layout, list[Estimate]] = {}
    for e in estimates:
        groups.setdefault(replace(e.layout, weight_bits=0, grad_bits=0, secondary=False), []).append(e)
    out = []
    for plain, group in groups.items():
        as_is = next((e for e in group if e.layout == plain), None)
        twin = min((e for e in group if e.layout != plain), key=lambda e: e.step_time_s, default=None)
        wins = twin is not None and (as_is is None or twin.step_time_s <= as_is.step_time_s * (1 - COMPRESS_GAIN))
        out.append(twin if wins else as_is)  # type: ignore[arg-type]
    return out


def plan_within(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, weight_bits: int = 0,
                grad_bits: int = 0, quant_block: int = 256, secondary: bool = False,
                budget: int | None = None, propose: bool = False, offload: bool = False,
                in_flight: int = BUCKETS_IN_FLIGHT) -> Ranking:
    """Layouts that fit, fastest first, estimating only what `budget` (limits.PLAN_BUDGET) allows;
    every layout with the given quantization of its traffic (bits 0: none) and secondary shard
    where it has them. `propose`: each layout also with int8 traffic and hpZ where they apply
    (`compressed`), kept where that twin is `COMPRESS_GAIN` faster (`proposed`). `offload`: where
    few fit, the layouts that do not also with the optimizer offloaded (`offloaded`). `in_flight`: the
    run's --buckets-in-flight, every layout's."""
    layouts = [with_options(lay, cluster, weight_bits, grad_bits, quant_block, secondary, in_flight)
               for lay in candidate_layouts(model, cluster, global_batch)]
    # a fixed cost an action, or a pipeline's hops, make more simulations of each schedule (estimate)
    chosen, spent = affordable(layouts, limits.PLAN_BUDGET if budget is None else budget, cluster.overhead_s > 0,
                               bool(cluster.cores))
    weighed = len(chosen)
    if propose:  # each twin shares its layout's simulations: the same layouts are weighed, each twice at most
        chosen += [c for lay in chosen if (c := compressed(lay, cluster, quant_block)) is not None]
    limit = cluster.gpu_memory_gib * cluster.headroom
    tried = [estimate(model, seq_len, global_batch, cluster, lay, limit) for lay in chosen]  # None: over the limit
    fits = [e for e in tried if e is not None and e.memory_gib <= limit]
    misses = []
    if len(fits) < limits.MEMORY_CUT_RANK:  # memory cuts try the misses nearest to fitting: their whole figures
        misses = [e if e is not None else estimate(model, seq_len, global_batch, cluster, lay)
                  for lay, e in zip(chosen, tried) if e is None or e.memory_gib > limit]
    fits += cut_by_memory(model, cluster, seq_len, global_batch, fits, misses)
    short: list[Estimate] = []
    nearest = None
    if offload and not cluster.cpu and misses:  # misses: where fewer than MEMORY_CUT_RANK fit
        more, short, nearest = offloaded(model, cluster, seq_len, global_batch, misses)
        fits += more
    if propose:
        fits = proposed(fits)
    fits.sort(key=lambda e: (e.step_time_s, e.memory_gib))
    return Ranking(fits, weighed, len(layouts) - weighed, spent, short, nearest)


def offloaded(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int,
              misses: list[Estimate]) -> tuple[list[Estimate], list[Estimate], Estimate | None]:
    """The layouts of `misses` (each over the devices' memory as it is) with --offload optimizer
    (memory/offload.py): (those that then fit the devices and the hosts; those that fit the devices
    only, least host memory first; where none fits the devices, the one nearest to). Tried only
    where fewer than `limits.MEMORY_CUT_RANK` layouts fit as they are: offload takes AdamW's 8
    bytes an updated parameter off the device and adds host copies and a CPU step to every step,
    so where enough layouts fit without it the fastest of them are faster. A node's host holds
    its ranks' masters, moments and gradient staging, 16 bytes an updated parameter, within the
    same share (`headroom`) of its memory as a GPU."""
    limit = cluster.gpu_memory_gib * cluster.headroom
    host_limit = cluster.host_memory_gib * cluster.headroom
    fits, short = [], []
    for miss in misses:
        e = estimate(model, seq_len, global_batch, cluster, replace(miss.layout, offload=True), limit)
        if e is None or e.memory_gib > limit:
            continue
        (fits if e.host_gib <= host_limit else short).append(e)
    nearest = None
    if not fits and not short:  # the least device memory the plain layouts need, offloaded
        least = min(misses, key=lambda e: e.memory_gib).layout
        nearest = estimate(model, seq_len, global_batch, cluster, replace(least, offload=True))
    return fits, sorted(short, key=lambda e: (e.host_gib, e.step_time_s)), nearest


def cut_by_memory(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, fits: list[Estimate],
                  misses: list[Estimate]) -> list[Estimate]:
    """Where fewer than `limits.MEMORY_CUT_RANK` layouts fit: pipelined layouts that do not fit with
    uniform cuts but do with `--partition memory` (memory/partition.py), while the searches'
    memory-model walks stay within `limits.MEMORY_CUT_WALKS`. Balancing moves activations off the
    ranks with most micro-batches in flight, so candidates go nearest to fitting first once half
    their activations are taken off (an order, not a bound). Memory cuts give the first rank fewer
    blocks and the last more, so each is estimated again (its step time paced by the rank with
    most blocks): where enough layouts fit with uniform cuts the fastest of them are faster than
    these (7b on 64 x 80 GiB: 17 more fit, none among the fastest ten, at several times the
    planner's time), so none is searched."""
    if len(fits) >= limits.MEMORY_CUT_RANK:
        return []
    limit = cluster.gpu_memory_gib * cluster.headroom
    near = sorted((e for e in misses if e.layout.pp > 1), key=lambda e: e.memory_gib - e.activations_gib / 2)
    out, walks = [], {}  # walks of each search (candidates differing only in placement share one)
    for e in near:
        if sum(walks.values()) >= limits.MEMORY_CUT_WALKS:
            break
        lay = replace(e.layout, partition=Partition.MEMORY)
        shape = (lay.pp, lay.dp, lay.zero, lay.schedule, lay.virtual, lay.micro_batch, lay.microbatches, lay.recompute,
                 lay.grad_reduce)
        if shape not in walks:
            walks[shape] = balanced_layout(model, seq_len, lay, cluster.wire_bytes == 2, not cluster.cpu,
                                           cluster.bucket_mb).walks
        est = estimate(model, seq_len, global_batch, cluster, lay)
        if est.memory_gib <= limit:
            out.append(est)
    return out


def plan(model: ModelConfig, cluster: Cluster, seq_len: int, global_batch: int, weight_bits: int = 0,
         grad_bits: int = 0, quant_block: int = 256, secondary: bool = False) -> tuple[list[Estimate], int]:
    """Layouts that fit, fastest first, and how many were considered (within limits.PLAN_BUDGET)."""
    result = plan_within(model, cluster, seq_len, global_batch, weight_bits, grad_bits, quant_block, secondary)
    return result.fits, result.considered


def reason(best: Estimate, e: Estimate, cluster: Cluster) -> str:
    free = cluster.gpu_memory_gib * cluster.headroom - e.memory_gib
    parts = [f"bubble {e.bubble:.1%}", f"{free:.1f} GiB to spare"]
    if e.dp_comm_s >= 5e-4:  # shown in whole milliseconds
        parts.append(f"DP traffic not hidden {e.dp_comm_s * 1e3:.0f} ms")
    if e.layout.recompute:
        parts.append("recompute buys memory for ~1/3 more compute")
    if e.layout.hierarchical:
        parts.append("gradients reduced inside each node first")
    quantized = [f"{what} int{bits}" for what, bits in (("weights", e.layout.weight_bits), ("gradients", e.layout.grad_bits))
                 if bits]
    if quantized:
        parts.append(f"{' and '.join(quantized)} on the wire")
    if e.layout.secondary:
        parts.append("ZeRO-3's later gathers inside the node")
    if e.layout.partition is Partition.MEMORY:
        parts.append("--partition memory: fits only with memory-balanced cuts; the rank with most blocks "
                     "paces the step")
    if e.layout.grad_reduce is GradReduce.MICROBATCH:
        parts.append(f"gradients reduced each micro-batch: sharded memory, {e.layout.microbatches}x traffic")
    if e.layout.offload:
        parts.append(f"optimizer offloaded: without it {e.memory_gib + e.saved_gib:.1f} GiB a GPU, over "
                     f"{cluster.gpu_memory_gib * cluster.headroom:.1f}; host {e.host_gib:.1f} GiB a node of "
                     f"{cluster.host_memory_gib:g}; host copies and CPU AdamW add {e.offload_s:.2f} s a step")
    if e is not best:
        parts.append(f"{e.step_time_s / best.step_time_s - 1:+.1%} vs best")
    return ", ".join(parts)


def nearby_world_sizes(layers: int, global_batch: int, gpus: int) -> str:
    """World sizes nearest `gpus` that split into some pp x dp (pp at most `layers`, dp dividing the
    global batch, within limits.GPUS), for the error message; empty when there are none. Taken from
    those products, not by scanning counts (a scan down from --gpus 2^30 ran for minutes)."""
    counts = {pp * dp for pp in range(1, layers + 1) for dp in divisors(global_batch) if pp * dp in limits.GPUS}
    below, above = max((n for n in counts if n < gpus), default=None), min((n for n in counts if n > gpus), default=None)
    return " or ".join(str(n) for n in (below, above) if n)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
