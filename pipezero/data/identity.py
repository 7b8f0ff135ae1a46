"""What a run trained on, as each checkpoint records it, so a resume and an export can tell when the
data under the same names changed.

A run's settings name its data by path (`--data docs`, `--tokenizer tok.json`), and a path keeps its
name while its contents change: documents edited or added, another tokenizer saved over the file.
A checkpoint therefore records the tokenizer by its content (its name is a digest of the file), the
file it was read from, and a digest of the token arrays the run read. Hashing a token array costs a
pass over it, so a large one is hashed by evenly spaced blocks with its length and dtype: any
document added, removed or re-tokenized moves the blocks that follow it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

WHOLE_BYTES = 64 << 20  # an array up to this size is hashed whole (a fraction of a second)
BLOCKS, BLOCK_BYTES = 1024, 16 << 10  # a larger one: this many blocks of this size, evenly spaced


def tokens_digest(*arrays: np.ndarray) -> str:
    """A digest of the token arrays, bounded in cost whatever their size."""
    h = hashlib.sha256()
    for arr in arrays:
        a = np.asarray(arr).reshape(-1)
        h.update(f"{a.dtype.str}:{a.size};".encode())
        if a.nbytes <= WHOLE_BYTES:
            h.update(np.ascontiguousarray(a).tobytes())
            continue
        per_block = max(1, BLOCK_BYTES // a.itemsize)
        for start in np.linspace(0, a.size - per_block, BLOCKS, dtype=np.int64):
            h.update(np.ascontiguousarray(a[start:start + per_block]).tobytes())
    return h.hexdigest()[:32]


def data_record(corpus: Any) -> dict[str, Any]:
    """What a checkpoint records of the corpus a run read (`Corpus`): the tokenizer's content name
    and the absolute path of its file (None: bytes, or a token file without one), and its tokens'
    digest."""
    tok = corpus.tokenizer
    file = getattr(tok, "file", None)
    return {"tokenizer": tok.name if tok is not None else None,
            "tokenizer_file": str(file) if file is not None else None,
            "corpus": tokens_digest(corpus.train, corpus.heldout)}


def data_change(saved: dict[str, Any], now: dict[str, Any], data_flag: str) -> str | None:
    """What changed between the data a checkpoint's run read (`saved`, its manifest's "data") and
    the data this start reads (`now`, `data_record`), said for a refusal; None when neither did, or
    when the checkpoint predates these records (nothing to compare)."""
    if "corpus" not in saved or "tokenizer" not in saved:
        return None
    if saved["tokenizer"] != now["tokenizer"]:
        return f"the tokenizer changed (it trained with {_named(saved)}; now {_named(now)})"
    if saved["corpus"] != now["corpus"]:
        return f"the corpus under {data_flag} changed since it was trained on (its tokens differ)"
    return None


def tokenizer_now(kind: str) -> dict[str, Any] | None:
    """The record (as `data_record` writes it) of the tokenizer `kind` (data.tokenizer) names, when
    it is known without reading any text: bytes, or a tokenizer.json (its content name, a second to
    read); None for a BPE trained on the data (known only once trained) or a file that will not load
    (the data's own checks name it)."""
    if kind == "bytes":
        return {"tokenizer": "bytes", "tokenizer_file": None}
    if not kind.endswith(".json"):
        return None
    from pipezero.data.tokenizer import BPETokenizer

    try:
        tok = BPETokenizer.from_file(kind)
    except Exception:  # noqa: BLE001 - unreadable: refused by the tokenizer's own check, with its reason
        return None
    return {"tokenizer": tok.name, "tokenizer_file": str(tok.file)}


def tokenizer_change(saved: dict[str, Any], kind: str) -> str | None:
    """`data_change`'s tokenizer half, said before any text is read (tokenizing the built-in corpus
    with a new tokenizer takes minutes): None when the checkpoint's run (`saved`) used the same
    tokenizer, read token ids, or predates the record, or when `kind`'s is known only once trained."""
    if not isinstance(saved.get("tokenizer"), str) or (now := tokenizer_now(kind)) is None:
        return None
    if saved["tokenizer"] != now["tokenizer"]:
        return f"the tokenizer changed (it trained with {_named(saved)}; now {_named(now)})"
    return None


def _named(record: dict[str, Any]) -> str:
    """A tokenizer as a refusal names it: its file and content, or its kind."""
    name = record["tokenizer"] or "token ids, no tokenizer"
    return f"{record['tokenizer_file']}, content {name}" if record.get("tokenizer_file") else name


def tokenizer_file_of(saved: dict[str, Any]) -> tuple[Path | None, str]:
    """The tokenizer.json a checkpoint's run read, if it is still there with the content the run
    trained with, and a line saying what an export holds of it (or why none)."""
    from pipezero.data.tokenizer import BPETokenizer

    name, file = saved.get("tokenizer"), saved.get("tokenizer_file")
    if "tokenizer" not in saved:
        return None, "no tokenizer: the checkpoint predates the record of its tokenizer; copy its tokenizer.json in"
    if name is None:
        return None, "no tokenizer: the run read token ids (a token file with no tokenizer.json)"
    if name == "bytes":
        return None, "no tokenizer: the run used --tokenizer bytes (a token a UTF-8 byte, ids 0-255)"
    if file is None or not Path(file).is_file():
        return None, f"no tokenizer: the file the run read, {file}, is gone; put it back and export again"
    try:
        if BPETokenizer.from_file(file).name != name:
            return None, f"no tokenizer: {file} changed since the run read it; put its file back and export again"
    except Exception:  # noqa: BLE001 - any unreadable file: named, never copied
        return None, f"no tokenizer: {file} is no longer a tokenizer.json; put the run's back and export again"
    return Path(file), f"tokenizer.json: the run's, from {file}"
