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
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from pipezero.coerce import Range, choices, coerce, describe
from pipezero.errors import ConfigError  # raised here, and imported from here by most modules


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
    zero3_keep_gathered: bool | None = None  # ZeRO-3 keeps a chunk gathered over its micro-batches;
    # None = yes when pp > 1 (a stage runs many micro-batches close together), else layer by layer
    timeout_s: float = 300.0  # every collective and p2p wait fails after this, naming the rank

    @property
    def world_size(self) -> int:
        return self.pp * self.dp


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then cosine decay to `min_lr`."""

    lr: float = 3e-3  # the tiny preset's; build_config takes each preset's from models/presets.py
    min_lr: float = 3e-4  # build_config: a tenth of lr unless set
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; 0 disables


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

POSITIVE_INT, NON_NEGATIVE, POSITIVE = Range(1), Range(0), Range(0, open_low=True)
# The accepted values of every numeric setting; settings not listed accept any value of their type.
RANGES: dict[str, Range] = {
    **{f"model.{k}": POSITIVE_INT for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                            "max_seq_len")},
    "model.norm_eps": POSITIVE, "model.rope_theta": POSITIVE,
    **{f"parallel.{k}": POSITIVE_INT for k in ("pp", "dp", "microbatches", "micro_batch_size", "virtual_stages")},
    "parallel.zero": Range(0, 3), "parallel.stage_layers": NON_NEGATIVE,
    "parallel.bucket_mb": POSITIVE, "parallel.timeout_s": POSITIVE,
    "optim.lr": POSITIVE, "optim.min_lr": NON_NEGATIVE, "optim.warmup_steps": NON_NEGATIVE,
    "optim.weight_decay": NON_NEGATIVE, "optim.beta1": Range(0, 1, open_high=True),
    "optim.beta2": Range(0, 1, open_high=True), "optim.eps": POSITIVE, "optim.grad_clip": NON_NEGATIVE,
    "data.bpe_vocab": Range(257), "data.seq_len": POSITIVE_INT, "data.max_bytes": POSITIVE_INT,
    "data.heldout_fraction": Range(0, 0.5, open_low=True, open_high=True),
    **{f"run.{k}": POSITIVE_INT for k in ("max_steps", "eval_batches", "keep_checkpoints", "max_bad_steps", "threads")},
    **{f"run.{k}": NON_NEGATIVE for k in ("seed", "eval_every", "sample_tokens", "checkpoint_every")},
    "launch.nproc": POSITIVE_INT, "launch.max_restarts": NON_NEGATIVE,
}


@dataclass
class LaunchConfig:
    """How the local launcher starts ranks; not saved with a run (it does not change what is computed)."""

    nproc: int | None = None  # local ranks started through torchrun; None = this process is one rank
    max_restarts: int = 0  # torchrun restarts a failed job this often; the ranks resume from a checkpoint

    def check(self, world_size: int) -> "LaunchConfig":
        """Refuse a launch that cannot be the configured layout."""
        if self.nproc is not None and self.nproc != world_size:
            raise ConfigError(f"--nproc {self.nproc} but pp x dp = {world_size}; make them equal")
        if self.max_restarts and (self.nproc or 1) < 2:
            raise ConfigError(f"--max-restarts {self.max_restarts} needs --nproc > 1 (the local launcher restarts "
                              f"ranks); under an outside torchrun, pass --max-restarts to torchrun")
        return self


def _sections(launch: bool) -> dict[str, type]:
    """Section name -> dataclass: a run's sections, or with `launch` the launcher's one."""
    return {"launch": LaunchConfig} if launch else typing.get_type_hints(TrainConfig)


def setting_type(key: str) -> Any:
    """The declared type of setting `section.field` (e.g. "parallel.pp" -> int)."""
    section, _, name = key.partition(".")
    sections = _sections(section == "launch")
    if section not in sections:
        raise ConfigError(f"unknown setting {key!r}; sections are {', '.join(_sections(False))}")
    fields = typing.get_type_hints(sections[section])
    if name not in fields:
        raise ConfigError(f"unknown setting {key!r}; [{section}] accepts {', '.join(fields)}")
    return fields[name]


def coerce_setting(key: str, value: Any, from_text: bool = False, name: str | None = None) -> Any:
    """`value` checked and converted for setting `key`; `name` is how errors call it (a CLI flag)."""
    return coerce(name or key, setting_type(key), value, from_text, RANGES.get(key))


def choices_of(key: str) -> list[str] | None:
    """The values of an enum setting, for help texts; None for other settings."""
    return choices(setting_type(key))


def accepts(key: str) -> str:
    """What setting `key` accepts, for help texts."""
    return describe(setting_type(key), RANGES.get(key))


def apply_overrides(cfg: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """Set already coerced `section.field` values on `cfg` in place."""
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def build_launch(values: dict[str, Any], names: dict[str, str] | None = None) -> LaunchConfig:
    """The launcher's settings from command-line text (`launch.nproc`, ...), checked like any other."""
    names = names or {}
    return LaunchConfig(**{k.partition(".")[2]: coerce_setting(k, v, from_text=True, name=names.get(k))
                           for k, v in values.items()})


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


def build_config(toml_path: str | None = None, overrides: dict[str, Any] | None = None,
                 names: dict[str, str] | None = None) -> TrainConfig:
    """Defaults, then the preset's model shape and learning rate, then TOML, then overrides;
    validated. Overrides may be typed values (from code) or strings (the command line), which are
    parsed; `names` says how errors call an override's key (its flag). Unless set, `optim.min_lr`
    is a tenth of the peak rate."""
    from pipezero.models.presets import PRESET_LR, apply_preset

    names = names or {}
    flat = {k: coerce_setting(k, v) for k, v in (load_toml(toml_path) if toml_path else {}).items()}
    flat.update({k: coerce_setting(k, v, from_text=True, name=names.get(k)) for k, v in (overrides or {}).items()})
    if any(k.startswith("launch.") for k in flat):
        raise ConfigError(f"launcher settings {sorted(k for k in flat if k.startswith('launch.'))} are not run settings")
    cfg = TrainConfig()
    preset = flat.get("model.preset", cfg.model.preset)
    apply_preset(cfg.model, preset)
    cfg.optim.lr = PRESET_LR.get(preset, cfg.optim.lr)
    apply_overrides(cfg, flat)
    if "optim.min_lr" not in flat:
        cfg.optim.min_lr = cfg.optim.lr / 10
    return cfg.validate()


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _validate(cfg: TrainConfig) -> None:
    m, p, o, d, r = cfg.model, cfg.parallel, cfg.optim, cfg.data, cfg.run
    for section in _sections(False):  # a configuration built in code passes the same checks as a file
        for f in dataclasses.fields(getattr(cfg, section)):
            coerce_setting(f"{section}.{f.name}", getattr(getattr(cfg, section), f.name))
    _check(m.dim % m.n_heads == 0, f"model.dim={m.dim} must be a multiple of n_heads={m.n_heads}")
    kv = m.n_kv_heads or m.n_heads
    _check(m.n_heads % kv == 0, f"n_heads={m.n_heads} must be a multiple of n_kv_heads={kv}")
    _check((m.dim // m.n_heads) % 2 == 0, "head dimension (dim / n_heads) must be even for rotary positions")
    _check(
        d.seq_len <= m.max_seq_len,
        f"--seq-len {d.seq_len} is longer than the model allows (max_seq_len={m.max_seq_len}); "
        f"lower --seq-len or raise model.max_seq_len",
    )
    _check(d.tokenizer in ("bpe", "bytes") or d.tokenizer.endswith(".json"),
           f"data.tokenizer={d.tokenizer!r}: use 'bpe', 'bytes' or a tokenizer.json path")
    chunks = p.pp * p.virtual_stages
    layers = m.n_layers + 2  # embedding + blocks + head
    if p.stage_layers is not None:
        _check(
            len(p.stage_layers) == chunks,
            f"--stage-layers lists {len(p.stage_layers)} stages but pp x virtual-stages = {chunks}",
        )
        _check(
            sum(p.stage_layers) == layers,
            f"--stage-layers sums to {sum(p.stage_layers)} but the model has {layers} layers "
            f"(embedding + {m.n_layers} blocks + head)",
        )
        _check(p.stage_layers[0] >= 1 and p.stage_layers[-1] >= 1,
               f"--stage-layers {','.join(map(str, p.stage_layers))}: the first chunk must hold the embedding "
               f"and the last the head; only chunks in between may be empty")
    else:
        _check(
            chunks <= layers,
            f"pp x virtual-stages = {chunks} stage chunks but the model has only {layers} layers "
            f"(embedding + {m.n_layers} blocks + head); lower --pp/--virtual-stages or use a bigger preset",
        )
    _check(o.min_lr <= o.lr, f"optim.min_lr = {o.min_lr:g}: expected a number <= optim.lr ({o.lr:g})")
    if d.path is not None:
        import glob

        for arg in d.path:
            _check(Path(arg).exists() or bool(glob.glob(arg, recursive=True)),
                   f"--data {arg!r} does not exist; pass document files, folders, globs or a token file")
    if d.tokenizer.endswith(".json"):
        _check(Path(d.tokenizer).is_file(), f"tokenizer file {d.tokenizer!r} does not exist")
    # Layout rules that depend on the schedule live with the schedules; import lazily to keep
    # config importable on its own.
    from pipezero.parallel.device import device_kind
    from pipezero.schedules.registry import SPLIT_BACKWARD, check_layout

    device_kind(r.device)

    try:
        check_layout(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check(not (r.compile and p.schedule in SPLIT_BACKWARD),
           f"--compile cannot run --schedule {p.schedule.value}: its split backward (B then W) records and "
           f"replays the blocks' weight operations, which a compiled block hides; use 1f1b, gpipe or "
           f"interleaved-1f1b with --compile, or drop --compile")
