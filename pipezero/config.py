"""Typed run configuration: what to train, on which layout, with which optimizer and data.

Every field has a default that trains `tiny` on the built-in corpus. A run's configuration comes from
three layers, later ones winning: these defaults, an optional TOML file (one table per section), and
command-line overrides; `settings.validate` turns every impossible combination into one
`ConfigError` whose message names the fix, so nothing bad reaches a process group.

Each field's docstring (the string under it) is its documentation: the site's configuration
reference is generated from them, and a test fails for a field without one.

This module is the vocabulary every other module shares, so it imports nothing of pipezero: where
settings come from and how they are checked is `settings.py`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Any



class DType(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"


class Device(str, enum.Enum):
    AUTO = "auto"  # CUDA when torch sees a GPU, else CPU
    CPU = "cpu"  # gloo
    CUDA = "cuda"  # one GPU a local rank, NCCL


class ShareDevice(str, enum.Enum):
    """Whether ranks on one node may share a GPU (parallel/device.py, parallel/staging.py)."""

    AUTO = "auto"  # share when a node has more ranks than GPUs (and at least one GPU)
    OFF = "off"  # never: more ranks than GPUs fall back to CPU (--device auto) or are refused (cuda)
    ON = "on"  # always through the host: gloo with staging copies, also on CPU ranks (the test path)


class ScheduleKind(str, enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    LOOPED_BFS = "looped-bfs"
    ZB_H1 = "zb-h1"
    ZB_H2 = "zb-h2"
    ZB_V = "zb-v"
    DUALPIPE_V = "dualpipe-v"
    V_HALF = "v-half"


class GradReduce(str, enum.Enum):
    STEP = "step"  # accumulate locally, one reduce a step
    MICROBATCH = "microbatch"  # reduce-scatter every micro-batch's gradients as they appear


class WeightQuant(str, enum.Enum):
    NONE = "none"
    INT8 = "int8"  # one signed byte an element, one fp32 scale a block


class GradQuant(str, enum.Enum):
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"  # two elements a byte


class SecondaryShard(str, enum.Enum):
    NONE = "none"
    NODE = "node"  # ZeRO-3: a copy of the parameters split over each node's ranks (ZeRO++'s hpZ)


class Zero3Unit(str, enum.Enum):
    LAYER = "layer"  # a layer's parameters are gathered, released and reduced together
    SUBLAYER = "sublayer"  # each part of a layer that names parts apart (a block's attention, its MLP)


class Offload(str, enum.Enum):
    NONE = "none"
    OPTIMIZER = "optimizer"  # fp32 master shards and AdamW moments in host memory, the step on the CPU


class Placement(str, enum.Enum):
    """Which neighbouring global ranks (those of one node) share: a stage or a pipeline."""

    DP_INNER = "dp-inner"  # rank = stage * D + replica: a stage's replicas together, gradient traffic inside a node
    PP_INNER = "pp-inner"  # rank = replica * P + stage: a pipeline's stages together, activations inside a node


class Packing(str, enum.Enum):
    DOC_MASKED = "doc-masked"  # documents packed into windows; attention and loss stay inside a document
    CONCAT = "concat"  # documents packed into windows with EOS between them, attention across them
    NONE = "none"  # one document a sequence: cut at --seq-len, the rest of the row ignored


class OnBadRecord(str, enum.Enum):
    FAIL = "fail"  # stop at the first bad record, naming its file and line
    SKIP = "skip"  # skip bad records and print how many


class Partition(str, enum.Enum):
    UNIFORM = "uniform"  # equal layer counts
    PARAMS = "params"  # equal parameters
    COST = "cost"  # equal modelled compute time
    MEMORY = "memory"  # the least largest predicted per-rank peak (memory/partition.py)


MAX_LAYERS = 4096  # transformer blocks a model may have (model.n_layers, a --model-spec's n_layers): settings.py


@dataclass
class ModelConfig:
    """Shape of a Llama-style decoder. `preset` fills the shape; explicit fields override it."""

    preset: str = "tiny"
    """A named shape (models/presets.py: tiny, small, base, 1b, 7b, 13b, 70b) with its own learning
    rate and warm-up, so one word gives a model that trains as intended."""
    vocab_size: int = 4096
    """Rows of the embedding and the head; the tokenizer's vocabulary must fit in it."""
    dim: int = 128
    """Width of the residual stream."""
    n_layers: int = 2
    """Transformer blocks; the layer list that stages are cut from also holds the embedding and the head."""
    n_heads: int = 4
    """Attention heads (query heads under grouped-query attention)."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None = n_heads (none shared)."""
    ffn_dim: int | None = None
    """Hidden width of the SwiGLU MLP; None = 8/3 x dim rounded up to a multiple of 64, Llama's rule."""
    max_seq_len: int = 1024
    """Longest sequence the rotary cache is built for; --seq-len may not exceed it."""
    tie_embeddings: bool = False
    """The head reuses the embedding matrix (one tensor held by the first and last stage, its
    gradients summed between them)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies."""
    head_dim: int | None = None
    """Width of one head; None = dim // n_heads. Set by Hugging Face models that choose it apart
    (Mistral, Qwen)."""
    qkv_bias: bool = False
    """Biases on the q, k, v projections (Qwen2; Llama's attention_bias)."""
    out_bias: bool = False
    """Bias on the attention output projection (Llama's attention_bias)."""
    mlp_bias: bool = False
    """Biases on the three SwiGLU projections (Llama's mlp_bias)."""
    rope_llama3: list[float] | None = None
    """Llama 3 rope scaling as four numbers: factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings; None = no scaling."""
    sliding_window: int | None = None
    """A query sees only the newest N keys (Mistral, Qwen2); None = all keys."""
    window_layers: list[int] | None = None
    """The blocks (0-based) the sliding window applies to (Qwen2's layer_types); None = every block."""
    pretrained: str | None = None
    """A local Hugging Face model folder: shape, weights and tokenizer come from it, and the shape
    settings above are refused beside it."""
    spec: str | None = None
    """"MODULE:NAME" of a ModelSpec of one's own (models/user_spec.py): the model is that spec, and
    the shape settings above are unused."""


# --buckets-in-flight's default: the planner prices layouts with it where the user gives none
BUCKETS_IN_FLIGHT = 1

@dataclass
class ParallelConfig:
    """Layout of ranks and of the work of one optimizer step."""

    pp: int = 1
    """Pipeline ranks: the model's layers are cut into pp x virtual_stages chunks."""
    dp: int = 1
    """Data-parallel ranks per pipeline stage."""
    zero: int = 0
    """ZeRO stage across the dp ranks of a stage: 1 shards optimizer state, 2 also gradients, 3 also
    parameters."""
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    """Pipeline schedule (schedules/registry.py says what each is for)."""
    microbatches: int = 4
    """M micro-batches per data-parallel rank per step; more of them shrink the pipeline bubble."""
    micro_batch_size: int = 4
    """B sequences per micro-batch."""
    virtual_stages: int = 1
    """V stage chunks per pipeline rank (interleaved and V-shaped schedules need 2 or more; left unset,
    settings.py gives the schedule its fewest, as simulate and plan read a schedule named alone)."""
    partition: Partition = Partition.UNIFORM
    """How layers are split over stage chunks: equal layer counts, equal parameters, equal cost, or
    `memory`: the cuts whose largest predicted per-rank peak (memory/model.py) is least, which gives
    1F1B's first rank, holding P micro-batches of activations, fewer layers than its last."""
    stage_layers: list[int] | None = None
    """Explicit layer count per stage chunk (embedding and head included); overrides `partition`."""
    recompute: bool = False
    """Activation checkpointing one transformer block at a time (torchtitan's "full"): a micro-batch in
    flight keeps each block's input only, and each block's backward runs its forward again first, so
    a backward holds one block's activations at a time, for about a third more compute."""
    grad_reduce: GradReduce = GradReduce.STEP
    """Reduce gradients once a step (memory: a full gradient through the step) or every micro-batch
    (more reduce-scatters, the gradient never outlives one backward)."""
    placement: Placement = Placement.DP_INNER
    """Which ranks share a node: a stage's replicas (dp-inner, gradient traffic inside a node) or a
    pipeline's stages (pp-inner, activations inside a node); `pipezero plan` weighs both."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MB: reductions start a bucket at a time while backward runs."""
    overlap_gather: bool = True
    """ZeRO-1/2: each layer waits for its own updated weights in the next forward (zero/weight_waits.py);
    False: every all-gather is waited for at the end of the step."""
    zero3_keep_gathered: bool | None = None
    """ZeRO-3 keeps a chunk gathered over its micro-batches; None = yes when pp > 1 (a stage runs
    many micro-batches close together), else layer by layer."""
    zero3_prefetch: int | Literal["auto"] = 1
    """ZeRO-3 layer by layer: how many layers ahead of its use a layer's gather starts, in forward
    and backward (d + 1 layers gathered or in flight at once); `auto`: the planner's choice
    (planner/prefetch.py), the smallest depth deeper than which the simulated exposed gather time stops
    improving, within `run.gpu_memory_gib`, for the link `link_gbps` and the compute `tflops`."""
    zero3_unit: Zero3Unit = Zero3Unit.LAYER
    """ZeRO-3 layer by layer: what one gather, release and gradient reduction covers; `sublayer`: a
    block's attention (with its norm) and its MLP (with its norm) apart, so the step's first gather
    and last reduction, which no compute can hide, move a part of a block, and a part's gather hides
    behind the other part's compute (one more bucket a block; not with --compile)."""
    link_gbps: float | None = None
    """GB/s a rank's data-parallel traffic gets on the link between nodes; only `zero3_prefetch = auto`
    reads it (required there)."""
    tflops: float | None = None
    """TFLOP/s one rank's compute achieves; only `zero3_prefetch = auto` reads it (default: 445 on
    CUDA, an H100 at 45% of its bf16 peak; 0.05 on CPU, one thread of this project's test host)."""
    timeout_s: float = 300.0
    """Seconds any collective or p2p wait may take before the run fails naming the rank and what it
    waited for."""
    stall_report_s: float | None = None
    """Seconds a wait may take before every rank writes its flight record for the hang doctor
    (runtime/watch.py); None = a quarter of `timeout_s`."""
    buckets_in_flight: int = BUCKETS_IN_FLIGHT
    """ZeRO-2/3: gradient buckets whose reduce-scatter may still run while the backward goes on
    (each holds a full bucket of gradient until it lands)."""
    hierarchical: bool = False
    """Gradient reductions in two levels, inside each node then across nodes (parallel/hierarchical.py;
    gloo only: it pays where a slow link joins the nodes)."""
    ranks_per_node: int | None = None
    """Ranks a node for `hierarchical`; None = torchrun's LOCAL_WORLD_SIZE."""
    quantize_weights: WeightQuant = WeightQuant.NONE
    """ZeRO-3's parameter gathers and ZeRO-1/2's gathers of updated weights travel as int8 codes with
    one fp32 scale a `quant_block` elements (zero/quantize.py), about 1/4 of fp32's bytes; the fp32
    master shards are never quantized."""
    quantize_grads: GradQuant = GradQuant.NONE
    """Gradient reductions travel blockwise-quantized (int8 or int4) and are summed in fp32 on arrival:
    a reduce-scatter becomes an exchange of quantized slices (two-level with `hierarchical`), an
    all-reduce (ZeRO-0) that exchange followed by a quantized gather of the sums."""
    secondary_shard: SecondaryShard = SecondaryShard.NONE
    """ZeRO-3 layer by layer: after a step's first gather of a bucket each rank keeps its 1/N share
    of it (N ranks of its group on its node), so the step's later gathers of that bucket stay
    inside the node (ZeRO++'s hpZ); costs 4/N bytes a parameter."""
    quant_block: int = 256
    """Elements sharing one fp32 scale in `quantize_weights` and `quantize_grads`: smaller blocks
    keep more precision next to a large value and send 4 bytes more a block."""

    offload: Offload = Offload.NONE
    """`optimizer`: each rank's fp32 master shards and AdamW moments live in host memory (pinned on
    CUDA) and AdamW steps there, a bucket at a time: each reduced gradient shard is copied to the
    host once its reduction lands, each updated shard back before the next forward reads it. The
    device keeps the compute copy of the weights; host memory and the copies pay for it."""
    offload_activations: int = 0
    """On each pipeline rank, this many micro-batches' saved activations leave the device between
    their forward and backward (the first ones held across two or more other actions: the warm-up's,
    alive when the rank holds the most), copied to host memory after the forward and back one action
    before the backward, each copy beside an action (schedules/lowering.py places OFFLOAD_ACT, RELOAD_ACT).
    Not with `recompute`."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to `min_lr`."""

    lr: float = 3e-3
    """Peak learning rate; build_config takes each preset's from models/presets.py (this is tiny's)."""
    min_lr: float = 3e-4
    """Rate at the end of the cosine decay; build_config makes it a tenth of lr unless set."""
    warmup_steps: int = 20
    """Steps of linear warm-up to the peak rate; the large presets take longer ones
    (models/presets.py PRESET_WARMUP)."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's denominator epsilon."""
    grad_clip: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables clipping."""
    freeze: str | None = None
    """Regex (re.search) over parameter names `layers.{i}.…`: those tensors do not train (no gradient,
    no AdamW state, not in ZeRO's buckets); freeze.py."""


@dataclass
class DataConfig:
    """Where tokens come from. `path=None` means the interpreter's standard-library source."""

    path: list[str] | None = None
    """Document files, folders or globs (data/sources.py), or one token file (.npy, .bin);
    None = the Python standard library's source as a built-in corpus."""
    text_field: str = "text"
    """The field of a jsonl/json record, or column of a parquet file, holding a document's text."""
    on_bad_record: OnBadRecord = OnBadRecord.FAIL
    """A bad record stops the run naming its file and line (fail), or is counted and skipped."""
    packing: Packing | None = None
    """How documents become windows; None: doc-masked for documents, while the built-in corpus and
    token files keep random windows over one token stream (they have no document boundaries)."""
    tokenizer: str = "bpe"
    """"bpe" (trained locally on the data, cached), "bytes", or a tokenizer.json path."""
    bpe_vocab: int = 4096
    """Vocabulary size of the locally trained BPE."""
    seq_len: int = 128
    """Tokens a sequence."""
    heldout_fraction: float = 0.02
    """Share of documents held out, whole, for evaluation (every k-th, k = 1 / fraction)."""
    max_bytes: int | None = None
    """Read at most this much text (for quick tests); None = all of it."""
    max_document_mb: int = 8
    """A larger document (record, parquet value, text file) is a bad record: tokenizing one takes
    ~50-200x its size in memory (tokenizers' per-token state); 8 MB is one tokenizer batch's text."""

    def __post_init__(self) -> None:
        if isinstance(self.path, (str, Path)):  # one path given in code: a list of one
            self.path = [str(self.path)]


@dataclass
class RunConfig:
    """How long to train, where to write, and what to record on the way."""

    max_steps: int = 200
    """Optimizer steps."""
    seed: int = 1234
    """Seed of the initial weights and the data order; with the data, batch and length it fixes
    every step's global batch whatever the layout."""
    dtype: DType = DType.FP32
    """Compute and communication dtype; master weights and AdamW state stay fp32."""
    device: Device = Device.AUTO
    """cpu (gloo), cuda (GPU LOCAL_RANK, NCCL), or auto: cuda when torch sees a GPU."""
    share_device: ShareDevice = ShareDevice.AUTO
    """Ranks sharing one GPU (NCCL refuses two ranks on one GPU): every transfer and collective over
    gloo through pinned host buffers, each rank capped to its share of the GPU's memory. auto: when a
    node has more ranks than GPUs; on: always, and on CPU ranks the staging copies still happen (the
    test of that path); off: never. Proves memory and CUDA code paths, not multi-GPU throughput."""
    out: str = "runs/latest"
    """Run directory: metrics.jsonl, summary.json, config.json, checkpoints."""
    eval_every: int = 50
    """Held-out loss every K steps (and at the end); 0 = only at the end."""
    eval_batches: int = 4
    """An evaluation reads this many global batches of held-out windows (any layout: the same ones)."""
    sample_tokens: int = 64
    """Length of the text sample printed at the end; 0 = none."""
    checkpoint_every: int = 0
    """Save a sharded checkpoint every K steps (and at the end unless save_final is off); 0 = only at the end."""
    save_final: bool = True
    """Save a checkpoint after the last step, so a run keeps what it trained (--no-save-final: none, also
    with checkpoint_every, unless the last step is one of its multiples)."""
    keep_checkpoints: int = 3
    """The newest N complete checkpoints of this run are kept, older ones deleted."""
    resume: bool = False
    """Continue from the newest good checkpoint under <out>/checkpoints (a fresh start if none)."""
    max_bad_steps: int = 3
    """Non-finite loss/gradient steps skipped in a row before the run stops."""
    trace: bool = False
    """Write trace.json (Chrome/Perfetto) and trace.png, the measured timeline of the last step."""
    tensorboard: bool = False
    """Also write metrics.jsonl's records as TensorBoard scalars under <out>/tensorboard."""
    trace_steps: int = 3
    """With trace: events of the newest N steps are kept and written (bounded memory)."""
    threads: int | None = None
    """Torch intra-op threads per rank; None = OMP_NUM_THREADS where set, else cores / local ranks."""
    compile: bool = False
    """torch.compile each transformer block (not with split-backward schedules)."""
    progress: bool = True
    """A progress bar on a terminal (a plain line every tenth of the run otherwise); False: a plain
    line every step (step, loss, tokens/s)."""
    quiet: bool = False
    """Print none of the run's own lines (opening, per step, closing): `verify` runs a layout and
    reports it itself. Errors and warnings are still said."""
    memory_profile: bool = False
    """Measure each rank's peak memory of the first step, the first evaluation and the text sample
    (CUDA: the caching allocator's peak; CPU: live tensor bytes from the profiler's memory events) and
    write them beside the memory model's prediction in summary.json. Off: nothing is measured, nothing
    is paid."""
    gpu_memory_gib: float | None = None
    """Refuse, before any rank starts, a layout whose predicted peak on some rank exceeds this many GiB
    (memory/model.py). None: on CUDA the device's memory, on CPU no check."""
    host_memory_gib: float | None = None
    """GiB of host memory a node has for its ranks: refuse, before any rank starts, a run whose
    ranks on this node need more host bytes (memory/offload.py: --offload optimizer's buffers, and on
    CPU ranks their whole predicted peak). None: this machine's memory."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: M x B x D."""
        p = self.parallel
        return p.microbatches * p.micro_batch_size * p.dp

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


@dataclass
class LaunchConfig:
    """How the local launcher starts ranks; not saved with a run (it does not change what is computed)."""

    nproc: int | None = None
    """Local ranks started through torchrun; None = this process is one rank."""
    max_restarts: int = 0
    """torchrun restarts a failed job this often; the ranks resume from a checkpoint."""
