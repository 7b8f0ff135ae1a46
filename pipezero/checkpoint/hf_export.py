"""`pipezero export --format hf`: a checkpoint as a folder transformers loads with
`AutoModelForCausalLM.from_pretrained`.

The weights go under their Hugging Face names (models/hf.py) into safetensors shards of at most
`--shard-size` bytes, with `model.safetensors.index.json` when there is more than one, as
transformers writes them. config.json and the tokenizer files are the ones the run started from
(kept in `RUN/hf/` at its start; else the --model folder), with `dtype` set to the float32 the
weights are written in, refused when it no longer describes the weights (the manifest holds the
model's shape); a run of a built-in preset exports as a Llama (models/hf.py `llama_config`).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pipezero.checkpoint.export import manifest_model, read_model, checkpoint_to_export
from pipezero.checkpoint.export_folder import check_out, write_folder
from pipezero.checkpoint.store import read_manifest
from pipezero.config import ModelConfig
from pipezero.data.identity import tokenizer_file_of
from pipezero.errors import ConfigError
from pipezero.models.hf import CONFIG, GENERATION, METADATA, llama_config, model_fields, to_hf
from pipezero.files import atomic_write_json, atomic_write_with

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes (powers of 1024, as transformers counts)."""
    m = _SIZE.match(text)
    if not m:
        raise ConfigError(f"--shard-size {text!r}: expected a size such as 2GB, 500MB or 1000000")
    size = int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " "))
    if size <= 0:
        raise ConfigError(f"--shard-size {text!r}: must be positive")
    return size


def hf_tensors(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every parameter under its Hugging Face name, contiguous fp32; a tied head only once (as the
    embedding, which is what transformers ties lm_head to)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():  # a tied head shares the embedding: listed once
        out[to_hf(name, cfg.n_layers, cfg.tie_embeddings)] = p.detach().float().contiguous()
    return out


def size_groups(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in model order, cut into groups of at most `limit` bytes (a bigger tensor alone)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    return groups


def write_weights(tensors: dict[str, torch.Tensor], out: Path, limit: int) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors and their index; the file names."""
    groups = size_groups(tensors, limit)
    meta = {"format": "pt"}
    if len(groups) == 1:
        atomic_write_with(out / "model.safetensors", lambda tmp: save_file(groups[0], tmp, metadata=meta))
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for name, group in zip(names, groups):
        atomic_write_with(out / name, lambda tmp, group=group: save_file(group, tmp, metadata=meta))
        weight_map.update({t: name for t in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    atomic_write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total},
                                                              "weight_map": weight_map})
    return names


def metadata_folder(ckpt: Path, pretrained: str | None) -> Path | None:
    """Where the config and tokenizer files of checkpoint `ckpt`'s model are: the copy its run kept
    (RUN/hf), else the --model folder it was trained from; None for a built-in preset's run (it
    exports as a Llama). A --model run with neither is refused: a Llama config in their place
    would describe another model (a qwen2's q/k/v biases or a window silently dropped)."""
    kept = ckpt.parent.parent / "hf"  # RUN/checkpoints/step-N -> RUN/hf
    for folder in (kept, Path(pretrained) if pretrained else None):
        if folder is not None and (folder / CONFIG).is_file():
            check_files(folder)
            return folder
        if folder is not None and (folder / CONFIG).exists():  # not another folder's config in its place
            check_files(folder)
    if pretrained:
        raise ConfigError(f"{ckpt} was trained from --model {pretrained}, whose {CONFIG} is neither in its run "
                          f"({kept}) nor in that folder: export it from its run directory, or put the model "
                          f"folder back")
    return None


def check_files(folder: Path) -> None:
    """Refuse a model file of `folder` (METADATA) that is there but is no regular file (a folder, a
    pipe): skipped, the export went without a tokenizer, exit 0."""
    for name in METADATA:
        path = folder / name
        if path.exists() and not path.is_file():
            kind = "a folder" if path.is_dir() else "not a regular file"
            raise ConfigError(f"{path} is {kind}, where the model's {name} belongs: put the file back (from the "
                              f"model folder the run trained from), or export with --format pipezero")


def check_describes(kept: Path, ckpt: Path, cfg: ModelConfig) -> None:
    """Refuse a kept config.json that no longer describes checkpoint `ckpt`'s model (`cfg`, from its
    manifest): the --model folder or RUN/hf changed after training, and the export would be a
    folder transformers cannot load, or loads as another model."""
    theirs = model_fields(kept)
    differ = [f"{k} {v!r} there, {getattr(cfg, k)!r} in the checkpoint" for k, v in theirs.items()
              if getattr(cfg, k) != v]
    if differ:
        raise ConfigError(f"{kept / CONFIG} does not describe the weights of {ckpt} ({'; '.join(differ[:3])}"
                          f"{'; ...' if len(differ) > 3 else ''}): put back the config.json the run trained from, "
                          f"or export with --format pipezero")


def export_hf(source: Path, out: Path, shard_size: int) -> tuple[Path, str]:
    """Write the Hugging Face folder `out` from checkpoint `source` (a checkpoint folder, or a run
    directory: its newest good checkpoint). Returns the checkpoint used and a line saying which
    tokenizer the folder holds, or why none. `out` must be new or empty, and is written whole
    beside it (export_folder.py)."""
    check_out(out, source)
    ckpt = checkpoint_to_export(source)
    manifest = read_manifest(ckpt)
    run_config = manifest["config"]
    fields = run_config.get("model")
    if isinstance(fields, dict) and fields.get("spec"):
        raise ConfigError(f"{ckpt} is a run of --model-spec {fields['spec']}, a model of your own with no Hugging "
                          f"Face form; export it with --format pipezero")
    cfg = manifest_model(ckpt, fields)
    kept = metadata_folder(ckpt, fields.get("pretrained"))
    if kept is not None:
        check_describes(kept, ckpt, cfg)
        config = json.loads((kept / CONFIG).read_text())
        config["dtype"] = "float32"
        config.pop("torch_dtype", None)
    else:
        config = llama_config(fields)

    # The model folder's tokenizer (kept in RUN/hf), else the file the run read, as its checkpoint
    # recorded it (an absolute path, checked against the content it trained with): the settings'
    # path is as typed, relative to wherever the run was started.
    # The folder's only where the run trained with it: `--model M --tokenizer bytes` (or a file of
    # one's own) trained M's rows on other ids.
    saved = manifest.get("data") or {}
    has_own = kept is not None and (kept / "tokenizer.json").is_file() and trained_with(kept / "tokenizer.json", saved)
    theirs, said = (None, f"tokenizer.json: the model folder's, from {kept}") if has_own else tokenizer_file_of(saved)

    def fill(folder: Path) -> None:
        write_weights(hf_tensors(read_model(ckpt), cfg), folder, shard_size)
        atomic_write_json(folder / CONFIG, config)
        # the folder's tokenizer files describe its tokenizer: only with it (generation settings always)
        for name in (METADATA[1:] if has_own else [GENERATION]):
            if kept is not None and (kept / name).is_file():
                shutil.copyfile(kept / name, folder / name)
        if theirs is not None:
            shutil.copyfile(theirs, folder / "tokenizer.json")

    write_folder(out, fill)
    return ckpt, said


def trained_with(path: Path, saved: dict[str, Any]) -> bool:
    """Whether tokenizer file `path` is the one a checkpoint's run read, by the name (a digest of its
    content) the checkpoint recorded; a checkpoint from before that record: taken as the run's."""
    from pipezero.data.tokenizer import BPETokenizer

    if "tokenizer" not in saved:
        return True
    try:
        return BPETokenizer.from_file(path).name == saved["tokenizer"]
    except ConfigError:  # not a tokenizer any more: never copied as the run's
        return False
