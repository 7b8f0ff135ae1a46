"""`pipezero export`: a checkpoint, whatever layout wrote it, as one safetensors file and a config.

The result needs neither pipezero's process groups nor its flat buffers: `model.safetensors` holds
every parameter under the model's own names in its own shape (a tied embedding once), and
`config.json` the model's shape. `load_exported` builds the whole model in one process from them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_model, save_model
from torch import nn

from pipezero.checkpoint.safe_reader import SafeReader
from pipezero.checkpoint.export_folder import check_out, write_folder
from pipezero.checkpoint.store import MANIFEST, CheckpointError, Team, committed, problems, read_manifest, written_by
from pipezero.config import ModelConfig
from pipezero.errors import ConfigError
from pipezero.models import ModelSpec, StageChunk, build_chunk, spec_of
from pipezero.rundir import RUN_ID, run_id
from pipezero.files import atomic_write_json, atomic_write_with


def whole_model(model: ModelConfig | ModelSpec, seed: int = 0) -> StageChunk:
    """Every layer of `model` (a [model] section that names a --model-spec: that spec's)."""
    return build_chunk(model, 0, spec_of(model).n_layers + 2, seed)


def trusted_model(path: Path, fields: Any, model_spec: str | None) -> ModelConfig:
    """The checkpoint's [model], refused when it names a --model-spec the caller did not: importing
    that module runs its code, and a checkpoint is data that must not choose code to run."""
    cfg = manifest_model(path, fields)  # checked as data first; importing the spec is for below
    named = cfg.spec
    if named and named != model_spec:
        given = f"; you named {model_spec!r}" if model_spec else ""
        raise ConfigError(f"{path} is a run of --model-spec {named}, a model of your own{given}: exporting it "
                          f"imports and runs that code, so name it yourself, --model-spec {named}, if you "
                          f"trust it")  # the flag missing: bad input, exit 2
    if model_spec and not named:  # it would be ignored: the checkpoint is of the built-in or a HF model
        raise ConfigError(f"--model-spec {model_spec}: {path} is not a run of a --model-spec (its model is "
                          f"{cfg.pretrained or 'preset ' + str(cfg.preset or 'the built-in decoder')}); drop "
                          f"--model-spec")
    return cfg


def manifest_model(path: Path, fields: Any) -> ModelConfig:
    """The manifest's [model], each field checked as a TOML value of it: the manifest is data, and
    an edited one (an unknown key, a size as a string, a null) would raise a TypeError while the
    model is built."""
    from pipezero.settings import coerce_setting

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(fields) - known) if isinstance(fields, dict) else ["(not a table)"]
    try:
        if unknown:
            raise ConfigError(f"{unknown[0]!r} is no model setting")
        typed = {k: coerce_setting(f"model.{k}", v) for k, v in fields.items()}
    except ConfigError as e:
        raise ConfigError(f"{path}: its {MANIFEST}'s [model] is not as pipezero writes it ({e}): the manifest was "
                          f"edited; export another checkpoint, or put the manifest back") from None
    return ModelConfig(**typed)


def read_model(path: Path, spec: ModelSpec | None = None, model_spec: str | None = None) -> StageChunk:
    """The whole model of checkpoint `path`, loaded in this process alone (no process group).
    `spec`: the model a run of one's own trained (engine.train's spec); None: the checkpoint's
    [model], the built-in decoder, or the --model-spec it names if that is `model_spec` (what the
    caller names and so trusts)."""
    manifest = read_manifest(path)
    model = whole_model(spec or trusted_model(path, manifest["config"].get("model"), model_spec))
    params = dict(model.named_parameters())  # a tied weight appears once, as the embedding
    flat = {f"model.{n}": torch.empty(p.numel()) for n, p in params.items()}
    Team().run(f"read of {path}", lambda: dcp.load(flat, storage_reader=SafeReader(path), no_dist=True))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(flat[f"model.{n}"].view_as(p))
    return model


def why_unsaved(run: Path) -> str:
    """What is true of run folder `run` that saved no checkpoint, from its config.json, and the fix."""
    try:
        settings = json.loads((run / "config.json").read_text())["run"]
        final, every, last = bool(settings["save_final"]), int(settings["checkpoint_every"]), int(settings["max_steps"])
    except (OSError, ValueError, KeyError, TypeError):  # no config, or not as a run writes it
        return "train with the last step saved (the default), then export"
    if not final and not every:
        return ("it trained with --no-save-final and no --checkpoint-every: train it without --no-save-final "
                "(or with --checkpoint-every K), then export")
    if not final and every > last:
        return (f"it trained with --no-save-final and --checkpoint-every {every}, past its --max-steps {last}: "
                f"train it without --no-save-final, then export")
    return ("its checkpoints are gone (removed, or it stopped before its first save): train it again, then "
            "export")


def newest_of_run(run: Path) -> Path:
    """Run folder `run`'s newest good checkpoint of the run that holds it now (its .run-id): after a
    `--force` run beside another, the other's checkpoints are not this run's weights."""
    root, current = run / "checkpoints", run_id(run)
    every = committed(root)
    ours = every if current is None else [(n, p) for n, p in every if written_by(p, current) or unreadable(p)]
    if ours:
        return newest_good(root, ours)
    if not every:
        raise ConfigError(f"{run} saved no checkpoint: {why_unsaved(run)}")
    names = [p.name for _, p in reversed(every)]
    shown = " and ".join(names[:2]) + (f" (and {len(names) - 2} more)" if len(names) > 2 else "")
    raise ConfigError(f"{run}: the run there now saved no checkpoint: {why_unsaved(run)}; {shown} "
                      f"{'are' if len(names) > 1 else 'is'} of earlier runs in that folder (--force), whose "
                      f"weights are not this run's: to export one, name it, {root / names[0]}")


def unreadable(path: Path) -> bool:
    """Whether checkpoint folder `path`'s manifest cannot be read: whose it is cannot be told, so it
    stays a candidate, and newest_good names it as it skips it (a newer step passed over without
    a word would export older weights than the user believes). A link's is not followed: it stays
    a candidate too, named as a link."""
    if path.is_symlink():
        return True
    if not path.is_dir():
        return False
    try:
        read_manifest(path)
    except CheckpointError:
        return True
    return False


def checkpoint_to_export(source: Path) -> Path:
    """The checkpoint to export: `source` itself (checked like one `latest` finds), or a run
    directory's newest good checkpoint of its current run."""
    if (source / "checkpoints").is_dir():
        return newest_of_run(source)
    if not (source / MANIFEST).is_file():
        if (source / RUN_ID).is_file() or (source / "metrics.jsonl").is_file():
            raise ConfigError(f"{source} saved no checkpoint: {why_unsaved(source)}")
        raise ConfigError(f"{source} is neither a run folder nor a checkpoint (it holds no checkpoints/ and no "
                          f"{MANIFEST}): pass a run directory or one of its checkpoints/step-N")
    reason = problems(source, Team())
    if reason:  # the user's input, as a wrong path is: one line, exit 2
        raise ConfigError(f"{source} cannot be exported: {reason}; export an earlier checkpoint (a step-N beside "
                          f"it), or the run folder (its newest good one)")
    return source


def newest_good(root: Path, candidates: list[tuple[int, Path]] | None = None) -> Path:
    """The newest checkpoint under `root` (of `candidates`, default all) whose files match their
    manifest (as `latest` finds one to resume), a warning for each newer one skipped; none good is one
    line naming why."""
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(committed(root) if candidates is None else candidates):
        reason = problems(path, Team())
        if reason is None:
            for bad, why in skipped:
                print(f"pipezero: warning: skipping corrupt checkpoint {bad}: {why}; exporting {path.name}",
                      file=sys.stderr, flush=True)
            return path
        skipped.append((path, reason))
    if skipped:
        bad, why = skipped[0]
        older = f" (and {len(skipped) - 1} older, likewise)" if len(skipped) > 1 else ""
        raise ConfigError(f"{root} holds no complete checkpoint to export: {bad.name} {why}{older}; resume the run "
                          f"to save a good one, or restore the files")
    raise ConfigError(f"{root} holds no complete checkpoint to export: train with the last step saved (the "
                      f"default), then export")


def export(source: Path, out: Path, model_spec: str | None = None) -> Path:
    """Write the folder `out` holding `model.safetensors` and `config.json` from checkpoint
    `source`: a checkpoint folder, or a run directory (its newest good checkpoint). `model_spec`:
    the --model-spec the user names, needed for a run of one. `out` must be new or empty
    (export_folder.py). Returns the checkpoint used."""
    check_out(out, source)
    source = checkpoint_to_export(source)
    manifest = read_manifest(source)

    def fill(folder: Path) -> None:
        model = read_model(source, model_spec=model_spec)
        # save_model drops the tied head's alias, and load_model restores it
        atomic_write_with(folder / "model.safetensors", lambda tmp: save_model(model, tmp))
        atomic_write_json(folder / "config.json", manifest["config"]["model"])

    write_folder(out, fill)
    return source


def load_exported(folder: Path, model_spec: str | None = None) -> nn.Module:
    """The exported model, ready for inference in one process: `model(tokens) -> logits`.
    `model_spec`: the --model-spec of an export of one, named by the caller (config.json is data,
    and must not choose code to import)."""
    fields = json.loads((folder / "config.json").read_text())
    model = whole_model(trusted_model(folder, fields, model_spec))
    missing, unexpected = load_model(model, str(folder / "model.safetensors"))
    if missing or unexpected:
        raise CheckpointError(f"{folder}: model.safetensors does not match config.json "
                              f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})")
    return model.eval()
