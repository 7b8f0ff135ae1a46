"""Typed run configuration: what to train, on which layout, with which optimizer and data.

Every field has a default that trains `tiny` on the built-in corpus. A run's configuration comes from
three layers, later ones winning: these defaults, an optional TOML file (one table per section), and
command-line overrides; `settings.validate` turns every impossible combination into one
`ConfigError` whose message names the fix, so nothing bad reaches a process group.

This module is the vocabulary every other module shares, so it imports nothing of pipezero: where
settings come from and how they are checked is `settings.py`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any



class DType(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"


class Device(str, enum.Enum):
    AUTO = "auto"  # CUDA when torch sees a GPU, else CPU
    CPU = "cpu"  # gloo
    CUDA = "cuda"  # one GPU a local rank, NCCL


class ScheduleKind(str, enum.Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    LOOPED_BFS = "looped-bfs"
    ZB_H1 = "zb-h1"
    ZB_H2 = "zb-h2"
    ZB_V = "zb-v"
    DUALPIPE_V = "dualpipe-v"


class GradReduce(str, enum.Enum):
    STEP = "step"  # accumulate locally, one reduce a step
    MICROBATCH = "microbatch"  # reduce-scatter every micro-batch's gradients as they appear


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
    UNIFORM = "uniform"
    PARAMS = "params"
    COST = "cost"


@dataclass
class ModelConfig:
    """Shape of a Llama-style decoder. `preset` fills the shape; explicit fields override it."""

    preset: str = "tiny"
    vocab_size: int = 4096  # model rows; the tokenizer's vocabulary must fit in it
    dim: int = 128
    n_layers: int = 2  # transformer blocks; the layer list also holds embedding and head
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads (no grouped-query attention)
    ffn_dim: int | None = None  # None = SwiGLU's 8/3 * dim rounded up to a multiple of 64
    max_seq_len: int = 1024  # longest sequence the rotary cache is built for
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Set by a Hugging Face model (models/hf.py), defaults for the built-in shapes:
    head_dim: int | None = None  # None = dim // n_heads; some checkpoints set it apart (Mistral, Qwen)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2; Llama's attention_bias)
    out_bias: bool = False  # bias on the attention output projection (Llama's attention_bias)
    mlp_bias: bool = False  # biases on the three SwiGLU projections (Llama's mlp_bias)
    rope_llama3: list[float] | None = None  # Llama 3 rope scaling: factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings
    sliding_window: int | None = None  # a query sees only the newest N keys (Mistral); None = all
    window_layers: list[int] | None = None  # the blocks (0-based) the window applies to (Qwen2's
    # layer_types); None = every block
    pretrained: str | None = None  # a local Hugging Face model folder: shape, weights and tokenizer from it
    # "MODULE:NAME" of a ModelSpec of one's own (models/user_spec.py): the model is that spec, and the
    # shape fields above are unused
    spec: str | None = None


@dataclass
class ParallelConfig:
    """Layout of ranks and of the work of one optimizer step."""

    pp: int = 1  # pipeline ranks
    dp: int = 1  # data-parallel ranks per pipeline stage
    zero: int = 0  # ZeRO stage 0..3 across the dp ranks of a stage
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    microbatches: int = 4  # M micro-batches per dp rank per step
    micro_batch_size: int = 4  # B sequences per micro-batch
    virtual_stages: int = 1  # V stage chunks per pipeline rank
    partition: Partition = Partition.UNIFORM
    stage_layers: list[int] | None = None  # explicit layer count per stage chunk, overrides policy
    recompute: bool = False  # activation checkpointing per stage chunk
    grad_reduce: GradReduce = GradReduce.STEP
    placement: Placement = Placement.DP_INNER  # ranks -> (stage, replica); `pipezero plan` picks from bandwidths
    bucket_mb: float = 25.0  # gradient bucket size for all-reduce / reduce-scatter
    overlap_gather: bool = True  # ZeRO-1/2: each layer waits for its own updated weights in the next
    # forward (zero/updates.py); False: every all-gather is waited for at the end of the step
    zero3_keep_gathered: bool | None = None  # ZeRO-3 keeps a chunk gathered over its micro-batches;
    # None = yes when pp > 1 (a stage runs many micro-batches close together), else layer by layer
    timeout_s: float = 300.0  # every collective and p2p wait fails after this, naming the rank
    buckets_in_flight: int = 1  # ZeRO-2/3: gradient buckets whose reduce-scatter may still run while
    # the backward goes on (each holds a full bucket of gradient until it lands)
    hierarchical: bool = False  # gradient reductions in two levels, inside each node then across nodes
    # (parallel/hierarchical.py; gloo: it pays where a slow link joins the nodes)
    ranks_per_node: int | None = None  # for `hierarchical`; None = torchrun's LOCAL_WORLD_SIZE

    @property
    def world_size(self) -> int:
        return self.pp * self.dp


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to `min_lr`."""

    lr: float = 3e-3  # the tiny preset's; build_config takes each preset's from models/presets.py
    min_lr: float = 3e-4  # build_config: a tenth of lr unless set
    warmup_steps: int = 20  # the large presets take longer ones (models/presets.py PRESET_WARMUP)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    freeze: str | None = None  # regex (re.search) over parameter names `layers.{i}.…`: those tensors do not
    # train (no gradient, no AdamW state, not in ZeRO's buckets); freeze.py


@dataclass
class DataConfig:
    """Where tokens come from. `path=None` means the interpreter's standard-library source."""

    path: list[str] | None = None  # document files, folders or globs (data/sources.py), or one token file
    text_field: str = "text"  # the field of a jsonl/json record, or column of a parquet file, holding text
    on_bad_record: OnBadRecord = OnBadRecord.FAIL
    packing: Packing | None = None  # None: doc-masked for documents; the built-in corpus and token
    # files keep random windows over one token stream (they have no document boundaries to respect)
    tokenizer: str = "bpe"  # "bpe" (trained locally, cached), "bytes", or a tokenizer.json path
    bpe_vocab: int = 4096
    seq_len: int = 128
    heldout_fraction: float = 0.02
    max_bytes: int | None = None  # read at most this much text (for quick tests)
    max_document_mb: int = 8  # a larger document (record, parquet value, text file) is a bad record: tokenizing
    # one takes ~50-200x its size in memory (tokenizers' per-token state); 8 MB is one tokenizer batch's text

    def __post_init__(self) -> None:
        if isinstance(self.path, (str, Path)):  # one path given in code: a list of one
            self.path = [str(self.path)]


@dataclass
class RunConfig:
    max_steps: int = 200
    seed: int = 1234
    dtype: DType = DType.FP32
    device: Device = Device.AUTO
    out: str = "runs/latest"
    eval_every: int = 50  # held-out loss every K steps (and at the end); 0 = only at the end
    eval_batches: int = 4  # an evaluation reads this many global batches of held-out windows (any layout: the same)
    sample_tokens: int = 64  # length of the text sample printed at the end; 0 = none
    checkpoint_every: int = 0  # save a sharded checkpoint every K steps and at the end; 0 = never
    keep_checkpoints: int = 3  # the newest N complete checkpoints are kept, older ones deleted
    resume: bool = False  # continue from the newest good checkpoint under <out>/checkpoints
    max_bad_steps: int = 3  # non-finite loss/gradient steps skipped in a row before the run stops
    trace: bool = False
    tensorboard: bool = False  # also write metrics.jsonl's records as TensorBoard scalars under <out>/tensorboard
    trace_steps: int = 3  # with trace: events of the newest N steps are kept and written (bounded memory)
    threads: int | None = None  # torch intra-op threads per rank; None = cores / local ranks
    compile: bool = False  # torch.compile each transformer block (not with split-backward schedules)
    progress: bool = True


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

    nproc: int | None = None  # local ranks started through torchrun; None = this process is one rank
    max_restarts: int = 0  # torchrun restarts a failed job this often; the ranks resume from a checkpoint
