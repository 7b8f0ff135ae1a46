"""Hugging Face safetensors weights: checked from their headers before any process starts, and
read per rank, one tensor at a time, only for the layers of that rank's stage chunks.

A safetensors file is a json header (names, dtypes, shapes, offsets) and raw bytes; `safe_open`
maps it and reads a tensor's bytes only when asked. So the preflight check of every name and shape
costs the headers alone, and a rank holding layers 9-16 of a 32-layer model never reads the
others: its peak is its chunks plus one tensor (bench/hf_load.py). Under ZeRO-3 a rank reads less
still: `FlatReader` hands ZeRO (zero/buckets.py) the flat ranges of its shards, each read as the rows
of the tensor it overlaps (`get_slice`) and cut to the exact range, so the chunk's full trainable
weights are never in memory on any rank; frozen tensors are not sharded and `load_chunk` reads them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pipezero.config import ModelConfig
from pipezero.errors import ConfigError
from pipezero.models.hf import HF_BLOCK_NAME, TOKENIZER, read_json, to_hf

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def _open(path: Path):  # noqa: ANN202 - safetensors' handle type is private
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own errors for a bad header
        raise ConfigError(f"{path} is not a readable safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the file holding it, from the shard index or the single file."""
    index = folder / INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError(f"{index}: field 'weight_map' is not an object of tensor name -> file name")
        files = {name: folder / file for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if path.parent != folder or not path.is_file():
                raise ConfigError(f"{index} names shard {path.name!r}, which is not a file in {folder}")
        return files
    single = folder / SINGLE
    if not single.is_file():
        raise ConfigError(f"{single} does not exist (nor {INDEX}): the weights must be safetensors")
    with _open(single) as f:
        return {name: single for name in f.keys()}


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the whole model and its shape, built on the meta device (no memory)."""
    from pipezero.models.chunk import StageChunk
    from pipezero.models.meta import shapes_only

    with shapes_only():
        model = StageChunk(cfg, 0, cfg.n_layers + 2, seed=0, init=False)
    return {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}


def _by_file(names: list[str], cfg: ModelConfig, files: dict[str, Path]) -> dict[Path, list[tuple[str, str]]]:
    """Group our names by the file holding their Hugging Face tensor; a missing one is an error."""
    groups: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    for ours in names:
        theirs = to_hf(ours, cfg.n_layers, cfg.tie_embeddings)
        if theirs not in files:
            raise ConfigError(f"{cfg.pretrained}: tensor {theirs!r} is missing from the weights "
                              f"(config.json's shape needs it)")
        groups[files[theirs]].append((ours, theirs))
    return groups


def unread_blocks(cfg: ModelConfig) -> str | None:
    """Where the weights hold more blocks than config.json's num_hidden_layers, what a run does with
    them: trains the first ones and leaves the rest (as transformers does, with a warning too)."""
    if cfg.pretrained is None:
        return None
    held = {int(m.group(1)) for name in weight_files(Path(cfg.pretrained)) if (m := HF_BLOCK_NAME.match(name))}
    if len(held) <= cfg.n_layers:
        return None
    return (f"{Path(cfg.pretrained) / 'config.json'}: num_hidden_layers = {cfg.n_layers}, but the weights hold "
            f"{len(held)} blocks: the run trains blocks 0-{cfg.n_layers - 1} and leaves the other "
            f"{len(held) - cfg.n_layers} unread (export writes {cfg.n_layers})")


def check_weights(cfg: ModelConfig) -> None:
    """Refuse a folder whose weights disagree with its config.json, from the headers alone."""
    assert cfg.pretrained is not None
    files = weight_files(Path(cfg.pretrained))
    held = {int(m.group(1)) for name in files if (m := HF_BLOCK_NAME.match(name))}
    if cfg.n_layers > len(held):  # before the shapes: they are built a block at a time (10^9 blocks: never done)
        raise ConfigError(f"{Path(cfg.pretrained) / 'config.json'}: num_hidden_layers = {cfg.n_layers}, but the "
                          f"weights hold {len(held)} blocks (model.layers.N); fix config.json")
    shapes = expected_shapes(cfg)
    for path, pairs in _by_file(list(shapes), cfg, files).items():
        with _open(path) as f:
            held = set(f.keys())
            for ours, theirs in pairs:
                if theirs not in held:  # only an index can name a file for a tensor it lacks
                    raise ConfigError(f"{Path(cfg.pretrained) / INDEX} puts tensor {theirs!r} in {path.name}, which "
                                      f"does not hold it; fix the index's weight_map")
                piece = f.get_slice(theirs)
                got, dtype = tuple(piece.get_shape()), piece.get_dtype()
                if got != shapes[ours]:
                    raise ConfigError(f"{path}: tensor {theirs!r} has shape {list(got)}, but config.json's "
                                      f"shape needs {list(shapes[ours])}")
                if dtype not in FLOAT_DTYPES:
                    raise ConfigError(f"{path}: tensor {theirs!r} is {dtype}; weights must be floating point")


SCAN_ELEMENTS = 16 << 20  # values read at a time by the non-finite scan: its memory stays bounded


def _nonfinite(values: torch.Tensor) -> int:
    """How many of `values` are NaN or inf. A sum screens them first: it is finite only when every
    value is, and costs a sixth of isfinite's pass (CPU, torch 2.13); the exact count is taken only
    when the sum is not finite (an overflowing sum then counts 0)."""
    wide = torch.float64 if values.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(values.sum(dtype=wide))):
        return 0
    return int((~torch.isfinite(values)).sum())


def _count_nonfinite(path: Path, name: str) -> tuple[int, int]:
    """(values of tensor `name` in `path` that are NaN or inf, its values), read a block of rows at a
    time; one mapping a tensor, so the pages read leave memory as it closes (as in load_chunk)."""
    with _open(path) as f:
        piece = f.get_slice(name)
        shape = piece.get_shape()
        if len(shape) < 2:
            values = f.get_tensor(name)
            return _nonfinite(values), values.numel()
        rows = max(1, SCAN_ELEMENTS // max(1, math.prod(shape[1:])))
        return sum(_nonfinite(piece[i:i + rows]) for i in range(0, shape[0], rows)), math.prod(shape)


def check_finite(cfg: ModelConfig) -> None:
    """Refuse weights holding NaN or inf, naming the tensors. Every step of such a model is
    non-finite: it would be skipped until the run stops (or, under run.max_bad_steps, a run would
    exit 0 having learnt nothing). This reads every tensor once, so it runs once, where the ranks
    are launched (cli/train.py), and each rank checks only the tensors it loads (`_finite`)."""
    assert cfg.pretrained is not None
    groups = _by_file(list(expected_shapes(cfg)), cfg, weight_files(Path(cfg.pretrained)))
    counts = {theirs: _count_nonfinite(path, theirs) for path, pairs in groups.items() for theirs in {t for _, t in pairs}}
    bad = sorted((name, n, total) for name, (n, total) in counts.items() if n)
    if bad:
        shown = ", ".join(f"{name} ({n} of {total}{' values' if i == 0 else ''})" for i, (name, n, total) in enumerate(bad[:5]))
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ConfigError(f"{cfg.pretrained}: {len(bad)} tensor{'s hold' if len(bad) > 1 else ' holds'} NaN or inf: "
                          f"{shown}{more}; these weights cannot train: restore them from their source")


def _finite(values: torch.Tensor, name: str, path: Path) -> torch.Tensor:
    """`values` read from tensor `name`, refused when not finite (a rank's own check: an outside
    torchrun starts ranks with no launcher to scan the folder first)."""
    if _nonfinite(values):
        raise ConfigError(f"{path}: tensor {name!r} holds NaN or inf; these weights cannot train: restore them "
                          f"from their source")
    return values


def check_tokenizer(cfg: ModelConfig, tokenizer: str) -> None:
    """Every id the tokenizer can produce must be a row of the embedding: its count, and its
    largest id (an id at or past vocab_size fails inside every rank's embedding lookup, mid-run)."""
    from pipezero.data.tokenizer import BPETokenizer, largest_id

    path = Path(tokenizer)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: a Hugging Face model folder needs its {TOKENIZER}")
    hf = BPETokenizer.from_file(path).hf
    size = hf.get_vocab_size()
    if size > cfg.vocab_size:
        raise ConfigError(f"{path} has {size} tokens but config.json's vocab_size is {cfg.vocab_size}: "
                          f"the embedding has no row for the rest")
    top, token = largest_id(hf)
    if top >= cfg.vocab_size:
        raise ConfigError(f"{path} gives id {top} ({token!r}) but config.json's vocab_size is {cfg.vocab_size}: "
                          f"the embedding has no row for it; number the tokenizer's ids below {cfg.vocab_size}")


@torch.no_grad()
def load_chunk(chunk: nn.Module, cfg: ModelConfig, frozen_only: bool = False) -> None:
    """Overwrite `chunk`'s parameters with the folder's tensors: only this chunk's, one at a time
    (fp32 whatever the stored dtype: pipezero's weights and optimizer are fp32). `frozen_only`: the
    trainable ones are left to ZeRO-3, which reads only its shards of them (FlatReader)."""
    assert cfg.pretrained is not None
    # a tied head in the embedding's chunk is the embedding itself
    params = {n: p for n, p in chunk.named_parameters() if not (frozen_only and p.requires_grad)}
    files = weight_files(Path(cfg.pretrained))
    for path, pairs in _by_file(sorted(params), cfg, files).items():
        for ours, theirs in pairs:
            # A mapping a tensor: the file pages it touched leave resident memory when it closes,
            # so a rank peaks at its chunks plus one tensor, not plus every page it read.
            with _open(path) as f:
                params[ours].copy_(_finite(f.get_tensor(theirs), theirs, path))


class FlatReader:
    """Reads elements [start, stop) of one of our parameters, flattened, from the folder in its
    stored dtype (the bucket's copy into its fp32 shard converts: no fp32 copy of the range first):
    ZeRO-3's shard of a bucket is such a range of each parameter it overlaps (zero/buckets.py).

    A flat range starts and ends mid-row, and `get_slice` cuts whole rows: the rows the range
    touches are read and cut to it, so at most two rows a tensor more than the range are read.
    `elements_read` counts them (tests and the load bench compare it with the chunk's size)."""

    def __init__(self, cfg: ModelConfig) -> None:
        assert cfg.pretrained is not None
        self.cfg = cfg
        self.files = weight_files(Path(cfg.pretrained))
        self.elements_read = 0

    @torch.no_grad()
    def __call__(self, name: str, start: int, stop: int) -> torch.Tensor:
        theirs = to_hf(name, self.cfg.n_layers, self.cfg.tie_embeddings)
        with _open(self.files[theirs]) as f:  # one mapping a range: its pages leave memory on close
            piece = f.get_slice(theirs)
            shape = piece.get_shape()
            row = math.prod(shape[1:])  # elements a row (1 for a vector)
            first, last = start // row, -(-stop // row)
            rows = piece[first:last].reshape(-1)
            self.elements_read += rows.numel()
            return _finite(rows[start - first * row:stop - first * row], theirs, self.files[theirs])
