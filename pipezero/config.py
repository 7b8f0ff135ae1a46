"""Typed run configuration: what to train, on which layout, with which optimizer and data.

Every field has a default that trains `tiny` on the built-in corpus. A run's configuration comes from
three layers, later ones winning: these defaults, an optional TOML file (one table per section), and
command-line overrides. `validate()` turns every impossible combination into one `ConfigError`
whose message names the fix, so nothing bad reaches a process group.
"""

from __future__ import annotations

import dataclasses
import enum
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user mistake in the configuration; the CLI prints it and exits with code 2."""


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
    bucket_mb: float = 25.0  # gradient bucket size for all-reduce / reduce-scatter
    zero3_keep_gathered: bool | None = None  # ZeRO-3 keeps a chunk gathered over its micro-batches;
    # None = yes when pp > 1 (a stage runs many micro-batches close together), else layer by layer
    timeout_s: float = 300.0  # every collective and p2p wait fails after this, naming the rank

    @property
    def world_size(self) -> int:
        return self.pp * self.dp


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to `min_lr`."""

    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables


@dataclass
class DataConfig:
    """Where tokens come from. `path=None` means the interpreter's standard-library source."""

    path: str | None = None  # text file, folder of text files, or .bin/.npy token file
    tokenizer: str = "bpe"  # "bpe" (trained locally, cached), "bytes", or a tokenizer.json path
    bpe_vocab: int = 4096
    seq_len: int = 128
    heldout_fraction: float = 0.02
    max_bytes: int | None = None  # read at most this much text (for quick tests)


@dataclass
class RunConfig:
    max_steps: int = 200
    seed: int = 1234
    dtype: DType = DType.FP32
    device: Device = Device.AUTO
    out: str = "runs/latest"
    eval_every: int = 50  # held-out loss every K steps (and at the end); 0 = only at the end
    eval_batches: int = 4
    sample_tokens: int = 64  # length of the text sample printed at the end; 0 = none
    checkpoint_every: int = 0  # save a sharded checkpoint every K steps and at the end; 0 = never
    keep_checkpoints: int = 3  # the newest N complete checkpoints are kept, older ones deleted
    resume: bool = False  # continue from the newest good checkpoint under <out>/checkpoints
    max_bad_steps: int = 3  # non-finite loss/gradient steps skipped in a row before the run stops
    trace: bool = False
    tensorboard: bool = False  # also write metrics.jsonl's records as TensorBoard scalars under <out>/tensorboard
    trace_steps: int = 3  # with trace: events of the newest N steps are kept and written (bounded memory)
    threads: int | None = None  # torch intra-op threads per rank; None = cores / local ranks
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

    def validate(self) -> "TrainConfig":
        _validate(self)
        return self

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


SECTIONS = {f.name: f.type for f in dataclasses.fields(TrainConfig)}


def _coerce(cls: type, name: str, value: Any) -> Any:
    """Turn a TOML/CLI value into the field's declared type (enums from their string values)."""
    ftype = {f.name: f.type for f in dataclasses.fields(cls)}[name]
    for enum_cls in (DType, Device, ScheduleKind, GradReduce, Partition):
        if enum_cls.__name__ in str(ftype):
            try:
                return enum_cls(value)
            except ValueError:
                allowed = ", ".join(e.value for e in enum_cls)
                raise ConfigError(f"{name} = {value!r} is not one of: {allowed}") from None
    return value


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Set `section.field` keys (e.g. "parallel.pp") on `cfg` in place, coercing enum strings."""
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        sub = getattr(cfg, section, None)
        if sub is None or not dataclasses.is_dataclass(sub) or name not in {f.name for f in dataclasses.fields(sub)}:
            raise ConfigError(f"unknown setting {key!r}; sections are {', '.join(SECTIONS)}")
        setattr(sub, name, _coerce(type(sub), name, value))
    return cfg


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file of `[section]` tables into flat `section.field` overrides."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if section not in SECTIONS or not isinstance(table, dict):
            raise ConfigError(f"{p}: unknown table [{section}]; use one of {', '.join(SECTIONS)}")
        for name, value in table.items():
            flat[f"{section}.{name}"] = value
    return flat


def build_config(toml_path: str | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the preset's model shape, then TOML, then CLI overrides; validated."""
    from pipezero.models.presets import apply_preset

    flat: dict[str, Any] = load_toml(toml_path) if toml_path else {}
    flat.update(overrides or {})
    cfg = TrainConfig()
    preset = flat.get("model.preset", cfg.model.preset)
    apply_preset(cfg.model, preset)
    apply_overrides(cfg, flat)
    return cfg.validate()


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _validate(cfg: TrainConfig) -> None:
    m, p, o, d, r = cfg.model, cfg.parallel, cfg.optim, cfg.data, cfg.run
    _check(m.dim % m.n_heads == 0, f"model.dim={m.dim} must be a multiple of n_heads={m.n_heads}")
    kv = m.n_kv_heads or m.n_heads
    _check(m.n_heads % kv == 0, f"n_heads={m.n_heads} must be a multiple of n_kv_heads={kv}")
    _check((m.dim // m.n_heads) % 2 == 0, "head dimension (dim / n_heads) must be even for rotary positions")
    _check(m.n_layers >= 1, "model.n_layers must be at least 1")
    _check(d.seq_len >= 1, "--seq-len must be positive")
    _check(
        d.seq_len <= m.max_seq_len,
        f"--seq-len {d.seq_len} is longer than the model allows (max_seq_len={m.max_seq_len}); "
        f"lower --seq-len or raise model.max_seq_len",
    )
    _check(d.tokenizer in ("bpe", "bytes") or d.tokenizer.endswith(".json"),
           f"data.tokenizer={d.tokenizer!r}: use 'bpe', 'bytes' or a tokenizer.json path")
    _check(0.0 < d.heldout_fraction < 0.5, "data.heldout_fraction must lie in (0, 0.5)")
    _check(p.pp >= 1 and p.dp >= 1, "--pp and --dp must be at least 1")
    _check(p.microbatches >= 1, "--microbatches must be at least 1")
    _check(p.micro_batch_size >= 1, "--micro-batch-size must be at least 1")
    _check(p.virtual_stages >= 1, "--virtual-stages must be at least 1")
    _check(p.zero in (0, 1, 2, 3), f"--zero {p.zero}: choose 0, 1, 2 or 3")
    _check(p.bucket_mb > 0, "parallel.bucket_mb must be positive")
    _check(p.timeout_s > 0, "parallel.timeout_s must be positive")
    chunks = p.pp * p.virtual_stages
    layers = m.n_layers + 2  # embedding + blocks + head
    if p.stage_layers is not None:
        _check(
            len(p.stage_layers) == chunks,
            f"--stage-layers lists {len(p.stage_layers)} stages but pp x virtual-stages = {chunks}",
        )
        _check(all(n >= 0 for n in p.stage_layers), "--stage-layers entries must be >= 0")
        _check(
            sum(p.stage_layers) == layers,
            f"--stage-layers sums to {sum(p.stage_layers)} but the model has {layers} layers "
            f"(embedding + {m.n_layers} blocks + head)",
        )
    else:
        _check(
            chunks <= layers,
            f"pp x virtual-stages = {chunks} stage chunks but the model has only {layers} layers "
            f"(embedding + {m.n_layers} blocks + head); lower --pp/--virtual-stages or use a bigger preset",
        )
    _check(o.lr > 0 and o.min_lr >= 0 and o.min_lr <= o.lr, "need 0 <= optim.min_lr <= optim.lr and lr > 0")
    _check(o.warmup_steps >= 0 and o.grad_clip >= 0, "optim.warmup_steps and optim.grad_clip must be >= 0")
    _check(r.max_steps >= 1, "--max-steps must be at least 1")
    _check(r.eval_every >= 0 and r.eval_batches >= 1, "run.eval_every >= 0 and run.eval_batches >= 1")
    _check(r.checkpoint_every >= 0, "--checkpoint-every must be >= 0")
    _check(r.keep_checkpoints >= 1, "run.keep_checkpoints must be at least 1 (the checkpoint a resume needs)")
    _check(r.max_bad_steps >= 1, "run.max_bad_steps must be at least 1")
    if d.path is not None:
        _check(Path(d.path).exists(), f"--data {d.path!r} does not exist; pass a text file, a folder or a token file")
    if d.tokenizer.endswith(".json"):
        _check(Path(d.tokenizer).is_file(), f"tokenizer file {d.tokenizer!r} does not exist")
    # Layout rules that depend on the schedule live with the schedules; import lazily to keep
    # config importable on its own.
    from pipezero.parallel.device import device_kind
    from pipezero.schedules.registry import check_layout

    device_kind(r.device)

    try:
        check_layout(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    except ValueError as e:
        raise ConfigError(str(e)) from None
