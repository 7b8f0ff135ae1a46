"""Each rank's memory over one training step, predicted from the plan alone (no torch): the lowered
program (schedules/program.py) is walked instruction by instruction and every buffer it creates or
frees is added to or taken from its category, so what a schedule keeps alive (micro-batches in
flight, split backward's stash for W, ZeRO-3's gathered chunks, buckets waiting on a reduction,
sends not yet waited for) follows from the order of the instructions rather than from formulas.

Categories (bytes on one rank):
- params: the fp32 flat buckets (ZeRO-3: this rank's master shards only); pipezero keeps fp32
  weights whatever --dtype says (zero/accounting.py);
- gathered: ZeRO-3's full parameters while a chunk (or a layer) is gathered;
- grads: fp32 gradient buckets (ZeRO-0/1: whole, from the chunk's first backward on; ZeRO-2/3: a
  full bucket from its first gradient to its reduction, then this rank's shard);
- optimizer: AdamW's two fp32 moments over what the rank updates (whole buckets at ZeRO-0; on the
  host with --offload optimizer, below), and the step's fp64 norm of one bucket;
- activations: what autograd saves in forward for each micro-batch in flight (recompute: each
  block's input, and the embedding's and the head's own), a split chunk's records of its weight ops for B, split
  backward's (x, dy) stash from B to W, and the transient inside an action, followed layer by
  layer where it matters (a backward rerunning each block's forward, a split B, a ZeRO-2/3 backward whose
  buckets fill and leave reduced as the layers behind it free their activations);
- p2p: receive buffers posted ahead of use, and sends, which gloo and NCCL hold until the step's
  end waits for them (an activation's send is the chunk's output itself, moved here from
  `activations` when it is sent);
- collectives: a reduction's buffers while in flight: the low-precision wire copy, the
  reduce-scatter's output shard and, on gloo at D > 2, the other members' slices received; with
  quantized traffic (memory/quantized.py) a reduction's or a gather's messages sent and
  received until it is waited for, and its wait's fp32 decode;
- batch: the step's token batch and the held-out windows (every rank holds both whole: its share is
  a view of them).

Where each byte lives (`WHERE`): the categories above are the device's (a CPU rank's device is the
host itself). With --offload optimizer (memory/offload.py) the rank's update moves to the host: for
every element it updates (ZeRO-0: its whole padded buckets; ZeRO-1 to 3: its shard of each) the
host holds, from the run's start to its end, the fp32 master copy (`host_master`), AdamW's two
moments (`host_optimizer`) and the staging buffer each reduced gradient is copied into
(`host_grads`): 16 bytes an element; the device's `optimizer` keeps only the gradient norm's
transient. With --offload-activations the micro-batches the program offloads hold their saved
tensors on the host between OFFLOAD_ACT and RELOAD_ACT (`host_activations`: the most at once). A
rank's `peak_bytes` is its device peak; `host_peak_bytes` the host bytes of pipezero's own buffers
(those: nothing else pipezero allocates on the host is counted, nor the interpreter, torch, or the
data loader).

Phases (each rank's peak is the most of them; `RankMemory.phases`):
- train: the first training step, walked instruction by instruction (above);
- eval: the held-out evaluation after a step, from the state the step leaves: its own forward-only
  program (schedules/forward_only.py, played by runtime/executor.evaluate); each chunk's output
  sent on is held by its send until LOSS_SUM waits for them all (`eval_batches` x M micro-batches
  of them), ZeRO-3 gathers what the program gathers;
- sample: the end-of-run text sample (engine.end_sample; only without a pipeline): one forward of
  the whole model over the window, batch 1, fp32 (outside autocast), its length growing to the
  prompt and the sampled tokens, on rank 0 (ZeRO-3 layer by layer: every rank, gathering as it
  goes; kept gathered: every rank gathers the whole model, rank 0 computes).

Per-layer bytes count what the built-in Llama's autograd keeps (models/llama.py), per token:
a block saves its RMSNorm outputs, q, k, v before and after rotation, attention's output and its
contiguous copy, the residual sum and SwiGLU's four hidden tensors (8·dim + 3·kv + 4·hidden
elements, plus fp32 statistics); the head its two normed tensors, log-softmax (vocab elements,
fp32) and the targets.
Under bf16 autocast (a bf16 residual stream) linears keep bf16 copies of their weights per
micro-batch and the norms run in fp32, keeping their input upcast and their output; autocast's
cast cache is off (runtime/autocast.py), so a forward without autograd (an evaluation) holds one
weight's bf16 copy at a time. Other models (own
specs) are estimated with the block formula of their dims.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import accumulate
from typing import TYPE_CHECKING

from pipezero.config import (BUCKETS_IN_FLIGHT, DataConfig, Device, DType, GradReduce, ModelConfig, Offload, Packing,
                             ParallelConfig, RunConfig, ScheduleKind, TrainConfig)
from pipezero.models.presets import decoder_shapes, ffn_dim, layer_costs, layer_param_counts
from pipezero.parallel.partition import cut_bounds
from pipezero.schedules.actions import Op
from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.compile import compile_plan, wires_of
from pipezero.schedules.forward_only import lower_evaluation
from pipezero.schedules.model_shapes import ModelShapes
from pipezero.schedules.program import (ActivationCopy, Compute, DataParallel, Kind, OptimStep, PointToPoint, Program,
                                       in_flight_of)
from pipezero.schedules.zero_rules import RULES
from pipezero.schedules.limits import FIT_MARGIN
from pipezero.schedules.wire import FP32, WireFormat
from pipezero.memory.offload import host_bytes
from pipezero.planner.prefetch import Choice, run_choice
from pipezero.memory.quantized import decoded, gather_flight, reduction_flight, reduction_wait

if TYPE_CHECKING:
    from pipezero.planner.layouts import Layout

CATEGORIES = ("params", "gathered", "grads", "optimizer", "activations", "p2p", "collectives", "batch")
HOST_CATEGORIES = ("host_master", "host_optimizer", "host_grads",  # --offload optimizer's (memory/offload.py)
                   "host_activations")  # --offload-activations: most micro-batches' saved tensors there at once
DEVICE, HOST = "device", "host"
WHERE: dict[str, str] = {**dict.fromkeys(CATEGORIES, DEVICE), **dict.fromkeys(HOST_CATEGORIES, HOST)}
PHASES = ("train", "eval", "sample")
F32 = 4
SAMPLE_PROMPT = "def "  # engine.end_sample's prompt


@dataclass(frozen=True)
class Shapes:
    """What the per-layer activation bytes depend on."""

    dim: int
    q: int  # heads x head dim
    kv: int  # kv heads x head dim
    heads: int
    hidden: int  # SwiGLU's
    vocab: int
    tokens: int  # B x T of one micro-batch
    act: int  # bytes an activation element (4 fp32, 2 under bf16 autocast)

    @classmethod
    def of(cls, m: ModelConfig, micro_batch: int, seq_len: int, dtype: DType) -> "Shapes":
        hd = m.head_dim or m.dim // m.n_heads
        return cls(m.dim, m.n_heads * hd, (m.n_kv_heads or m.n_heads) * hd, m.n_heads, ffn_dim(m), m.vocab_size,
                   micro_batch * seq_len, 2 if dtype is DType.BF16 else F32)


@dataclass(frozen=True)
class LayerBytes:
    """One layer for one micro-batch: `held` from its F to its backward (its output included, its
    input not: that is the layer before's output), `stash` what split backward keeps from B to W,
    and the extra bytes alive for a moment inside forward and backward."""

    held: int
    stash: int  # of which `stash_new` is B's output gradients; the rest (inputs x) is part of `held`
    forward_extra: int
    backward_extra: int
    stash_new: int = 0
    recorded: int = 0  # a split chunk's forward also keeps every weight op's output for B (records)
    # under --recompute a block's forward saves nothing (runtime/recompute.py): the most bytes alive
    # at once inside its forward, its input aside
    forward_live: int = 0
    # W from B's stash (runtime/weight_grad.py), one weight op at a time: a norm recomputes its
    # normalised input in fp32 and multiplies it by dy (two activation-sized fp32 tensors); a
    # linear makes its weight's gradient (fp32, after a bf16 product under autocast)
    w_extra: int = 0
    # what split backward's B frees as it goes: the tensors autograd saved that no weight op's
    # record (x, y) also holds; the recorded ones live until B returns
    b_freed: int = 0
    # a forward without autograd (an evaluation) where it holds less than `forward_live` (0: the same)
    nograd_live: int = 0


def layer_bytes(s: Shapes, index: int, n_layers: int, linear_params: int) -> LayerBytes:
    """Index 0 is the embedding, n_layers + 1 the head, the rest blocks (models/llama.py)."""
    n, a, d = s.tokens, s.act, s.dim
    if index == 0:  # the gathered rows are its output; the token ids are the batch's
        return LayerBytes(n * d * a, 0, 0, 0, forward_live=n * d * a)  # W of the first chunk is a full backward
    if index == n_layers + 1:
        logits = n * s.vocab * a
        logsm = n * s.vocab * F32  # cross-entropy's log-softmax, in fp32
        upcast = n * s.vocab * F32 if a != F32 else 0  # logits.float() under bf16
        weights = linear_params * 2 if a != F32 else 0
        # the norm's normalised input (for its weight's gradient) and its output (the projection's
        # input), rms statistics, log-softmax, the targets (int64) and the loss's total weight
        held = 2 * n * d * a + n * F32 + logsm + weights + n * 8 + F32
        if a != F32:  # autocast runs the norm in fp32: it keeps its input upcast and its output in
            # fp32, the projection its input cast back, and the norm's weight rounded to the input's
            held = 2 * n * d * F32 + n * F32 + d * a + n * d * a + logsm + weights + n * 8 + F32
        new = n * d * a + logits  # dy of the norm and of the projection (vocab wide)
        # W's x: the head's input (the layer before's output) and the norm's output
        # backward: log-softmax's gradient and the logits' at once; then the logits' gradient and
        # the projection's weight gradient
        backward = max(2 * logsm, logsm + linear_params * F32)
        return LayerBytes(held, 2 * n * d * a + new, logits + upcast, backward, new, logits,
                          forward_live=2 * n * d * a + logits + upcast + logsm,
                          w_extra=max(2 * n * d * F32, linear_params * (F32 + (a if a != F32 else 0))),
                          b_freed=held - n * d * a,  # all but the norm's output (the projection's x)
                          # without autograd: the normed input and the logits (the loss is the chunk's
                          # caller's: ChunkBytes.eval_loss)
                          nograd_live=n * d * a + logits)
    rot = F32 if a != F32 else a  # rotation computes in fp32
    held = n * a * (6 * d + 2 * s.kv + 4 * s.hidden) + n * rot * (s.q + s.kv) + n * F32 * (2 + s.heads)
    held += n * a * (s.q - d)  # q-width tensors (wide heads) beside dim-width ones
    held += n * a * d  # the MLP's linears keep their input flattened to (B·T, dim) as well
    if a != F32:  # counted on autograd's saved tensors of a block under bf16 autocast
        # each norm runs in fp32 (its input upcast, its output, the statistics) and the linear
        # after it keeps the output cast back; q, k, v and attention's output (rotation keeps no
        # fp32 copy: it multiplies by the constant tables), attention's output copied for wo,
        # SwiGLU's gate, up, silu(gate) and product, the output, the weights' bf16 copies
        held = (2 * (2 * n * d * F32 + n * F32) + n * a * (3 * d + 3 * s.q + 2 * s.kv + 4 * s.hidden)
                + n * F32 * s.heads + linear_params * 2 + 2 * d * a)
    # W's (x, dy) of the two norms, four attention and three MLP linears: the x are the block's
    # input (the layer before's output, kept past B by the stash), its two normed tensors,
    # attention's output, the residual sum and SwiGLU's product; every dy is new
    new = n * a * (4 * d + s.q + 2 * s.kv + 2 * s.hidden)
    stash = n * a * (4 * d + s.q + s.hidden) + new
    # recorded and saved by autograd alike (kept through B): the first normed tensor, v, attention's
    # output, the residual sum, the second normed tensor, gate, up and their product, and the
    # block's output (the next layer's input)
    b_freed = held - n * a * (4 * d + s.q + s.kv + 3 * s.hidden)
    # backward of one block, beyond what it holds (measured on the profiler's events): SwiGLU's
    # down projection's input gradient and the two it splits into (gate's and up's) are alive while
    # its saved product is already freed, two hidden-wide tensors net; or a weight gradient (before
    # autograd accumulates it) with the input gradient computed beside it
    backward = max(2 * n * a * s.hidden, d * s.hidden * F32 + n * a * (s.hidden + d))
    # a split chunk's forward records each weight op's output for B: beyond what autograd keeps,
    # q and k before rotation and the two projections back into the residual stream
    recorded = n * a * (s.q + s.kv + 2 * d)
    # a forward that saves nothing (recompute's): SwiGLU's gate, up and product at once beside the
    # residual stream, its normed copy and the attention branch's output
    live = n * a * (3 * s.hidden + 3 * d)
    w = max(2 * n * d * F32, max(d * s.hidden, d * s.q) * (F32 + (a if a != F32 else 0)))
    return LayerBytes(held, stash, n * a * s.hidden, backward, new, recorded, live, w, b_freed)


@dataclass(frozen=True)
class ChunkBytes:
    held: int  # one micro-batch from F to its backward
    stash: int  # from B to W (split backward)
    stash_new: int  # of which created by B (the rest was held)
    forward_peak: int  # extra inside F
    backward_peak: int  # extra inside B / BW / W
    recompute_held: int  # with --recompute: the chunk's input, each block's output, the embedding's and head's own
    recompute_forward: int  # with --recompute: extra inside F (`recompute_forward`)
    recompute_backward: int  # with --recompute: extra inside a backward (see `recompute_moments`)
    recompute_b: int  # with --recompute: extra inside a B, which retains the graph for W
    recorded: int  # with split backward: the weight ops' outputs F records for B (not with recompute)
    w_peak: int  # extra inside a W from B's stash
    b_peak: int  # extra inside a split B (see `split_b_peak`)
    # a full backward's course, layer by layer from the last: (parameters whose gradients exist by
    # then, bytes beyond what the chunk held before it), without and with recompute
    moments: tuple[tuple[int, int], ...] = ()
    recompute_moments: tuple[tuple[int, int], ...] = ()
    # extra inside a forward without autograd: the most one layer holds at once, under bf16 autocast
    # beside the bf16 copy of the weight it multiplies by (cast as used: runtime/autocast.py)
    eval_forward: int = 0
    eval_loss: int = 0  # the last chunk's, after its forward: the logits (upcast) beside log-softmax


@dataclass(frozen=True)
class MemoryPlan:
    """Everything the walk needs for one layout, torch-free."""

    program: Program  # one replica's (D = 1) programs: every data-parallel rank of a stage holds alike
    dp: int
    buckets: BucketPlan  # each chunk's buckets, padded for D
    chunk_params: tuple[tuple[int, ...], ...]  # per chunk, per layer parameter counts
    layer_bounds: tuple[tuple[int, int], ...]
    shapes: Shapes
    recompute: bool
    layerwise: bool
    in_flight: int  # the program's REDUCE_GRADs' bound on reductions in flight (program.py `in_flight_of`)
    batch_bytes: int  # the step's tokens on one rank
    wire: int  # bytes an element of gradient reductions and ZeRO-3 gathers
    gloo: bool  # CPU ranks: gloo's reduce-scatter reduces a full copy of the bucket, then keeps a shard
    eval_microbatches: int = 0  # an evaluation's micro-batches on a rank (eval_batches x M; 0: none)
    eval_bytes: int = 0  # the held-out windows, alive the whole run
    sample_len: int = 0  # the text sample's longest window (0: no sample)
    seq_len: int = 0  # a training sequence's tokens (the rotary tables' length before the sample)
    depth: int = 1  # layer by layer: layers a gather starts ahead of its use (--zero3-prefetch)
    grad_quant: WireFormat | None = None  # --quantize-grads: reductions travel as messages (D > 1)
    weight_quant: WireFormat | None = None  # --quantize-weights: gathers travel as messages (D > 1)
    # --secondary-shard node: ranks a node whose share of each bucket a rank keeps (0: none); where
    # the node's size is not set (torchrun's, known only to the ranks) 2, the least it can be
    secondary: int = 0
    offload: bool = False  # --offload optimizer: masters, moments and a gradient staging copy on the host


@dataclass
class RankMemory:
    rank: int
    peak_bytes: int = 0
    categories: dict[str, int] = field(default_factory=dict)  # at the peak
    at: str = ""  # the instruction at which the peak is reached
    timeline: list[tuple[int, dict[str, int]]] = field(default_factory=list)  # (instruction, live) after each
    totals: list[tuple[str, int]] = field(default_factory=list)  # with the timeline: (instruction, total) each
    phases: dict[str, int] = field(default_factory=dict)  # train, eval, sample: each phase's peak
    # host bytes of pipezero's own buffers (HOST_CATEGORIES), alive the whole run: their sum is the peak
    host_categories: dict[str, int] = field(default_factory=dict)

    @property
    def host_peak_bytes(self) -> int:
        return sum(self.host_categories.values())

    def biggest(self, k: int = 3) -> list[tuple[str, int]]:
        return sorted(((c, b) for c, b in self.categories.items() if b), key=lambda x: -x[1])[:k]

    def to_json(self) -> dict:
        return {"rank": self.rank, "peak_bytes": self.peak_bytes, "categories": self.categories, "at": self.at,
                "phases": self.phases, "host_peak_bytes": self.host_peak_bytes,
                "host_categories": self.host_categories}


def build_plan(cfg: TrainConfig, cuda: bool | None = None, pp_ranks: tuple[int, ...] | None = None) -> MemoryPlan:
    """The layout of `cfg` compiled as the run compiles it (schedules/compile.py), one replica's
    programs: schedule, partition, buckets. `cuda`: whether ranks run on GPUs (None: as run.device
    says, `auto` counted as CPU); `pp_ranks`: lower only these pipeline ranks (None: all)."""
    p, m = cfg.parallel, cfg.model
    counts = layer_param_counts(m)
    bounds = cut_bounds(counts, lambda: layer_costs(m, cfg.data.seq_len), p.pp * p.virtual_stages, p.partition,
                 p.stage_layers)
    per_chunk = tuple(tuple(counts[a:b]) for a, b in bounds)
    # D alike: one replica
    depth = p.zero3_prefetch if isinstance(p.zero3_prefetch, int) else prefetch_choice(cfg, cuda).depth
    compiled = compile_plan(replace(p, dp=1, zero3_prefetch=depth), _decoder_shapes(_Shape(m), tuple(bounds)),
                            pp_ranks=pp_ranks)
    buckets, layerwise, program = compiled.buckets.for_dp(p.dp), compiled.layerwise, compiled.program
    wire = 2 if cfg.run.dtype is DType.BF16 else F32
    cuda = cfg.run.device is Device.CUDA if cuda is None else cuda
    docs = 1 if cfg.data.packing is not None and cfg.data.packing.value == "doc-masked" else 0
    # int64 tokens, targets (, documents) of the whole global batch: a rank's micro-batches are views of it
    row = cfg.data.seq_len * 8 * (2 + docs)
    shapes = Shapes.of(m, p.micro_batch_size, cfg.data.seq_len, cfg.run.dtype)
    r = cfg.run
    # the prompt ("def ", four tokens or fewer) and every sampled token but the last, cut to the window
    sample = min(len(SAMPLE_PROMPT) + r.sample_tokens - 1, m.max_seq_len or cfg.data.seq_len) \
        if r.sample_tokens and p.pp == 1 else 0
    sent = wires_of(p, cfg.run.dtype is DType.BF16)  # messages only between replicas (D > 1)
    grad_q, weight_q = (w if w.quantized and p.dp > 1 else None for w in (sent.grads, sent.gathers))
    secondary = (p.ranks_per_node or 2) if p.secondary_shard.value != "none" and p.dp > 1 else 0
    return MemoryPlan(program, p.dp, buckets, per_chunk, tuple(bounds), shapes, p.recompute, layerwise,
                      in_flight_of(program), cfg.global_batch * row, wire, not cuda, r.eval_batches * p.microbatches,
                      r.eval_batches * cfg.global_batch * row, sample, cfg.data.seq_len, depth, grad_q, weight_q,
                      secondary, p.offload is Offload.OPTIMIZER)


def prefetch_choice(cfg: TrainConfig, cuda: bool | None = None) -> Choice:
    """ZeRO-3's prefetch depth for `cfg`: its `parallel.zero3_prefetch`, or for `auto` the planner's
    choice (planner/prefetch.py) no deeper than fits `run.gpu_memory_gib` by this model's walk."""
    p = cfg.parallel
    if isinstance(p.zero3_prefetch, int):
        return Choice(p.zero3_prefetch, "set", ())
    limit = cfg.run.gpu_memory_gib

    def fits(depth: int) -> bool:
        deeper = replace(cfg, parallel=replace(p, zero3_prefetch=depth))
        return limit is None or max(r.peak_bytes for r in every_rank(build_plan(deeper, cuda))) <= \
            limit * (1 - FIT_MARGIN) * 2**30  # the fit check's share: a depth chosen here passes it

    return run_choice(cfg, fits)


def chunk_bytes(plan: MemoryPlan, chunk: int) -> ChunkBytes:
    lo, hi = plan.layer_bounds[chunk]
    n_layers = plan.layer_bounds[-1][1] - 2  # blocks: the layer list is [embedding, blocks..., head]
    s = plan.shapes
    layers = [layer_bytes(s, i, n_layers, _linear_params(s, plan.chunk_params[chunk][i - lo], i, n_layers))
              for i in range(lo, hi)]
    held = sum(x.held for x in layers)
    inp = 0 if lo == 0 else s.tokens * s.dim * s.act
    out = 0 if hi == n_layers + 2 else s.tokens * s.dim * s.act
    fwd = max((x.forward_extra for x in layers), default=0)
    bwd = max((x.backward_extra for x in layers), default=0)
    loss = s.tokens * s.vocab * F32 if hi == n_layers + 2 else 0  # the head's log-softmax
    params = list(plan.chunk_params[chunk])
    boundary = s.tokens * s.dim * s.act
    blocks = [0 < i <= n_layers for i in range(lo, hi)]  # checkpointed with --recompute
    rec = recompute_moments(layers, params, blocks, boundary, bool(out))
    return ChunkBytes(held, sum(x.stash for x in layers), sum(x.stash_new for x in layers), fwd, bwd,
                      inp + sum(recompute_kept(layers, blocks, boundary)),
                      inp + recompute_forward(layers, blocks, boundary),
                      max((m for _, m in rec), default=0),
                      max((m for _, m in recompute_moments(layers, params, blocks, boundary, bool(out), True)),
                          default=0),
                      sum(x.recorded for x in layers),
                      max((x.w_extra for x in layers), default=0), split_b_peak(layers, loss),
                      backward_moments(layers, params, boundary), rec,
                      max(((x.nograd_live or x.forward_live) + _cast_weight(s, i, n_layers, lin)
                           for x, i, lin in zip(layers, range(lo, hi),
                                                (_linear_params(s, n, i, n_layers) for i, n in zip(range(lo, hi), params)))),
                          default=0),
                      s.tokens * s.vocab * (s.act + (F32 if s.act != F32 else 0) + F32) if loss else 0)


def backward_moments(layers: list[LayerBytes], params: list[int], boundary: int) -> tuple[tuple[int, int], ...]:
    """A full backward of the chunk (no recompute) as autograd runs it, layer by layer from the
    last: at layer i the gradients of the layers after it and of i exist, i's backward adds its
    transient, and the layers after i have freed what they saved, i's output among it (`held`
    counts a layer's output, which the next layer saves)."""
    out, done, freed = [], 0, 0
    for j, (x, n) in enumerate(zip(reversed(layers), reversed(params))):
        done += n
        out.append((done, x.backward_extra - freed - (boundary if j else 0)))
        freed += x.held
    return tuple(out)


def split_b_peak(layers: list[LayerBytes], loss: int) -> int:
    """The most bytes a split backward's B (runtime/weight_grad.input_grad_and_stash) adds to what
    the chunk holds (its activations and F's records). B asks autograd for the gradients of the
    chunk's input and of every recorded weight op's output, which it keeps (the stash's dy);
    autograd frees, layer by layer from the last, the saved tensors no record holds (`b_freed`).
    The last chunk starts with the loss's backward (log-softmax's gradient and the logits' beside
    the log-softmax). Inside a block its new gradients come before its frees, so each block's
    backward transient is counted on top of the gradients kept so far, its own included."""
    peak = 2 * loss
    kept = 0
    for x in reversed(layers):
        kept += x.stash_new - x.b_freed
        peak = max(peak, kept + x.backward_extra)
    return max(peak, kept)


def recompute_kept(layers: list[LayerBytes], blocks: list[bool], boundary: int) -> list[int]:
    """What each layer keeps from F to its backward under --recompute (runtime/recompute.py): a
    checkpointed block its output (the next layer's checkpoint or the head saves it), the
    embedding and the head what they keep without recompute (their own saved tensors)."""
    return [boundary if blk else x.held for x, blk in zip(layers, blocks)]


def recompute_forward(layers: list[LayerBytes], blocks: list[bool], boundary: int) -> int:
    """The most bytes a recomputed chunk's F holds at once beyond its input, layer by layer: what the
    layers before keep, and inside a block its forward with nothing saved (`forward_live`; under
    autocast its weights are cast uncached, one at a time), inside the head its saved tensors and
    its logits."""
    kept = recompute_kept(layers, blocks, boundary)
    return max((sum(kept[:i]) + (x.forward_live if blk else x.held + x.forward_extra)
                for i, (x, blk) in enumerate(zip(layers, blocks))), default=0)


def recompute_moments(layers: list[LayerBytes], params: list[int], blocks: list[bool], boundary: int,
                      sends: bool, retain: bool = False) -> tuple[tuple[int, int], ...]:
    """A backward of a chunk whose blocks are checkpointed one by one (torch's non-reentrant
    checkpoint, runtime/recompute.py), as `backward_moments`: the bytes beyond what the chunk keeps
    between F and its backward (`recompute_kept`), layer by layer from the last. At a block the
    first unpack reruns its forward up to its last saved tensor (early stop: not its output), so its
    saved tensors are all back at once (`held` less its output) beside its backward's transient and
    the gradient flowing into it (the last layer's is the received one, or the loss's), as its
    first gradient arrives; by its last gradient (its parameters' bucket complete, a reduction
    started at ZeRO-2/3) autograd has freed them. The layers after it are done and have freed what
    they kept, and with them the block's own output (the next layer saved it). `sends`: the chunk's output was sent before the backward (moved to the
    send's bytes). `retain`: a B (autograd.grad with the graph retained for W) frees what it reruns
    as it goes but keeps every tensor saved outside a checkpoint."""
    kept = recompute_kept(layers, blocks, boundary)
    if sends and kept:
        kept[-1] = 0
    moments = []
    done = 0
    last = len(layers) - 1
    for i in range(last, -1, -1):
        x = layers[i]
        grad_in = boundary if i < last else 0
        freed = 0 if retain or i == last else sum(kept[i:])
        if blocks[i] and params[i]:  # the rerun's tensors are back before the block's first gradient
            # lands, and mostly freed by the time its last one does (its bucket then complete)
            moments.append((done + 1, x.held - boundary + x.backward_extra + grad_in - freed))
        done += params[i]
        moments.append((done, x.backward_extra + grad_in - freed))
    return tuple(moments)


def _cast_weight(s: Shapes, index: int, n_layers: int, linear_params: int) -> int:
    """Under bf16 autocast without its cache (runtime/autocast.py), the bf16 copy of a layer's
    largest weight, alive while a forward without autograd multiplies by it (one at a time)."""
    if s.act == F32 or index == 0:
        return 0
    return 2 * (linear_params if index == n_layers + 1 else s.dim * max(s.hidden, s.q))


def _linear_params(s: Shapes, params: int, index: int, n_layers: int) -> int:
    if index == 0:
        return 0
    if index == n_layers + 1:
        return params - s.dim
    return params - 2 * s.dim


def predict(cfg: TrainConfig, cuda: bool | None = None) -> list[RankMemory]:
    """Every rank's peak and its categories (ranks in mesh order, pp_rank x D + dp_rank)."""
    return every_rank(build_plan(cfg, cuda))


def every_rank(plan: MemoryPlan, keep_timeline: bool = False) -> list[RankMemory]:
    """`walk` of each pipeline rank, repeated for its D data-parallel ranks (global ranks in order)."""
    stages = [walk(plan, s, keep_timeline) for s in range(len(plan.program.ranks))]
    # without a pipeline rank 0 samples alone (ZeRO-3 layer by layer: every rank, gathering together);
    # the others wait, at most with the whole model gathered (below the step's peak)
    waits = walk(plan, 0, keep_timeline, samples=False) if plan.sample_len and not plan.layerwise and \
        plan.dp > 1 and len(stages) == 1 else stages[0]
    return [replace(stages[r // plan.dp] if r >= plan.dp or r == 0 else waits, rank=r)
            for r in range(len(stages) * plan.dp)]


def walk(plan: MemoryPlan, pp_rank: int, keep_timeline: bool = False, samples: bool = True,
         stop_above: float | None = None) -> RankMemory:
    """Play pipeline rank `pp_rank`'s program over byte counts (its data-parallel rank 0, global
    rank pp_rank x D); the first step of a run (gradient buffers are created inside it), which is
    the step `train --memory-profile` measures, then the evaluation and (`samples`: this rank
    computes it) the text sample from the state the step leaves. `stop_above`: stop as soon as the
    peak passes it (a planner's candidate that cannot fit needs no more): a peak above it is then
    only a lower bound."""
    prog, dp = plan.program, plan.dp
    rank = pp_rank
    rules = RULES[prog.zero]
    sharded = rules.sharded_grads
    chunks = prog.schedule.chunks(pp_rank)
    bp = plan.buckets
    s = plan.shapes
    mb_act = s.tokens * s.dim * s.act  # one boundary activation or its gradient
    cb = {c: chunk_bytes(plan, c) for c in chunks}
    whole = {c: bp.chunk_numel(c) * F32 for c in chunks}
    shard = {c: whole[c] // dp for c in chunks}
    # each bucket's bytes, by chunk: the full fp32 bucket, this rank's fp32 shard of it, and what its
    # reduction holds while in flight (nothing with one replica)
    full_b = {c: [n * F32 for n in bp.buckets(c)] for c in chunks}
    shard_b = {c: [n // dp * F32 for n in bp.buckets(c)] for c in chunks}
    flight = {c: [reduction_bytes(plan, n, rules.reduces_to_shard) if dp > 1 else 0 for n in bp.buckets(c)]
              for c in chunks}
    # what a reduction's wait holds beyond its flight (quantized traffic's decode; 0 otherwise)
    settling = {c: [wait_bytes(plan, n, rules.reduces_to_shard) if dp > 1 else 0 for n in bp.buckets(c)]
                for c in chunks}
    q = plan.weight_quant if rules.gathers_updates else None  # ZeRO-1/2's quantized gathers after the step
    updates = {c: [gather_flight(q, n, dp) for n in bp.buckets(c)] for c in chunks} if q is not None else {}
    updating: set[tuple[int, int]] = set()  # those started and not yet waited for
    stepped = [False, False]  # the step's OPTIM_STEP is past; its gathers of updated weights have started
    live: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    live["params"] = sum(shard.values() if rules.sharded_params else whole.values())
    if plan.secondary:  # hpZ: each bucket's node share, kept from its first gather (counted from the start)
        live["params"] += sum(n // plan.secondary * F32 for c in chunks for n in bp.buckets(c))
    updated = sum(whole.values() if rules.updates_whole else shard.values())  # fp32 bytes this rank updates
    live["optimizer"] = 0 if plan.offload else 2 * updated
    live["batch"] = plan.batch_bytes + plan.eval_bytes
    res = RankMemory(pp_rank * dp, host_categories=host_bytes(updated // F32, plan.offload))
    on_host = [0]  # --offload-activations: saved tensors in host memory now
    held: dict[tuple[int, int], int] = {}  # (chunk, mb) -> activation bytes kept
    # by chunk, a bit a bucket: its full fp32 gradient bucket is alive; its fp32 shard is
    full = dict.fromkeys(chunks, 0)
    shards = dict.fromkeys(chunks, 0)
    every = {c: (1 << len(full_b[c])) - 1 for c in chunks}
    reducing: deque[tuple[int, int]] = deque()  # reductions in flight, oldest first
    in_flight: set[tuple[int, int]] = set()  # the same, to look up
    # a run of reductions (alike runs share an id) from alike state has the same effect: it is
    # played once (keyed by its id, the reductions in flight and the buckets' bits)
    runs: dict[tuple, tuple] = {}
    backwards: dict[tuple[int, int, int, bool], tuple[tuple[int, int, int], ...]] = {}
    recvs: dict[tuple[int, bool, int], int] = {}
    gathered: dict[int, int] = {}

    peak: list[object] = [""]  # the instruction at which the peak is reached, named at the end

    def note(where: object, extra: dict[str, int] | None = None) -> None:
        """`where`: an instruction, named only where the timeline is kept, or once the walk is done
        if it set the peak (naming every one, then every new peak, cost a planner request seconds)."""
        total = sum(live.values())
        if extra:
            total += sum(extra.values())
        if total <= res.peak_bytes and not keep_timeline:
            return
        now = live.copy()
        for c, n in (extra or {}).items():
            now[c] += n
        if total > res.peak_bytes:
            res.peak_bytes, res.categories = total, now
            peak[0] = where
        if keep_timeline:
            res.timeline.append((len(res.timeline), now))
            res.totals.append((str(where), total))

    def missing(c: int) -> list[int]:
        """Sizes of chunk `c`'s buckets with no full gradient bucket alive."""
        return [n for k, n in enumerate(bp.buckets(c)) if not full[c] >> k & 1]

    def all_grad_buckets(c: int) -> None:
        if full[c] != every[c]:
            live["grads"] += sum(missing(c)) * F32
            full[c] = every[c]

    def complete(keep: int, g: int, co: int) -> tuple[int, int, int]:
        """The oldest reductions in flight complete until `keep` are left; the gradient and
        collective bytes `g`, `co` after them (a blocking wait keeps none; a REDUCE_GRAD's `bound`
        the program's number), and the most of the two at once while they were waited for (a wait's
        own bytes, `settling`, beside what is still in flight; 0: none completed)."""
        top = 0
        while len(reducing) > keep:
            key = reducing.popleft()
            in_flight.discard(key)
            c, k = key
            if settling[c][k]:
                top = max(top, g + co + settling[c][k])
            co -= flight[c][k]
            if sharded:  # the reduce-scatter's output becomes (or is added into) the fp32 shard
                if not shards[c] >> k & 1:
                    shards[c] |= 1 << k
                    g += shard_b[c][k]
                if full[c] >> k & 1:
                    full[c] ^= 1 << k
                    g -= full_b[c][k]
        return g, co, top

    def drain(where: object) -> None:
        """Every reduction in flight completes (blocking: the rank waits for all of them)."""
        live["grads"], live["collectives"], top = complete(0, live["grads"], live["collectives"])
        if top > live["grads"] + live["collectives"]:  # a wait's decode beside what was still in flight
            note(where, {"collectives": top - live["grads"] - live["collectives"]})

    def reductions(i: int) -> int:
        """The run of REDUCE_GRADs from position `i` (a backward's buckets, one an instruction):
        they change only gradients and collectives, so they are played here in one loop, the peak
        taken where the run's total is first largest; returns the position after the run. At
        ZeRO-2/3 each micro-batch's backward ends in such a run, most of them alike (and from alike
        state): those are played once."""
        end, run = run_at[i]
        key = (run, tuple(reducing), tuple(full.values()), tuple(shards.values())) if sharded else None
        if key is None or keep_timeline or key not in runs:
            effect = play(i, end)
            if key is None or keep_timeline:
                return end
            runs[key] = effect + (tuple(reducing), tuple(full.values()), tuple(shards.values()))
            return end
        d_g, d_co, top, top_at, top_g, top_co, after, full_after, shards_after = runs[key]
        g, co = live["grads"], live["collectives"]
        if sum(live.values()) + top > res.peak_bytes:
            res.peak_bytes, peak[0] = sum(live.values()) + top, instrs[i + top_at]
            res.categories = {**live, "grads": g + top_g, "collectives": co + top_co}
        live["grads"], live["collectives"] = g + d_g, co + d_co
        reducing.clear()
        reducing.extend(after)
        in_flight.clear()
        in_flight.update(after)
        full.update(zip(full, full_after))
        shards.update(zip(shards, shards_after))
        return end

    def play(i: int, end: int) -> tuple[int, int, int, int, int, int]:
        """Reductions `i` to `end` one by one; returns the change in gradient and collective bytes
        and where (relative to `i`) the total first reached its largest, by how much, with what."""
        g0, co0 = g, co = live["grads"], live["collectives"]
        rest = sum(live.values()) - g - co
        best, best_at, best_g, best_co = res.peak_bytes, -1, 0, 0
        top, top_at, top_g, top_co = -1 << 62, 0, 0, 0
        for j in range(i, end):
            ins = instrs[j]
            key = c, k = ins.chunk, ins.bucket  # type: ignore[union-attr]
            if key not in in_flight:  # the reduction starts
                if sharded and not full[c] >> k & 1:  # zeros where no gradient reached it
                    full[c] |= 1 << k
                    g += full_b[c][k]
                if dp > 1 or sharded:
                    reducing.append(key)
                    in_flight.add(key)
                    co += flight[c][k]
            waited = 0
            if ins.blocking or ins.bound is not None:  # type: ignore[union-attr]
                g, co, waited = complete(0 if ins.blocking else ins.bound, g, co)  # type: ignore[union-attr]
            total = rest + max(g + co, waited)
            if total > best:
                best, best_at, best_g, best_co = total, j, g, total - rest - g
            if max(g + co, waited) - g0 - co0 > top:
                top, top_at, top_g, top_co = max(g + co, waited) - g0 - co0, j - i, g - g0, max(g + co, waited) - g - co0
            if keep_timeline:
                res.timeline.append((len(res.timeline), {**live, "grads": g, "collectives": co}))
                res.totals.append((_name(ins), total))
        if best_at >= 0:
            res.peak_bytes, peak[0] = best, instrs[best_at]
            res.categories = {**live, "grads": best_g, "collectives": best_co}
        live["grads"], live["collectives"] = g, co
        return g - g0, co - co0, top, top_at, top_g, top_co

    def gather(c: int, on: bool, backward: bool = False) -> None:
        if on and c not in gathered:
            gathered[c] = whole[c] if not plan.layerwise else _layerwise_gathered(plan, c, 3 if backward else 2)
            if plan.weight_quant is not None and plan.layerwise and not (plan.secondary and backward):
                # the layers prefetched travel as messages, and the one waited for is decoded
                # (memory/quantized.py); with hpZ a backward's gathers are the node's fp32 shares
                largest = max(bp.buckets(c), default=0)
                gathered[c] += decoded(largest) + plan.depth * gather_flight(plan.weight_quant, largest, dp)
            live["gathered"] += gathered[c]
        elif not on and c in gathered:
            live["gathered"] -= gathered.pop(c)

    def update_gathers(ins: DataParallel) -> None:
        """ZeRO-1/2 with quantized weights: the step starts every bucket's gather of its updated
        weights at once (zero/coordinator.start_updates), each holding its messages until it is
        waited for, bucket by bucket, decoding it (the first UNSHARD after the step stands for the
        start). Each is priced as waited for at its own UNSHARD: where the last one blocks that is
        the program's wait; with --overlap-gather the program's WAITs sit in the next program's
        first forward (schedules/lowering.py `update_waits`), which a one-step walk does not reach
        (the first step's WAITs find nothing in flight), and the first step the memory profile
        measures ends in `settle` (engine.py), which waits for them all within the step."""
        if not stepped[1]:
            stepped[1] = True
            for c in chunks:
                updating.update((c, k) for k in range(len(updates[c])))
                live["collectives"] += sum(updates[c])
        c = ins.chunk
        for k in range(len(updates[c])) if ins.bucket is None else [ins.bucket]:
            if (c, k) in updating:
                note(ins, {"collectives": decoded(bp.buckets(c)[k])})
                updating.discard((c, k))
                live["collectives"] -= updates[c][k]

    split_done: dict[tuple[int, int], bool] = {}  # B left a stash: W needs no autograd graph
    # layer by layer: each action's gathers priced as its chunk's; and the backwards whose chunk's
    # reductions follow them
    instrs, reducing_at, run_at = prog.markers(rank)
    # chunks whose forward records for a split backward (runtime/executor.py: not the first chunk,
    # not with recompute)
    splits = set() if plan.recompute else {ins.action.chunk for ins in instrs if isinstance(ins, Compute)
                                           and ins.action.op is Op.B and ins.action.chunk > 0}
    note("start")
    i = 0
    stop = float("inf") if stop_above is None else stop_above
    while i < len(instrs) and res.peak_bytes <= stop:
        ins = instrs[i]
        if isinstance(ins, PointToPoint):
            chunk, grad, mb = ins.transfer
            if ins.send and not grad and (chunk - 1, mb) in held:
                # an activation travels as the chunk's output itself (runtime/p2p.py sends the
                # tensor, no copy, as the wire and the residual stream share a dtype): it moves from
                # the micro-batch's activations to the send, which holds it until the step's end
                held[(chunk - 1, mb)] -= mb_act
                live["activations"] -= mb_act
                live["p2p"] += mb_act
            elif ins.send:
                live["p2p"] += mb_act  # held by the send until the step's end waits for it
            else:
                recvs[ins.transfer] = mb_act
                live["p2p"] += mb_act
            note(ins)
            i += 1
            continue
        if isinstance(ins, OptimStep):
            live["p2p"] = 0  # the step's sends are waited for, their buffers dropped
            drain(ins)
            stepped[0] = True
            # the gradient norm reads each bucket's shard as fp64 (zero/update.py), one at a time
            norm = max((n // dp * 8 for c in chunks for n in bp.buckets(c)), default=0)
            note(ins, {"optimizer": norm})
            i += 1
            continue
        if isinstance(ins, ActivationCopy):
            # --offload-activations: the forward's saved tensors leave the device and come back; the
            # chunk's input stays, and a chunk that runs B keeps its weight ops' recorded inputs
            # (runtime/weight_grad.py holds them), so there the device frees nothing
            moved = 0 if ins.chunk in splits else cb[ins.chunk].held
            live["activations"] += -moved if ins.to_host else moved
            on_host[0] += cb[ins.chunk].held if ins.to_host else -cb[ins.chunk].held  # every saved tensor is copied
            res.host_categories["host_activations"] = max(res.host_categories.get("host_activations", 0), on_host[0])
            note(ins)
            i += 1
            continue
        if isinstance(ins, DataParallel):
            if ins.kind is Kind.REDUCE_GRAD:
                i = reductions(i)
                continue
            if ins.kind is Kind.UNSHARD and prog.rules.sharded_params:
                gather(ins.chunk, True)
                if plan.weight_quant is not None and not plan.layerwise:  # kept gathered: the chunk's
                    # buckets' messages at once, and the decode of the largest as it is waited for
                    sizes = bp.buckets(ins.chunk)
                    note(ins, {"collectives": sum(gather_flight(plan.weight_quant, n, dp) for n in sizes)
                               + decoded(max(sizes, default=0))})
            elif ins.kind is Kind.RESHARD:
                gather(ins.chunk, False)
            elif ins.kind is Kind.UNSHARD and updates and stepped[0]:
                update_gathers(ins)
            note(ins)
            i += 1
            continue
        assert isinstance(ins, Compute)
        a = ins.action
        c, key = a.chunk, (a.chunk, a.mb)
        b = cb[c]
        if plan.layerwise and a.op is not Op.F and c in gathered:
            gather(c, False)  # in backward the layer just done is released only once its gradients are in
            gather(c, True, backward=True)
        recv_key = (c, a.op is not Op.F, a.mb)
        if a.op is Op.F:
            inp = recvs.pop(recv_key, 0)
            live["p2p"] -= inp
            keep = b.recompute_held if plan.recompute else b.held + (inp if c > 0 else 0)
            if c in splits:  # the executor records weight ops' outputs in F of a chunk that runs B
                keep += b.recorded
            note(ins, {"activations": b.recompute_forward if plan.recompute else b.held + b.forward_peak})
            held[key] = keep
            live["activations"] += keep
            note(ins)
            i += 1
            continue
        # a backward: B, W or BW
        if a.op in (Op.BW, Op.W) and not sharded:
            all_grad_buckets(c)  # stages 0-1: one buffer for the whole step, from the first W or BW
        split = a.op is Op.B and c > 0 and not plan.recompute
        # inside a backward: its gradients (B: every output gradient W will need), and with
        # recompute each block's forward again
        # (B: its output gradients, the stash W will need, are the backward's gradients)
        extra = b.b_peak if split else b.backward_peak
        if plan.recompute:  # each block rerun in its backward; W's autograd.grad over the retained
            # graph reruns them again (B's unpacking freed what it reran)
            extra = b.recompute_b if a.op is Op.B else b.recompute_backward
        if a.op is Op.W and split_done.get(key):
            extra = b.w_peak
        if a.op is Op.W and key in held and not split_done.get(key) and not sharded:
            # autograd.grad returns every weight gradient of the chunk at once, by which time it
            # has freed the activations it went through
            extra = max(extra, whole[c] - held[key])
        filling = 0
        stashed_w = a.op is Op.W  # W makes every weight gradient apart (from the stash, or autograd's)
        if a.op in (Op.BW, Op.W) and sharded:
            if stashed_w:  # ZeRO-2/3 then move them into the buckets (`adopt`, after W)
                fresh = missing(c)
                if split_done.get(key):
                    # W from B's stash makes one weight's gradient at a time (runtime/weight_grad.py):
                    # added at once into a bucket that exists (the parameter's .grad is its view),
                    # kept as the parameter's .grad where none does, until `adopt` allocates the
                    # bucket and moves them in
                    filling = (sum(fresh) + max(fresh, default=0)) * F32
                else:  # autograd's W returns every gradient at once, once it has freed the
                    # activations (and with recompute what it reran): after its own peak
                    filling = max(0, whole[c] + max(fresh, default=0) * F32 - held.get(key, 0))
                    note(ins, {"activations": extra})
                    extra = 0
        grad_in = recvs.pop(recv_key, 0) if a.op is not Op.W else 0
        if a.op is Op.BW and sharded:
            # the backward's course: each bucket appears with its first gradient, and in a
            # backward the program follows with REDUCE_GRADs leaves reduced as it completes
            now = sum(live.values())
            course = (c, full[c], shards[c], i in reducing_at and dp > 1)
            if course not in backwards:  # alike from alike state (most micro-batches')
                backwards[course] = sharded_backward(plan, c, b, *course[1:])
            for act, grads, coll in backwards[course]:
                if keep_timeline or now + act + grads + coll > res.peak_bytes:
                    note(ins, {"activations": act, "grads": grads, "collectives": coll})
            if i not in reducing_at:
                all_grad_buckets(c)
        else:
            note(ins, {"activations": extra, "grads": filling})
        if stashed_w and sharded:
            all_grad_buckets(c)
        live["p2p"] -= grad_in
        if split:  # the graph is freed; W needs only the stash
            split_done[key] = True
            live["activations"] += b.stash - held[key]
            held[key] = b.stash
        elif a.op is not Op.B:
            live["activations"] -= held.pop(key)
        else:  # B of the first chunk, or with recompute, keeps the graph and its output's gradient for W
            held[key] += grad_in
            live["activations"] += grad_in
        note(ins)
        i += 1
    res.categories = {c: res.categories.get(c, 0) for c in CATEGORIES}
    res.at = _name(peak[0])
    res.phases = {"train": res.peak_bytes}
    after = {c: live.get(c, 0) for c in CATEGORIES}  # what a step leaves
    for phase, found in (("eval", eval_phase(plan, pp_rank, after, cb)),
                         ("sample", sample_phase(plan, after, samples))):
        if found is None:
            continue
        (total, now, where), res.phases[phase] = found, found[0]
        if keep_timeline:
            res.timeline.append((len(res.timeline), now))
            res.totals.append((where, total))
        if total > res.peak_bytes:
            res.peak_bytes, res.at, res.categories = total, where, now
    return res


def eval_phase(plan: MemoryPlan, pp_rank: int, after: dict[str, int],
               cb: dict[int, ChunkBytes]) -> tuple[int, dict[str, int], str] | None:
    """A held-out evaluation's peak on pipeline rank `pp_rank` from the state a step leaves
    (`after`): (bytes, categories, where), its order, transfers and gathers read off the evaluation's
    program (schedules/forward_only.py). Every micro-batch passes alike, so the peak is in the
    last, when the sends of all before it are still held: inside one of its chunks' forward (the
    input, received or handed over, the most one layer's forward holds at once with nothing saved:
    `eval_forward`, and on the last chunk's rank the previous logits; then the loss) or at the
    end, every send held. The step's token batch is alive (the evaluation runs inside the step's
    call)."""
    if not plan.eval_microbatches:
        return None
    s, sched = plan.shapes, plan.program.schedule
    mb_act = s.tokens * s.dim * s.act
    last = sched.n_chunks - 1
    sharded = RULES[plan.program.zero].sharded_params
    # one micro-batch of the rank's evaluation program: every micro-batch runs alike
    program = lower_evaluation(sched, 1, plan.buckets, 1, sharded_params=sharded, layerwise=plan.layerwise,
                               gathers=FP32)[pp_rank]
    chunks = [i.action.chunk for i in program if isinstance(i, Compute)]
    sends = [i.transfer[0] - 1 for i in program if isinstance(i, PointToPoint) and i.send]
    kept = sum(plan.buckets.chunk_numel(i.chunk) for i in program
               if isinstance(i, DataParallel) and i.kind is Kind.UNSHARD and i.bucket is None) * F32
    base = {**after, "activations": 0, "p2p": 0, "collectives": 0, "gathered": kept}
    sent = (plan.eval_microbatches - 1) * len(sends) * mb_act
    best = (sum(base.values()) + sent + len(sends) * mb_act,
            {**base, "p2p": sent + len(sends) * mb_act}, "eval: sends held")
    # the executor's `y` keeps a chunk's output until the next forward returns: the previous
    # micro-batch's logits while the rank's first chunk computes (its other outputs are sent, held
    # anyway); the loss comes after, the old logits gone
    logits = s.tokens * s.vocab * s.act if last in chunks and plan.eval_microbatches > 1 else 0
    for c in chunks:
        prev = logits if c == chunks[0] else 0
        now = {**base, "activations": (mb_act if c > 0 else 0) + max(cb[c].eval_forward + prev, cb[c].eval_loss),
               "p2p": sent}
        if sharded and plan.layerwise:
            now["gathered"] = _layerwise_gathered(plan, c, 2)
        if sum(now.values()) > best[0]:
            best = (sum(now.values()), now, f"eval: {c}F{plan.eval_microbatches - 1}")
        sent += mb_act if c in sends else 0
    return best


def sample_phase(plan: MemoryPlan, after: dict[str, int], computes: bool = True) -> tuple[int, dict[str, int],
                                                                                        str] | None:
    """The text sample's peak on the sampling rank (one pipeline rank, every chunk its own): the
    forward over the longest window, batch 1, fp32, nothing saved; each layer's input beside the
    most its forward holds at once (the head: its normed input and the logits, no log-softmax),
    and each block's rotary tables grown to the window. The step's batch is freed by then.
    Not `computes`: a rank waiting while rank 0 samples (kept-gathered ZeRO-3: the model gathered)."""
    if not plan.sample_len or len(plan.program.ranks) != 1:
        return None
    sharded = RULES[plan.program.zero].sharded_params
    if not computes:
        now = {**after, "activations": 0, "p2p": 0, "collectives": 0, "batch": plan.eval_bytes,
               "gathered": plan.buckets.chunk_numel(0) * F32 if sharded else 0}
        return sum(now.values()), now, "sample: waiting for rank 0"
    s = replace(plan.shapes, tokens=plan.sample_len, act=F32)
    n_layers = plan.layer_bounds[-1][1] - 2
    x = s.tokens * s.dim * F32
    inner = 0
    for c, (lo, hi) in enumerate(plan.layer_bounds):
        for i in range(lo, hi):
            if i == n_layers + 1:
                inner = max(inner, x + s.tokens * (s.dim + 1) * F32 + s.tokens * s.vocab * F32)
            elif i > 0:
                lin = _linear_params(s, plan.chunk_params[c][i - lo], i, n_layers)
                inner = max(inner, x + layer_bytes(s, i, n_layers, lin).forward_live)
    hd = s.q // max(1, s.heads)
    tables = n_layers * max(0, s.tokens - plan.seq_len) * hd * F32  # cos and sin, (length, hd / 2) each
    gathered = 0
    if sharded:
        gathered = _layerwise_gathered(plan, 0, 2) if plan.layerwise else plan.buckets.chunk_numel(0) * F32
    now = {**after, "activations": inner + tables, "p2p": 0, "collectives": 0, "gathered": gathered,
           "batch": plan.eval_bytes}
    return sum(now.values()), now, f"sample: {s.tokens} tokens"


def _name(ins: object) -> str:
    """An instruction as the walk names it: a reduction hoisted out of a fused backward without the
    moment inside it that fired it (schedules/program.hoisted)."""
    if isinstance(ins, DataParallel) and ins.at is not None:
        return str(replace(ins, at=None))
    return str(ins)


def sharded_backward(plan: MemoryPlan, c: int, b: ChunkBytes, full: int, shards: int,
                     reducing: bool) -> tuple[tuple[int, int, int], ...]:
    """The extra (activations, grads, collectives) bytes at each moment of a full backward of chunk
    `c` at ZeRO-2/3 (see `backward_moments`): gradients land in a bucket allocated with its first
    gradient (`adopt`, zero/buckets.py) while the layers behind free their activations; with
    `reducing`, autograd's hooks start a bucket's reduce-scatter as soon as it is complete and then
    wait for all but the newest `in_flight` (the program's bound): at the moment a bucket completes, it
    and the `in_flight` before it are in flight with their buffers, and the older ones are reduced
    to their shard. Buckets fill in order, so the started and the complete ones are each a first
    few: sums over them are read off running totals."""
    sizes = plan.buckets.buckets(c)
    ends = list(accumulate(sizes))
    dp, k_alive = plan.dp, plan.in_flight + 1
    # running totals over the buckets: new full buckets (those not already alive), the bytes a
    # reduced bucket gives back (the full bucket, less its shard where the shard is new), and the
    # buffers of reductions in flight
    new = [0, *accumulate(0 if full >> k & 1 else n * F32 for k, n in enumerate(sizes))]
    if reducing:
        back = [0, *accumulate(n * F32 - (0 if shards >> k & 1 else n // dp * F32) for k, n in enumerate(sizes))]
        flying = [0, *accumulate(reduction_bytes(plan, n, True) for n in sizes)]
    out = []
    reduced = 0  # buckets reduced by the moment before
    # a rank waits for one collective at a time: layer by layer with quantized weights, `gathered`
    # already holds a layer's decode (walk's `gather`), which a reduction's decode does not add to
    decoding = decoded(max(sizes, default=0)) if plan.weight_quant is not None and plan.layerwise and \
        not plan.secondary else 0
    for done, act in (b.recompute_moments if plan.recompute else b.moments):
        # bucket 0 has started by the first moment; bucket k once bucket k - 1 ends before `done`
        grads = new[min(len(sizes), bisect_left(ends, done) + 1)]
        coll = 0
        if reducing:
            complete = bisect_right(ends, done)
            older = max(0, complete - k_alive)  # complete, reduced: the rest are in flight
            grads -= back[older]
            coll = flying[complete] - flying[older]
            # the buckets reduced since the moment before were waited for here: the largest wait
            coll += max(0, max((wait_bytes(plan, n, True) for n in sizes[reduced:older]), default=0) - decoding)
            reduced = older
        out.append((act, grads, coll))
    return tuple(out)


def reduction_bytes(plan: MemoryPlan, n: int, to_shard: bool) -> int:
    """Bytes a gradient reduction of an `n`-element bucket holds besides the bucket while in flight
    (zero/coordinator.py): the low-precision copy it travels as (bf16), and for a reduce-scatter
    (ZeRO-1 to 3) its output shard plus, on gloo, the exchange's receive buffer for the other
    members' slices (parallel/hierarchical.start_exchange; at D = 2 the output shard is it)."""
    if plan.grad_quant is not None:  # messages, not a wire copy (memory/quantized.py)
        return reduction_flight(plan.grad_quant, n, plan.dp)
    out = n * plan.wire if plan.wire != F32 else 0
    if to_shard:
        shard = n // plan.dp * plan.wire
        out += shard + (shard * (plan.dp - 1) if plan.gloo and plan.dp > 2 else 0)
    return out


def wait_bytes(plan: MemoryPlan, n: int, to_shard: bool) -> int:
    """Bytes a gradient reduction of an `n`-element bucket holds beyond `reduction_bytes` while it
    is waited for: a quantized one's decode (memory/quantized.py); nothing otherwise (the sum
    lands in the buffers counted)."""
    return 0 if plan.grad_quant is None else reduction_wait(plan.grad_quant, n, plan.dp, to_shard)


def _layerwise_gathered(plan: MemoryPlan, chunk: int, span: int) -> int:
    """ZeRO-3 layer by layer: the most bytes of `span` neighbouring layers at a prefetch depth of
    one, the layer computing and the next one prefetched (forward: 2), and in backward also the
    layer just done, released only once autograd has accumulated all of its gradients (3); each layer
    of depth past one adds a layer prefetched (`plan.depth` + 1 in a forward: schedules/layer_plan.py).
    With --zero3-unit sublayer the units are the plan's buckets, a block's attention and MLP apart."""
    span += plan.depth - 1
    if plan.buckets.sublayer:
        layers = [lay.numel for lay in reversed(plan.buckets.layouts[chunk])]
    else:
        layers = [n for n in plan.chunk_params[chunk] if n > 0]
    return max((sum(layers[i:i + span]) for i in range(len(layers))), default=0) * F32


def fits(ranks: list[RankMemory], limit_bytes: float) -> RankMemory | None:
    """The rank whose peak is furthest over `limit_bytes`, or None when every rank fits."""
    over = [r for r in ranks if r.peak_bytes > limit_bytes]
    return max(over, key=lambda r: r.peak_bytes) if over else None


def describe(r: RankMemory) -> str:
    return f"rank {r.rank}: {r.peak_bytes / 2**30:.2f} GiB (" + ", ".join(
        f"{c} {b / 2**30:.2f}" for c, b in r.biggest()) + ")"


def layout_memory(model: ModelConfig, seq_len: int, lay: "Layout", bf16: bool, cuda: bool,
                  bucket_mb: float, stop_above: float | None = None) -> RankMemory:
    """The planner's figure for one candidate layout: the heaviest of its first, second and last
    pipeline ranks. The first holds the most micro-batches in flight and the embedding, the last
    the head, but under an even cut the second can outweigh both, holding a whole stage of blocks
    and one micro-batch fewer than the first (small, 1F1B, P=4: rank 1 1196 MiB against 1066 on the
    ends; 7b P=4 D=4 ZeRO-2 zb-h1: 38.6 GiB against 29.0): a plan that read only the ends listed
    layouts the fit check refuses. Past the second, ranks hold as many blocks and fewer micro-batches
    (in a V, the same chunks mirrored): on 108 layouts (small and 7b, six schedules, P 4 and 8,
    ZeRO 0/2/3, recompute on and off) no rank outweighed these three. Candidates that differ only
    in where ranks sit (placement, two-level reductions) share one walk. `stop_above`: bytes past
    which the candidate cannot fit; the walks stop there (a peak above it is a lower bound)."""
    return _layout_memory(_Shape(model), seq_len, lay.pp, lay.dp, lay.zero, lay.schedule, lay.virtual,
                          lay.micro_batch, lay.microbatches, lay.recompute, lay.grad_reduce, bf16, cuda, bucket_mb,
                          stop_above, lay.offload, lay.in_flight)


@dataclass(frozen=True, eq=False)
class _Shape:
    """A ModelConfig (a mutable dataclass) as a cache key, by value."""

    model: ModelConfig

    def __hash__(self) -> int:
        return hash(repr(self.model))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Shape) and repr(other.model) == repr(self.model)


@lru_cache(maxsize=1024)
def _decoder_shapes(shape: _Shape, bounds: tuple[tuple[int, int], ...]) -> ModelShapes:
    """The model's tensors cut at `bounds`, made once (the planner compiles many layouts over a few
    cuts: one object, so the compiled plans' caches find it by a hash taken once)."""
    return decoder_shapes(shape.model, list(bounds))


@lru_cache(maxsize=4096)
def _layout_memory(shape: _Shape, seq_len: int, pp: int, dp: int, zero: int, kind: ScheduleKind, virtual: int,
                   micro_batch: int, microbatches: int, recompute: bool, mode: GradReduce, bf16: bool, cuda: bool,
                   bucket_mb: float, stop_above: float | None, offload: bool = False,
                   in_flight: int = BUCKETS_IN_FLIGHT) -> RankMemory:
    par = ParallelConfig(pp=pp, dp=dp, zero=zero, schedule=kind, microbatches=microbatches,
                         micro_batch_size=micro_batch, virtual_stages=virtual, recompute=recompute,
                         grad_reduce=mode, bucket_mb=bucket_mb, offload=Offload.OPTIMIZER if offload else Offload.NONE,
                         buckets_in_flight=in_flight)
    cfg = TrainConfig(model=shape.model, parallel=par, data=DataConfig(seq_len=seq_len, packing=Packing.CONCAT),
                      run=RunConfig(dtype=DType.BF16 if bf16 else DType.FP32))
    heaviest, host = None, {}
    for r in sorted({0, min(1, pp - 1), pp - 1}):  # the first heaviest; none after one over `stop_above`
        res = walk(build_plan(cfg, cuda, (r,)), r, stop_above=stop_above)  # each lowered only if walked
        if heaviest is None or res.peak_bytes > heaviest.peak_bytes:
            heaviest = res
        if res.host_peak_bytes >= sum(host.values()):  # the end ranks hold the embedding or the head
            host = res.host_categories
        if stop_above is not None and res.peak_bytes > stop_above:
            break
    assert heaviest is not None
    # the device's heaviest rank, with the host bytes of the rank that offloads most
    return replace(heaviest, host_categories=host)
