"""ZeRO-3 layer by layer: how many layers ahead to start a layer's gather (`--zero3-prefetch auto`).

A deeper prefetch costs a layer of gathered weights a layer of depth (memory/model.py) and hides a
gather only where the link has idled before it: a forward's layers start their gathers when the
layer `depth` before them starts, a backward's when the layer `depth` after them starts its
backward, and one link carries the gathers and a fused backward's reductions in the order they are
issued. When the link is slower than compute everywhere, depth 1 already keeps it busy and more
buys nothing; when small layers (the embedding, a vocabulary-256 head) sit beside blocks, or the
reductions share the link in backward, the link idles and a deeper prefetch fills it. So the depth
is measured, not guessed: `exposed` plays one forward and one reducing fused backward of a chunk
moment by moment, with the program's own steps (schedules/layer_plan.py) at each depth, its
waits where the program places them (a gather started and waited for at once, or a prefetch's
WAIT at the moment its layer computes; the forward keeping the backward's first depth - 1 layers
gathered, as the program does), and
`choose_depth` takes the smallest depth past which the exposed time stops improving (no deeper one
hides more than `TOLERANCE` of it, or `FLOOR_S`), within a memory limit. Keeping layers across
actions saves their gathers outright, so on a slow link the deepest that fits often wins.

The play is the planner's model, like planner/overlap.py's closed forms: compute and each collective
take their FLOP and byte times; gathers and reductions share one link in issue order (one gloo or
NCCL stream a group); a reduction starts when its bucket's gradients are complete and, with the
runtime's one bucket in flight (train --buckets-in-flight), the backward waits for the one before
it; the last backward waits for its reductions at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipezero.config import Device, DType, ModelConfig, TrainConfig, WeightQuant, Zero3Unit
from pipezero.errors import ConfigError
from pipezero.models.presets import block_params, unit_param_counts
from pipezero.schedules.actions import Op
from pipezero.schedules.bucket_plan import LayerUse
from pipezero.schedules.compile import layerwise
from pipezero.schedules.layer_plan import Moment, first_needed, moments, steps
from pipezero.schedules.zero_rules import RULES
from pipezero.planner.layouts import Cluster, Layout
from pipezero.planner.traffic import collective_s, element_bytes

TOLERANCE = 0.02  # a deeper prefetch that saves less than this share of the exposed time "stops improving"
FLOOR_S = 1e-3  # nor less than this a micro-batch
UNIT_GAIN = 0.1  # `plan` proposes --zero3-unit sublayer where it exposes at least this share less (plan_choice)
MAX_DEPTH = 8  # deeper than this hid nothing more in any play (a layer's gather behind 8 layers' compute)


@dataclass(frozen=True)
class LayerCost:
    """One layer of a chunk, one micro-batch: its forward's seconds (backward: `backward_factor` x),
    its bucket's gather and gradient reduction on the link (0 for a layer with nothing to train)."""

    forward_s: float
    gather_s: float
    reduce_s: float = 0.0


@dataclass(frozen=True)
class Choice:
    depth: int
    why: str  # one short phrase, for `plan` and summary.json
    exposed_s: tuple[float, ...]  # the play's exposed seconds at depth 1, 2, ... (as far as tried)
    unit: Zero3Unit = Zero3Unit.LAYER  # what the depth counts (`plan` weighs both: plan_choice)


def exposed(layers: Sequence[LayerCost], depth: int, backward_factor: float = 2.0, in_flight: int = 1) -> float:
    """Seconds one forward and one reducing fused backward of a chunk of `layers` (model order) wait
    on the link, gathering each layer `depth` ahead (module docstring)."""
    uses = [LayerUse(i, i if c.gather_s or c.reduce_s else None) for i, c in enumerate(layers)]
    owners = [u for u in uses if u.bucket is not None]
    t = link = 0.0
    ready: dict[int, float] = {}
    reductions: list[float] = []

    def on_link(start: float, seconds: float) -> float:
        nonlocal link
        link = max(start, link) + seconds
        return link

    kept = frozenset(first_needed(Op.BW, uses, True, depth - 1))  # the forward keeps them for the backward
    for op in (Op.F, Op.BW):
        through = op is Op.BW
        grads = [u.bucket for u in reversed(owners)] if through else []
        placed = steps(op, uses, through, depth=depth, held=kept if through else (), keep=() if through else kept)
        for m in moments(op, uses, through, grads):
            for st in [s for s in placed if s.at == m]:
                if st.gather and st.started:
                    ready[st.bucket] = on_link(t, layers[st.bucket].gather_s)
                if st.gather and st.wait:  # the program's waits: a gather started here, or a prefetch's WAIT
                    t = max(t, ready[st.bucket])
            if m.moment in (Moment.FORWARD, Moment.BACKWARD):
                t += layers[m.index].forward_s * (backward_factor if through else 1.0)
            elif m.moment is Moment.GRADS:
                reductions.append(on_link(t, layers[m.index].reduce_s))
                if len(reductions) > in_flight:
                    t = max(t, reductions[-1 - in_flight])
        if through and reductions:
            t = max(t, reductions[-1])
    compute = sum(c.forward_s for c in layers) * (1.0 + backward_factor)
    return max(0.0, t - compute)


def choose_depth(layers: Sequence[LayerCost], fits: Callable[[int], bool] = lambda d: True,
           backward_factor: float = 2.0, in_flight: int = 1) -> Choice:
    """The smallest depth past which no deeper one hides more than `TOLERANCE` of the exposed time
    at depth 1, among those memory allows (`fits(depth)`: tried from shallow to deep, up to the
    first that does not fit) and the chunk has layers to prefetch."""
    deepest = max(1, min(MAX_DEPTH, sum(1 for c in layers if c.gather_s) - 1))
    times = [exposed(layers, 1, backward_factor, in_flight)]
    capped = False
    for depth in range(2, deepest + 1):
        if not fits(depth):
            capped = True
            break
        times.append(exposed(layers, depth, backward_factor, in_flight))
    best = min(times)
    depth = next(d for d, t in enumerate(times, 1) if t <= best + max(TOLERANCE * times[0], FLOOR_S))
    said = f"exposed {_ms(times[depth - 1])} a micro-batch, {_ms(times[0])} at depth 1"
    if capped and depth == len(times):
        return Choice(depth, f"memory: depth {depth + 1} would not fit ({said})", tuple(times))
    return Choice(depth, f"deeper hides no more ({said})", tuple(times))


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms"


def layer_seconds(model: ModelConfig, micro_batch: int, seq_len: int, tflops: float,
                link_s: Callable[[float, str], float], sublayer: bool = False) -> list[LayerCost]:
    """Each layer of `model` (embedding, blocks, head) for a micro-batch of `micro_batch` sequences of
    `seq_len` tokens: its forward at
    `tflops` achieved TFLOP/s (a block's matmuls and attention, the head's projection; the
    embedding's lookup none), counted as the planner counts them (planner/search.py), and its gather
    and reduction: `link_s(parameters, "all_gather" | "reduce_scatter")` seconds. `sublayer`: a
    block is two units, its attention (the scores' FLOPs with it) and its MLP, each with its norm."""
    tokens = micro_batch * seq_len
    scores = 4.0 * seq_len * tokens * model.dim
    block = 2.0 * (block_params(model) - 2 * model.dim) * tokens + scores
    flops = [0.0] + [block] * model.n_layers + [2.0 * model.vocab_size * model.dim * tokens]
    counts = unit_param_counts(model, sublayer)
    if sublayer:
        attention, mlp = counts[1:3]  # each with its norm's dim weights, which do no matmul
        split = [2.0 * (attention - model.dim) * tokens + scores, 2.0 * (mlp - model.dim) * tokens]
        flops = flops[:1] + split * model.n_layers + flops[-1:]
    return [LayerCost(f / (tflops * 1e12), link_s(n, "all_gather"), link_s(n, "reduce_scatter"))
            for f, n in zip(flops, counts)]


def run_choice(cfg: TrainConfig, fits: Callable[[int], bool] = lambda d: True) -> Choice:
    """`zero3_prefetch = auto` for a run: its model's layers at `parallel.tflops` (or the device's
    default) on `parallel.link_gbps`, no deeper than `fits` (the memory model within
    `run.gpu_memory_gib`: memory/model.py `prefetch_choice`). The same on every rank: it reads only the
    configuration."""
    p, m = cfg.parallel, cfg.model
    if not RULES[p.zero].sharded_params or p.dp == 1 or not layerwise(p):
        return Choice(1, "no layer-by-layer ZeRO-3 gathers to prefetch", ())
    if p.link_gbps is None:
        raise ConfigError("--zero3-prefetch auto chooses for a link: give --link-gbps (GB/s a rank's data-parallel "
                          "traffic gets between nodes), or a depth like --zero3-prefetch 2")
    tflops = p.tflops or (445.0 if cfg.run.device is Device.CUDA else 0.05)
    wire = 2 if cfg.run.dtype is DType.BF16 else 4
    width = element_bytes(8, p.quant_block) if p.quantize_weights is WeightQuant.INT8 else wire
    grads = element_bytes(int(p.quantize_grads.value[3:]), p.quant_block) if p.quantize_grads.value != "none" else wire
    share = (p.dp - 1) / p.dp / (p.link_gbps * 1e9)
    layers = layer_seconds(m, p.micro_batch_size, cfg.data.seq_len, tflops,
                         lambda n, kind: n * (width if kind == "all_gather" else grads) * share,
                         p.zero3_unit is Zero3Unit.SUBLAYER)
    return choose_depth(layers, fits, 3.0 if p.recompute else 2.0, p.buckets_in_flight)


def plan_choice(model: ModelConfig, seq_len: int, cluster: Cluster, lay: Layout, spare_bytes: float) -> Choice | None:
    """`pipezero plan`'s unit and depth for a layout that gathers ZeRO-3 layer by layer (P = 1), None
    for any other: compute at the cluster's achieved FLOP/s (shared cores slow it as in
    planner/search.py), the collectives as planner/traffic.py prices them, each unit deeper holding one
    more of the largest units in fp32, within `spare_bytes` of the memory limit. A block's attention
    and MLP apart (`sublayer`) where that exposes at least `UNIT_GAIN` less than whole layers: where
    the link keeps up with the blocks, what is left exposed is the step's first gather and last
    reduction, and a part's are smaller; where it does not, a unit deep looks half as far ahead."""
    if not RULES[lay.zero].sharded_params or lay.pp > 1 or lay.dp == 1:
        return None
    share = max(1.0, cluster.gpus / cluster.cores) if cluster.cores else 1.0
    width = element_bytes(lay.weight_bits, lay.quant_block) if lay.weight_bits else cluster.wire_bytes
    grads = element_bytes(lay.grad_bits, lay.quant_block) if lay.grad_bits else cluster.wire_bytes
    choices = []
    for unit in Zero3Unit:
        split = unit is Zero3Unit.SUBLAYER
        layers = layer_seconds(model, lay.micro_batch, seq_len, cluster.tflops * cluster.mfu / share,
                             lambda n, kind: collective_s(cluster, lay, n * (width if kind == "all_gather" else grads))[kind],
                             split)
        largest = sorted(unit_param_counts(model, split), reverse=True)
        c = choose_depth(layers, lambda d: 4 * sum(largest[:d - 1]) <= spare_bytes, 3.0 if lay.recompute else 2.0)
        choices.append(replace(c, unit=unit))
    whole, parts = choices
    if min(parts.exposed_s) <= min(whole.exposed_s) * (1 - UNIT_GAIN) - FLOOR_S:
        return replace(parts, why=f"{parts.why}; whole layers {_ms(min(whole.exposed_s))}")
    return whole
