"""Where a run's settings come from and how they are checked: defaults, a preset, a TOML file and
command-line text, each value checked against its field's type and range (`coerce.py`), then the
whole configuration against the layout rules, so every mistake is one `ConfigError` naming the fix
before any process starts.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import tomllib
import typing
from pathlib import Path
from typing import Any

from pipezero.coerce import Range, choices, coerce, describe
from pipezero.coerce import shown as toml_value
from pipezero.config import (MAX_LAYERS, LaunchConfig, Packing, ParallelConfig, Partition, ScheduleKind,
                             SecondaryShard, ShareDevice, TrainConfig, WeightQuant, Zero3Unit)
from pipezero.errors import ConfigError
from pipezero.models.presets import PRESET_LR, PRESET_WARMUP, apply_preset
from pipezero.schedules.compile import layerwise
from pipezero.schedules.actions import Schedule
from pipezero.schedules.registry import SPLIT_BACKWARD, check_layout
from pipezero.schedules.zero_rules import RULES

SECTIONS = {f.name: f.type for f in dataclasses.fields(TrainConfig)}

POSITIVE_INT, NON_NEGATIVE, POSITIVE = Range(1), Range(0), Range(0, open_low=True)
# The accepted values of every numeric setting; settings not listed accept any value of their type.
RANGES: dict[str, Range] = {
    **{f"model.{k}": POSITIVE_INT for k in ("vocab_size", "dim", "n_heads", "n_kv_heads", "ffn_dim",
                                            "max_seq_len", "head_dim", "sliding_window")},
    # the plan, the memory model and the fit check walk every layer (and, recomputing, every layer
    # of a chunk for each): 200000 layers ran simulate --memory past 120 s and kept train 66 s from
    # its refusal; 4096 answers in seconds, and the deepest published decoders have ~130
    "model.n_layers": Range(1, MAX_LAYERS),
    "model.window_layers": NON_NEGATIVE,
    "model.norm_eps": POSITIVE, "model.rope_theta": POSITIVE, "model.rope_llama3": POSITIVE,
    **{f"parallel.{k}": POSITIVE_INT for k in ("pp", "dp", "microbatches", "micro_batch_size", "virtual_stages")},
    "parallel.zero": Range(0, 3), "parallel.stage_layers": NON_NEGATIVE,
    # a week: every wait is bounded by it, and 1e300 s overflowed the process group's timedelta on each rank
    # at least a second: the rendezvous waits this long too, and 1e-300 s (0 ms) failed every rank's connect
    "parallel.bucket_mb": POSITIVE, "parallel.timeout_s": Range(1, 7 * 86400),
    "parallel.stall_report_s": Range(0, 7 * 86400, open_low=True),  # as the timeout it reports within
    "run.gpu_memory_gib": POSITIVE,  # a limit of -1 GiB is a typo, not a layout that does not fit
    "run.host_memory_gib": POSITIVE,
    "parallel.ranks_per_node": POSITIVE_INT,
    "parallel.buckets_in_flight": POSITIVE_INT,
    "parallel.offload_activations": Range(0, 1 << 20),
    "parallel.zero3_prefetch": Range(1, 64), "parallel.link_gbps": POSITIVE, "parallel.tflops": POSITIVE,
    # a bucket is padded to whole blocks: 10^12 would have every rank allocate 4 TB
    "parallel.quant_block": Range(1, 1 << 20),
    "optim.lr": POSITIVE, "optim.min_lr": NON_NEGATIVE, "optim.warmup_steps": NON_NEGATIVE,
    "optim.weight_decay": NON_NEGATIVE, "optim.beta1": Range(0, 1, open_high=True),
    "optim.beta2": Range(0, 1, open_high=True), "optim.eps": POSITIVE, "optim.grad_clip": NON_NEGATIVE,
    "data.bpe_vocab": Range(257), "data.seq_len": POSITIVE_INT, "data.max_bytes": POSITIVE_INT,
    "data.max_document_mb": POSITIVE_INT,
    "data.heldout_fraction": Range(0, 0.5, open_low=True, open_high=True),
    **{f"run.{k}": POSITIVE_INT for k in ("eval_batches", "keep_checkpoints", "max_bad_steps", "trace_steps")},
    # past int64 the step counter a checkpoint stores cannot hold it, and 2^63 steps "trained for ever";
    # 10^12 steps is past any run (a step a microsecond for eleven days)
    "run.max_steps": Range(1, 10**12),
    "run.threads": Range(1, 1024),  # 100000 crashed the interpreter (OpenMP could not start them): SIGSEGV
    **{f"run.{k}": NON_NEGATIVE for k in ("eval_every", "checkpoint_every")},
    # torch's generators take 64 bits, and each block's is seed x 1000003 + its index (models/llama.py):
    # a seed of 2^64 overflows them; 32 bits leave that product room
    "run.seed": Range(0, 2**32 - 1),
    "run.sample_tokens": Range(0, 4096),  # a token a whole forward (no cache): 1e11 never ended
    # one host's ranks: each imports torch (~300 MB) before it can refuse anything, so 100000 would
    # exhaust the host's memory and process table; more ranks than this run under an outside torchrun
    "launch.nproc": Range(1, 256), "launch.max_restarts": NON_NEGATIVE,
}


def check_launch(launch: LaunchConfig, world_size: int) -> LaunchConfig:
    """Refuse a launch that cannot be the configured layout."""
    if launch.nproc is not None and launch.nproc != world_size:
        raise ConfigError(f"--nproc {launch.nproc} but pp x dp = {world_size}; make them equal")
    if launch.max_restarts and (launch.nproc or 1) < 2:
        import os

        from pipezero.slurm import in_srun_step

        if in_srun_step(os.environ) and "TORCHELASTIC_RUN_ID" not in os.environ:  # no torchrun there to pass it to
            raise ConfigError(f"--max-restarts {launch.max_restarts}: inside an srun step no local launcher restarts "
                              f"ranks; Slurm restarts the job: submit it with `sbatch --requeue` and train with "
                              f"--resume --checkpoint-every K (each start resumes from the newest checkpoint; "
                              f"examples/slurm/*.sbatch do), and drop --max-restarts")
        raise ConfigError(f"--max-restarts {launch.max_restarts} needs --nproc > 1 (the local launcher restarts "
                          f"ranks); under an outside torchrun, pass --max-restarts to torchrun")
    return launch


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A config dataclass's field types, resolved once: the annotations are strings (postponed
    evaluation), and resolving them for every setting of every build_config took seconds per
    hundred configurations."""
    return typing.get_type_hints(cls)


def _sections(launch: bool) -> dict[str, type]:
    """Section name -> dataclass: a run's sections, or with `launch` the launcher's one."""
    return {"launch": LaunchConfig} if launch else _hints(TrainConfig)


def setting_type(key: str) -> Any:
    """The declared type of setting `section.field` (e.g. "parallel.pp" -> int)."""
    section, _, name = key.partition(".")
    sections = _sections(section == "launch")
    if section not in sections:
        raise ConfigError(f"unknown setting {key!r}; sections are {', '.join(_sections(False))}")
    fields = _hints(sections[section])
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


def kind_of(path: Path) -> str:
    """What `path` is, where a regular file was wanted, for a message: a folder, a pipe or a device
    named as such ("does not exist" sent the user looking for a path that is there)."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError as e:
        return unreachable(path, e)
    if stat.S_ISDIR(mode):
        return "is a folder"
    if stat.S_ISFIFO(mode):
        return "is a pipe (FIFO), not a file"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device, not a file"
    return "is a file" if stat.S_ISREG(mode) else "is not a regular file"


def unreachable(path: Path, e: OSError) -> str:
    """Why stat of `path` failed, for a message: a link that loops or leads nowhere named as one
    (glob lists such a link as a match, and the reader then found no files in it)."""
    import errno
    import os

    if e.errno == errno.ELOOP:
        return "is a symlink loop (a link on its path leads back to itself)"
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        try:
            return f"is a broken symlink (to {os.readlink(path)})" if path.is_symlink() else "does not exist"
        except OSError:  # a folder on the way is itself a broken link
            return "does not exist"
    return f"cannot be read ({e.strerror or e})"


def present(path: Path) -> bool:
    """Whether `path` is something to read (followed through links); False, not a traceback,
    where a folder on the way may not be searched (Path.exists raises that one). A name too long
    for the filesystem is left to the command's own line for it (cli/command_line.py `main`)."""
    import errno

    try:
        path.stat()
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise
        return False
    return True


def owning_section(key: str) -> str | None:
    """The table a top-level TOML name belongs in when it is one of a table's keys (`max_steps`:
    run), so the message names where to write it; None for a table's own name or an unknown one."""
    if key in SECTIONS:
        return None
    tables = TrainConfig()
    return next((section for section in SECTIONS
                 if key in {f.name for f in dataclasses.fields(getattr(tables, section))}), None)


MAX_TOML_BYTES = 1 << 20  # settings are a few hundred bytes; parsing takes ~4x a file's size in memory


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file of `[section]` tables into flat `section.field` overrides."""
    p = Path(path)
    if not p.is_file():  # a folder or a pipe is named as such: "does not exist" would send the user looking
        raise ConfigError(f"config file {str(p)!r} {kind_of(p)}; name a .toml file")
    if (size := p.stat().st_size) > MAX_TOML_BYTES:  # read whole by the launcher and every rank: bounded
        raise ConfigError(f"config file {str(p)!r} is {size / 2**20:.1f} MiB: a settings file is at most "
                          f"{MAX_TOML_BYTES >> 20} MiB; name the TOML of [model] [parallel] [optim] [data] [run] tables")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8-sig"))  # a byte-order mark (Windows editors) is no statement
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if section in SECTIONS and isinstance(table, list):  # [[model]]: "unknown table [model]" contradicted itself
            raise ConfigError(f"{p}: [[{section}]] is an array of tables: write [{section}], once")
        if section in SECTIONS and not isinstance(table, dict):
            raise ConfigError(f"{p}: {section} = {table!r} is a value, not a table: write [{section}] on a line of "
                              f"its own, its keys under it")
        if owner := owning_section(section):  # a key of a table, written outside it (or as a table of its own)
            written = f"[{section}]" if isinstance(table, dict) and not table else f"{section} = {toml_value(table)}"
            raise ConfigError(f"{p}: {written} is a key of [{owner}], written outside it: put {section} = ... on a "
                              f"line under [{owner}]")
        if section not in SECTIONS or not isinstance(table, dict):
            raise ConfigError(f"{p}: unknown table [{section}]; use one of {', '.join(SECTIONS)}")
        for name, value in table.items():
            flat[f"{section}.{name}"] = value
    return flat


def build_config(toml_path: str | None = None, overrides: dict[str, Any] | None = None,
                 names: dict[str, str] | None = None) -> TrainConfig:
    """Defaults, then the preset's model shape, learning rate and warm-up, then TOML, then overrides, then
    a pretrained folder's shape (models/hf.py); validated. Overrides may be typed values (from code) or strings (the command line), which are
    parsed; `names` says how errors call an override's key (its flag). Unless set, `optim.min_lr`
    is a tenth of the peak rate."""
    names = names or {}
    if toml_path is not None and not str(toml_path).strip():  # "" read as no file: the defaults trained, exit 0
        raise ConfigError("--config is empty: name a .toml file, or leave --config out")
    flat = {k: coerce_setting(k, v) for k, v in (load_toml(toml_path) if toml_path else {}).items()}
    flat.update({k: coerce_setting(k, v, from_text=True, name=names.get(k)) for k, v in (overrides or {}).items()})
    if any(k.startswith("launch.") for k in flat):
        raise ConfigError(f"launcher settings {sorted(k for k in flat if k.startswith('launch.'))} are not run settings")
    cfg = TrainConfig()
    preset = flat.get("model.preset", cfg.model.preset)
    apply_preset(cfg.model, preset)
    cfg.optim.lr = PRESET_LR.get(preset, cfg.optim.lr)
    cfg.optim.warmup_steps = PRESET_WARMUP.get(preset, cfg.optim.warmup_steps)
    apply_overrides(cfg, flat)
    if "parallel.virtual_stages" not in flat:  # as simulate and plan read a schedule named alone: its fewest chunks
        from pipezero.schedules.registry import default_virtual

        cfg.parallel.virtual_stages = default_virtual(cfg.parallel.schedule)

    def shown(key: str) -> str:  # a setting as the user set it: its flag, or its key in the TOML file
        return names.get(key, key) if key in (overrides or {}) else f"{key} (in {toml_path})"

    for owner, flag, what in (("model.spec", "--model-spec", "is the whole model"),
                              ("model.pretrained", "--model", "fixes the model's shape")):
        # said here, where the flag the user typed is known (models/ name the key: 'drop model.preset')
        clash = [shown(k) for k in sorted(flat) if k.startswith("model.") and k != owner]
        if owner in flat and str(flat[owner] or "").strip() and clash:
            named = flag if owner in (overrides or {}) else shown(owner)
            raise ConfigError(f"{named} {flat[owner]} {what}; drop {', '.join(clash)}")
    if cfg.model.pretrained is not None and cfg.model.pretrained.strip():
        check_model_files(Path(cfg.model.pretrained))
    if cfg.model.spec is not None:  # a model of one's own: [model] shape settings would be ignored
        from pipezero.models.user_spec import apply_spec

        apply_spec(cfg, set(flat))
    if cfg.model.pretrained is not None:  # a Hugging Face folder: its shape, tokenizer, a fine-tuning rate
        from pipezero.models.hf import apply_pretrained

        apply_pretrained(cfg, set(flat))
    if "optim.min_lr" not in flat:
        cfg.optim.min_lr = cfg.optim.lr / 10
    if unused := unused_data_setting(cfg.data, set(flat)):
        key, why = unused
        raise ConfigError(f"{shown(key)} {flat[key].value if hasattr(flat[key], 'value') else flat[key]} {why}: "
                          f"drop it")
    if unread := unread_setting(cfg, set(flat)):
        key, reader = unread
        value = flat[key].value if hasattr(flat[key], "value") else flat[key]
        if isinstance(value, bool):  # a switch is named as typed (--no-overlap-gather), a TOML key as written
            said = shown(key) if key in (overrides or {}) else f"{key} = {toml_value(value)} (in {toml_path})"
        else:
            said = f"{shown(key)} {value}"
        raise ConfigError(f"{said} is read only {reader}")
    key = "parallel.quant_block"  # named as the user set it: its flag, or its TOML key
    set_as = None if key not in flat else names.get(key, key) if key in (overrides or {}) else key
    check_quant_block(cfg.parallel, set_as)
    return validate(cfg, shown("run.out") if "run.out" in flat else "--out")


# settings that only documents read (records, parquet, text files): a token file and the built-in
# corpus take none of them
DOCUMENT_SETTINGS = ("data.text_field", "data.on_bad_record", "data.max_document_mb")


def unused_data_setting(d: Any, given: set[str]) -> tuple[str, str] | None:
    """A data setting the user set (`given`) that the data source reads nothing of, and why: each
    was accepted and changed nothing, exit 0. None when every one given is read."""
    from pipezero.data.corpus import TOKEN_SUFFIXES

    tokens = next((p for p in d.path or [] if Path(p).suffix in TOKEN_SUFFIXES), None)
    source = (f"applies to documents; --data {tokens} is a token file (ids, tokenized already)" if tokens else
              "applies to --data documents; the built-in corpus (no --data) has no records" if d.path is None else None)
    for key in DOCUMENT_SETTINGS:
        if key in given and source:
            return key, source
    if "data.tokenizer" in given and tokens and not d.tokenizer.endswith(".json"):
        return "data.tokenizer", (f"tokenizes nothing: --data {tokens} holds token ids already (a tokenizer.json "
                                  f"may name what they mean, for the text sample)")
    if "data.bpe_vocab" in given and (tokens or d.tokenizer != "bpe"):
        return "data.bpe_vocab", ("sizes the BPE trained on the text, and " +
                                  (f"--data {tokens} is a token file" if tokens else f"the tokenizer is {d.tokenizer}"))
    if "data.max_bytes" in given and d.path is not None:
        return "data.max_bytes", "cuts the built-in corpus only (--data is read whole)"
    return None


def ids_alone(d: Any) -> bool:
    """Whether the data is a token file with no tokenizer.json to decode its ids (no text sample)."""
    from pipezero.data.corpus import TOKEN_SUFFIXES

    return any(Path(p).suffix in TOKEN_SUFFIXES for p in d.path or []) and not d.tokenizer.endswith(".json")


def unread_setting(cfg: TrainConfig, given: set[str]) -> tuple[str, str] | None:
    """A setting the user set (`given`) that only another option reads, with that option unset
    (each was accepted and changed nothing, exit 0): (its key, "by <the option that reads it>...;
    <the fix>"). None when every one given is read."""
    p, r = cfg.parallel, cfg.run
    rules = RULES[p.zero]
    stage3 = "by ZeRO-3 (its parameter gathers); add --zero 3, or drop it"
    kept = (f"by ZeRO-3 layer by layer; with --pp {p.pp} ZeRO-3 keeps each chunk gathered for its step (one "
            f"gather a chunk, none a layer): use --pp 1 or parallel.zero3_keep_gathered = false, or drop it")
    checks = (
        ("parallel.zero3_prefetch", rules.sharded_params,
         "by ZeRO-3 (how far ahead its layer-by-layer gathers start); add --zero 3, or drop it"),
        ("parallel.zero3_prefetch", layerwise(p), kept),
        ("parallel.zero3_keep_gathered", rules.sharded_params, stage3),
        ("parallel.overlap_gather", rules.gathers_updates,
         f"by ZeRO-1 and -2 (when a layer waits for its updated weights); with --zero {p.zero} it changes nothing: "
         f"use --zero 1 or 2, or drop it"),
        ("parallel.buckets_in_flight", rules.reduces_to_shard,
         "by ZeRO-1 to 3 (reduce-scatters left running during the backward); ZeRO-0 all-reduces: use --zero 1, 2 "
         "or 3, or drop it"),
        ("parallel.ranks_per_node", p.hierarchical or p.secondary_shard is not SecondaryShard.NONE,
         "by --hierarchical and --secondary-shard node (the nodes a stage's replicas are split over): add one, "
         "or drop it"),
        ("parallel.placement", p.pp > 1 and p.dp > 1,
         f"with --pp > 1 and --dp > 1 (which of a stage's replicas and a pipeline's stages are neighbours); at "
         f"--pp {p.pp} --dp {p.dp} every placement is the same ranks: drop it"),
        ("parallel.partition", p.stage_layers is None,
         "without --stage-layers, which gives every chunk's layers itself: drop one of them"),
        ("run.trace_steps", r.trace, "by --trace (the newest steps the trace keeps); add --trace, or drop it"),
        ("run.sample_tokens", p.pp == 1 or r.sample_tokens == 0,
         f"by a run with --pp 1 (the end-of-run text sample is made only without a pipeline); with --pp {p.pp} no "
         f"sample is made: drop it"),
        ("run.sample_tokens", r.sample_tokens == 0 or not ids_alone(cfg.data),
         f"with a tokenizer that decodes the text sample; --data {' '.join(cfg.data.path or [])} holds token ids "
         f"and no --tokenizer FILE.json names what they mean: add one, or drop it"),
        ("model.window_layers", cfg.model.sliding_window is not None,
         "with model.sliding_window (the blocks its window applies to); set the window, or drop it"),
        ("run.gpu_memory_gib", cfg.model.spec is None,
         f"by the fit check, whose memory model knows the built-in decoder's layers, not --model-spec "
         f"{cfg.model.spec}'s: drop it"),
        ("run.host_memory_gib", cfg.model.spec is None,
         f"by the host check, whose memory model knows the built-in decoder's layers, not --model-spec "
         f"{cfg.model.spec}'s: drop it"),
        ("run.keep_checkpoints", r.save_final or r.checkpoint_every > 0,
         "where checkpoints are saved (--checkpoint-every, or the final save --no-save-final turns off): add "
         "--checkpoint-every, or drop it"),
        ("run.checkpoint_every", r.save_final or r.checkpoint_every <= r.max_steps,
         f"at its multiples of steps, and a run of --max-steps {r.max_steps} with --no-save-final saves none: "
         f"lower it to {r.max_steps} or less, or drop --no-save-final"),
    )
    # With one replica ZeRO's collectives are local copies over a group of one: its tuning changes nothing
    alone = (f"with --dp > 1 (it tunes ZeRO's collectives between replicas); at --dp {p.dp} there is one replica "
             f"and nothing to exchange: raise --dp, or drop it")
    checks += tuple((key, p.dp > 1, alone) for key in ("parallel.buckets_in_flight", "parallel.zero3_prefetch",
                                                       "parallel.overlap_gather"))
    # where ZeRO-3 does not gather layer by layer, validate's check_zero3_unit names the stage instead
    checks += (("parallel.zero3_unit", p.dp > 1 or not layerwise(p), alone),)
    for key, read, reader in checks:
        if key in given and not read:
            return key, reader
    return None


def check_step_size(cfg: TrainConfig) -> None:
    """A step's schedule and batch within what a rank can build and hold (schedules/limits.py)."""
    from pipezero.schedules import limits

    p, seq = cfg.parallel, cfg.data.seq_len
    played = p.pp * p.microbatches * p.virtual_stages
    _check(played <= limits.TRAIN_PLAY_LIMIT,
           f"--pp {p.pp} x --microbatches {p.microbatches} x --virtual-stages {p.virtual_stages} = {played} stage "
           f"micro-batches a step; the limit is {limits.TRAIN_PLAY_LIMIT} (every rank builds and proves the step's "
           f"schedule as it starts, minutes past that): fewer --microbatches, each of a larger --micro-batch-size")
    tokens = cfg.global_batch * seq
    if tokens > limits.BATCH_TOKENS:
        raise BatchTooLarge(p.micro_batch_size * seq, f"--microbatches {p.microbatches} x --micro-batch-size {p.micro_batch_size} x --dp {p.dp} = "
                            f"{cfg.global_batch} sequences of --seq-len {seq} = {tokens} tokens a step; the limit is "
                            f"{limits.BATCH_TOKENS} (every rank holds the step's batch in memory): a smaller global batch")


class BatchTooLarge(ConfigError):
    """A step's batch past what a rank holds: said in train's flags; a command that reads one
    micro-batch (probe) says it in its own, from `micro_batch_tokens`."""

    def __init__(self, micro_batch_tokens: int, message: str) -> None:
        super().__init__(message)
        self.micro_batch_tokens = micro_batch_tokens


def check_model_files(folder: Path) -> None:
    """A --model folder's files that are there but are no regular file (a folder, a pipe): named as
    what they are (models/hf.py said "does not exist"; a pipe would block its reader)."""
    from pipezero.models.hf import CONFIG, TOKENIZER
    from pipezero.models.hf_weights import INDEX, SINGLE

    for name in (CONFIG, TOKENIZER, SINGLE, INDEX):
        path = folder / name
        if (path.exists() or path.is_symlink()) and not path.is_file():
            raise ConfigError(f"--model {folder}: {name} {kind_of(path)}; a Hugging Face model folder holds it as a "
                              f"file (save_pretrained writes it)")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def check_end_chunks(counts: list[int]) -> None:
    """Layers a chunk holds, in model order: the embedding and the head cannot leave the ends.
    Checked on the configuration and again on the partition a rank builds (a TrainConfig made in
    Python is not validated)."""
    _check(counts[0] >= 1 and counts[-1] >= 1,
           f"--stage-layers {','.join(map(str, counts))}: the first chunk must hold the embedding "
           f"and the last the head; only chunks in between may be empty")


def check_hierarchical(hierarchical: bool, device_type: str) -> None:
    """--hierarchical splits gloo's collectives by node; NCCL chooses its own algorithms. Checked on
    the configuration when the device is named and by each rank once `auto` has resolved it."""
    _check(not hierarchical or device_type != "cuda",
           "--hierarchical is for gloo (CPU ranks); NCCL picks its own topology-aware algorithms: drop it")


def _masks_documents(cfg: TrainConfig) -> bool:
    """Whether the data are documents packed with document masks (data/corpus.py's default for
    documents; token files and the built-in corpus are windows of one stream)."""
    d = cfg.data
    token_file = any(Path(x).suffix in (".bin", ".npy") for x in d.path or [])  # data/corpus.py's TOKEN_SUFFIXES
    documents = bool(d.path) and not token_file
    return documents and d.packing in (None, Packing.DOC_MASKED)


def check_quantization(p: ParallelConfig) -> None:
    """--quantize-weights and --quantize-grads work on every schedule, placement and ZeRO stage that
    moves what they compress; a layout with nothing to compress is refused, naming why."""
    for flag, value in (("--quantize-weights", p.quantize_weights.value), ("--quantize-grads", p.quantize_grads.value)):
        _check(value == "none" or p.dp > 1, f"{flag} {value} with --dp 1: there is no data-parallel traffic to "
                                            f"quantize; drop it or raise --dp")
    _check(p.quantize_weights is WeightQuant.NONE or RULES[p.zero].gathers_weights,
           f"--quantize-weights {p.quantize_weights.value} with --zero 0: ZeRO-0 gathers no weights (every rank "
           f"updates all of them); use --zero 1, 2 or 3, or drop it")


def check_quant_block(p: ParallelConfig, set_as: str | None) -> None:
    """A block size with nothing quantized would be read by nothing. `set_as`: how the user set it (its
    flag or TOML key); None: left at its default."""
    _check(set_as is None or p.quantize_weights is not WeightQuant.NONE or p.quantize_grads.value != "none",
           f"{set_as} {p.quant_block} applies with --quantize-weights or --quantize-grads: add one, or drop it")


def check_secondary_shard(p: ParallelConfig) -> None:
    """--secondary-shard node saves gathers only where ZeRO-3 gathers a bucket more than once a step."""
    if p.secondary_shard is SecondaryShard.NONE:
        return
    sharded, replicas = RULES[p.zero].sharded_params, p.dp > 1
    _check(sharded or replicas, f"--secondary-shard node with --zero {p.zero} --dp {p.dp}: only ZeRO-3 with --dp 2 or "
                                f"more gathers parameters over a group; use --zero 3 and raise --dp, or drop it")
    _check(sharded, f"--secondary-shard node with --zero {p.zero}: only ZeRO-3 gathers parameters over a group; use "
                    f"--zero 3 or drop it")
    _check(replicas, f"--secondary-shard node with --dp {p.dp}: it splits each bucket over the data-parallel replicas, "
                     f"and one has nothing to split; raise --dp to 2 or more, or drop it")
    _check(layerwise(p), f"--secondary-shard node with --pp {p.pp}: ZeRO-3 keeps each chunk gathered for its step "
                      f"(one gather a step), so no later gather would stay inside the node; use it layer by layer "
                      f"(--pp 1, or parallel.zero3_keep_gathered = false)")


def check_zero3_unit(cfg: TrainConfig, spec: object = None) -> None:
    """--zero3-unit sublayer cuts layer-by-layer ZeRO-3's units inside a block; nothing else reads it.
    `spec`: a --model-spec's loaded spec, whose layers must name parts (models/spec.py `layer_parts`)."""
    p = cfg.parallel
    if p.zero3_unit is Zero3Unit.LAYER:
        return
    _check(layerwise(p), f"--zero3-unit {p.zero3_unit.value} with --zero {p.zero} --pp {p.pp}: only ZeRO-3 layer by "
                         f"layer gathers a unit at a time (--zero 3 with --pp 1, or parallel.zero3_keep_gathered = "
                         f"false); drop it")
    _check(not cfg.run.compile, f"--zero3-unit {p.zero3_unit.value} with --compile: a compiled block runs its attention "
                                f"and MLP as one graph, so no hook can gather one while the other computes; drop one")
    if spec is not None:
        from pipezero.models.user_spec import users_fault

        try:
            named = any(spec.layer_parts(i) for i in range(spec.n_layers + 2))  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - the spec's own layer_parts raised: one line naming it
            raise users_fault(str(cfg.model.spec), e) or e from None
        _check(named, f"--zero3-unit {p.zero3_unit.value} with --model-spec {cfg.model.spec}: its layers name no parts "
                      f"(layer_parts), so every unit would be a whole layer; define layer_parts in the spec, or drop it")
        from pipezero.models.parts import check_spec_parts

        check_spec_parts(spec)  # type: ignore[arg-type]  # here, not on every rank once they have started


def check_offload_activations(cfg: TrainConfig) -> None:
    """--offload-activations N copies micro-batches held across two or more other actions: a layout
    where none is (one pipeline rank under 1F1B, M = 1) would never read it."""
    p = cfg.parallel
    if not p.offload_activations or p.recompute:  # with --recompute: refused for what it is
        return
    from pipezero.schedules.registry import build_schedule

    try:
        schedule = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    except ValueError:
        return  # the layout's own refusal comes where the schedule is checked
    _check((unread := unread_activation_offload(p.offload_activations, [schedule])) is None, unread or "")


def unread_activation_offload(n: int, schedules: list[Schedule]) -> str | None:
    """Why --offload-activations `n` would copy nothing in any of `schedules`, or None."""
    from pipezero.schedules.lowering import held_long

    if not n or any(held_long(actions) for s in schedules for actions in s.actions):
        return None
    s = schedules[0]
    return (f"--offload-activations {n}: no micro-batch of --pp {s.pp} --schedule {s.name}"
            f"{'' if len(schedules) == 1 else ' (or any schedule compared)'} --microbatches {s.microbatches} waits "
            f"across two other actions between its forward and its backward, so none would be copied to the host; "
            f"drop it, or a layout that holds activations (--schedule gpipe, more --microbatches or --pp)")


def check_prefetch(cfg: TrainConfig) -> None:
    """--link-gbps and --tflops describe the hardware only for `--zero3-prefetch auto`; with it, the
    choice is made here once (planner/prefetch.py), so a missing input is refused before any rank starts."""
    p = cfg.parallel
    for flag, value in (("--link-gbps", p.link_gbps), ("--tflops", p.tflops)):
        if value is not None:
            _check(p.zero3_prefetch == "auto",
                   f"{flag} {value:g} is read only by --zero3-prefetch auto (the planner's depth): add it, or drop "
                   f"{flag}")
    if p.zero3_prefetch == "auto":
        from pipezero.memory.model import prefetch_choice

        prefetch_choice(cfg)


def validate(cfg: TrainConfig, out_name: str = "--out") -> TrainConfig:
    """`cfg` unchanged when it can run, else one ConfigError naming the fix."""
    m, p, o, d, r = cfg.model, cfg.parallel, cfg.optim, cfg.data, cfg.run
    if m.pretrained is not None and type(m.n_layers) is int and m.n_layers > MAX_LAYERS:  # config.json's, not [model]'s
        from pipezero.models.hf_weights import check_weights

        check_weights(m)  # a count the weights do not hold is said as such, from the headers alone
        raise ConfigError(f"{Path(m.pretrained) / 'config.json'}: num_hidden_layers = {m.n_layers}: at most "
                          f"{MAX_LAYERS} blocks (model.n_layers' range)")
    for section in _sections(False):  # a configuration built in code passes the same checks as a file
        for f in dataclasses.fields(getattr(cfg, section)):
            coerce_setting(f"{section}.{f.name}", getattr(getattr(cfg, section), f.name))
    spec = None  # a model of one's own (--model-spec): its layer count and length, not [model]'s
    if m.spec is not None:
        from pipezero.models.spec import ModelSpec
        from pipezero.models.user_spec import load_spec

        _check(m.pretrained is None, f"--model {m.pretrained} and --model-spec {m.spec} each name the model; "
                                     f"give one")
        spec = load_spec(m.spec)
        _check(not _masks_documents(cfg) or type(spec).doc_mask is not ModelSpec.doc_mask,
               f"--model-spec {m.spec}: {type(spec).__name__} has no doc_mask, so documents cannot be packed with "
               f"document masks (the default for --data documents); pass --packing concat or none, or give the "
               f"spec a doc_mask")
    else:
        _check(m.head_dim is not None or m.dim % m.n_heads == 0,
               f"model.dim={m.dim} must be a multiple of n_heads={m.n_heads}")
        kv = m.n_kv_heads or m.n_heads
        _check(m.n_heads % kv == 0, f"n_heads={m.n_heads} must be a multiple of n_kv_heads={kv}")
        _check((m.head_dim or m.dim // m.n_heads) % 2 == 0,
               f"model.head_dim = {m.head_dim} must be even for rotary positions" if m.head_dim else
               f"the head dimension, model.dim / n_heads = {m.dim} / {m.n_heads}, must be even for rotary positions")
        _check(m.rope_llama3 is None or len(m.rope_llama3) == 4,
               "model.rope_llama3 takes 4 numbers: factor, low_freq_factor, high_freq_factor, original context")
        if m.rope_llama3 is not None:  # rotary.py divides by high - low: equal is a division by zero, reversed inverts the blend
            _, low, high, _ = m.rope_llama3
            _check(low < high, f"model.rope_llama3: its low_freq_factor {low:g} must be below its high_freq_factor "
                               f"{high:g} (the second and third numbers; Llama 3.1 uses 1 and 4)")
        _check(m.window_layers is None or all(i < m.n_layers for i in m.window_layers),
               f"model.window_layers = {m.window_layers}: blocks are numbered 0 to {m.n_layers - 1}")
    max_len = m.max_seq_len if spec is None else spec.max_seq_len
    if spec is not None:
        limit, fix = f"max_seq_len={max_len}", f"lower --seq-len or raise the max_seq_len of --model-spec {m.spec}"
    elif m.pretrained is not None:  # its shape is the folder's: only --seq-len can change
        limit, fix = f"config.json's max_position_embeddings is {max_len}", "lower --seq-len"
    else:
        limit, fix = f"max_seq_len={max_len}", "lower --seq-len or raise model.max_seq_len"
    _check(max_len is None or d.seq_len <= max_len,
           f"--seq-len {d.seq_len} is longer than the model allows ({limit}); {fix}")
    named = d.tokenizer in ("bpe", "bytes") or d.tokenizer.endswith(".json")
    _check(named or not Path(d.tokenizer).is_file(),  # a tokenizer.json saved under another name
           f"--tokenizer (data.tokenizer) {d.tokenizer!r} is a file, and pipezero reads a tokenizer file only by a name "
           f"ending .json: rename it (or link it) to a .json name")
    _check(named, f"--tokenizer (data.tokenizer) {d.tokenizer!r}: use 'bpe', 'bytes' or a tokenizer.json path "
                  f"(nothing is downloaded)")
    chunks = p.pp * p.virtual_stages
    n_layers = m.n_layers if spec is None else spec.n_layers
    layers = n_layers + 2  # embedding + blocks + head
    if p.stage_layers is not None:
        _check(
            len(p.stage_layers) == chunks,
            f"--stage-layers lists {len(p.stage_layers)} stages but pp x virtual-stages = {chunks}",
        )
        _check(
            sum(p.stage_layers) == layers,
            f"--stage-layers sums to {sum(p.stage_layers)} but the model has {layers} layers "
            f"(embedding + {n_layers} blocks + head)",
        )
        check_end_chunks(p.stage_layers)
    else:
        _check(p.partition is not Partition.MEMORY or spec is None,
               f"--partition memory with --model-spec {m.spec}: the memory model knows the built-in decoder's layers, "
               f"not a spec of one's own; use --partition params or cost, or --stage-layers")
        _check(
            chunks <= layers,
            f"pp x virtual-stages = {chunks} stage chunks but the model has only {layers} layers "
            f"(embedding + {n_layers} blocks + head); lower --pp/--virtual-stages"
            + ("" if m.pretrained or spec else " or use a bigger preset"),
        )
    check_step_size(cfg)
    _check(o.min_lr <= o.lr, f"optim.min_lr = {o.min_lr:g}: expected a number <= optim.lr, the peak rate (--lr) "
                             f"({o.lr:g})")
    check_hierarchical(p.hierarchical, r.device.value)
    _check(not (p.offload_activations and p.recompute),
           f"--offload-activations {p.offload_activations} with --recompute: recomputation keeps only each block's "
           f"input between forward and backward; drop one of them")
    check_offload_activations(cfg)
    _check(not (p.hierarchical and r.share_device is ShareDevice.ON),
           "--share-device on with --hierarchical: the two-level collectives run on a thread of their own that "
           "stages nothing (and GPUs refuse --hierarchical); drop one of them")
    _check(not (r.share_device is ShareDevice.ON and p.world_size == 1),
           "--share-device on with one rank: there is no other rank to share a GPU with or to send through the "
           "host; drop it (or start more ranks: --nproc, --pp, --dp)")
    # with one replica nothing reads --hierarchical: refused rather than silently unread
    _check(not p.hierarchical or p.dp > 1, "--hierarchical with --dp 1: there are no data-parallel reductions to split "
                                            "by node; raise --dp or drop it")
    if p.stall_report_s is not None:
        _check(p.stall_report_s < p.timeout_s,
               f"--stall-report {p.stall_report_s:g} is not below --timeout {p.timeout_s:g}: a wait fails at the "
               f"timeout before it would be reported; choose --stall-report < {p.timeout_s:g} (default a quarter)")
    _check(p.ranks_per_node is None or p.world_size % p.ranks_per_node == 0,
           f"parallel.ranks_per_node = {p.ranks_per_node} does not divide the {p.world_size} ranks (pp x dp) into "
           f"whole nodes")
    check_quantization(p)
    check_secondary_shard(p)
    check_zero3_unit(cfg, spec)
    check_prefetch(cfg)
    from pipezero.files import dangling_link, unexpanded_home, unfollowable

    # `out_name`: --out, or run.out (in FILE) when the TOML file set it
    # an empty --out is each command's to name (a run's folder, verify's runs); the file's key is named here
    _check(out_name == "--out" or bool(r.out.strip()), f"{out_name} is empty: name a folder for the run")
    _check((home := unexpanded_home(out_name, r.out)) is None, home or "")
    _check((loop := unfollowable(out_name, r.out)) is None, loop or "")
    _check((dangling := dangling_link(out_name, r.out)) is None, dangling or "")
    if d.path is not None:
        _check(bool(d.path), "data.path = []: name document files, folders, globs or a token file, or leave data.path "
                             "out for the built-in corpus")  # an empty list would mean the built-in corpus, unasked
        from pipezero.data.sources import MAGIC, check_cache_out_of_reach, check_out_of_reach

        for arg in d.path:
            _check(arg != "", "--data '' is empty: name document files, folders, globs or a token file")
            # a plain name is checked itself: glob lists a link by its name, whatever it leads to
            pattern = bool(MAGIC.search(arg)) and bool(glob.glob(arg, recursive=True))
            _check(present(Path(arg)) or pattern,
                   f"--data {arg!r} {kind_of(Path(arg))}; pass document files, folders, globs or a token file")
            _check(not present(Path(arg)) or Path(arg).is_file() or Path(arg).is_dir(),  # a pipe blocked its reader
                   f"--data {arg!r} {kind_of(Path(arg))}; pass document files, folders, globs or a token file")
        check_out_of_reach(d.path, r.out)
        check_cache_out_of_reach(d.path)
    if d.tokenizer.endswith(".json"):
        _check(Path(d.tokenizer).is_file(), f"tokenizer file {d.tokenizer!r} {kind_of(Path(d.tokenizer))}; name a "
                                            f"tokenizer.json, or use bpe or bytes")
    if m.pretrained is not None:  # every tensor's name and shape, from the safetensors headers
        from pipezero.models.hf_weights import check_tokenizer, check_weights

        check_weights(m)
        if d.tokenizer.endswith(".json"):
            check_tokenizer(m, d.tokenizer)
    from pipezero.freeze import check_pattern  # these two import torch: not for `--help`
    from pipezero.parallel.device import device_kind

    device_kind(r.device)
    check_pattern(spec or m, o.freeze)
    try:
        check_layout(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_compiles(r.compile, p.schedule, p.recompute)
    return cfg


def check_compiles(compiled: bool, schedule: ScheduleKind, recompute: bool) -> None:
    """What --compile cannot run (also asked of --layout auto's constraints, planner/auto_job.py)."""
    _check(not (compiled and schedule in SPLIT_BACKWARD),
           f"--compile cannot run --schedule {schedule.value}: its split backward (B then W) records and "
           f"replays the blocks' weight operations, which a compiled block hides; use 1f1b, gpipe or "
           f"interleaved-1f1b with --compile, or drop --compile")
    _check(not (compiled and recompute),
           "--recompute with --compile: a compiled block run again under the checkpoint recomputes its saved "
           "tensors in another order than its forward saved them (torch's CheckpointError at the first "
           "backward); drop one of them")
