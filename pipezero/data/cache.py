"""Documents tokenized once into a memory-mapped token cache with document offsets.

A cache is a folder named by a key (the inputs' fingerprint, the tokenizer's content, the settings
that change which documents are kept). It is built in a temporary folder beside it and renamed into
place when complete, so an interrupted build leaves only a temporary folder that nothing reads, and
a cache is never reused for other inputs or another tokenizer. Its meta.json records every file's
size, the offsets' digests and a checksum over itself: an entry damaged since (a truncated or edited
file, a disk that lost a write) is rebuilt instead of read, where a truncation that keeps the
dtype's alignment would otherwise train on less data without a word. Documents stream through in batches
(`tokenizers` encodes a batch on every core); each document is followed by the tokenizer's EOS id.
Every k-th document (k = 1 / held-out fraction) goes to the held-out split, so it is split by
documents, never inside one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pipezero.errors import ConfigError
from pipezero.data.sources import Reader
from pipezero.data.tokenizer import Tokenizer, id_bound
from pipezero.data.cache_folder import build_once, cache_dir
from pipezero.files import physical

BATCH_DOCS = 1024  # documents a tokenizer call: enough to keep every core busy
BATCH_CHARS = 8 << 20  # ... or this much text, whichever comes first, so memory stays bounded
SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class DocTokens:
    """Documents back to back: document d is tokens[offsets[d]:offsets[d + 1]] (its EOS included)."""

    tokens: np.ndarray  # 1-D, memory-mapped, uint16 or uint32
    offsets: np.ndarray  # (n_docs + 1,) int64, offsets[0] == 0

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _SplitWriter:
    """Appends documents of one split to its token file and remembers where each ends."""

    def __init__(self, f: BinaryIO, dtype: np.dtype, eos: int | None) -> None:
        self.f, self.dtype, self.eos = f, dtype, eos
        self.ends: list[np.ndarray] = []  # int64 ends of each batch's documents (arrays: millions stay small)
        self.n = 0

    @property
    def n_docs(self) -> int:
        return sum(len(e) for e in self.ends)

    def offsets(self) -> np.ndarray:
        return np.concatenate([np.zeros(1, dtype=np.int64), *self.ends])

    def write(self, docs: list[list[int]]) -> None:
        if not docs:
            return
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=self.dtype, count=int(lengths.sum()))
        if self.eos is not None:
            flat = np.insert(flat, np.cumsum(lengths), self.eos)
            lengths = lengths + 1
        self.f.write(flat.tobytes())
        self.ends.append(self.n + np.cumsum(lengths))
        self.n = int(self.ends[-1][-1])


def _batches(reader: Reader, files: list[Path], progress: "BuildProgress") -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for i, f in enumerate(files):
        before = 0
        progress.file(i, f)
        for text, done in reader.documents(f):
            batch.append(text)
            chars += len(text)
            progress.advance(done - before)
            before = done
            if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def _move_last(src: _SplitWriter, dst: _SplitWriter, src_path: Path) -> None:
    """Move the last document of `src` to the empty split `dst`."""
    src.f.flush()
    offsets = src.offsets()
    start = int(offsets[-2])
    with src_path.open("rb") as f:
        f.seek(start * src.dtype.itemsize)
        tail = f.read()
    src.f.truncate(start * src.dtype.itemsize)
    src.ends, src.n = [offsets[1:-1]], start
    dst.f.write(tail)
    dst.n = len(tail) // src.dtype.itemsize
    dst.ends = [np.array([dst.n], dtype=np.int64)]


def build(dest: Path, files: list[Path], reader: Reader, tok: Tokenizer, heldout_every: int) -> None:
    """Tokenize every document of `files` into the cache folder `dest` (atomically)."""
    dtype = token_dtype(id_bound(tok))  # EOS included: a model's config.json may name one past the vocabulary
    tmp = Path(tempfile.mkdtemp(dir=physical(dest.parent), prefix=f".{dest.name}.", suffix=".tmp"))
    try:
        with BuildProgress(files) as progress, \
                (tmp / "train.tokens").open("wb") as ft, (tmp / "heldout.tokens").open("wb") as fh:
            writers = _SplitWriter(ft, dtype, tok.eos_id), _SplitWriter(fh, dtype, tok.eos_id)
            seen = 0
            for texts in _batches(reader, files, progress):
                parts: tuple[list[list[int]], list[list[int]]] = ([], [])
                for ids in tok.encode_many(texts):
                    if len(ids) < 2:
                        reader.records.short += 1
                        continue
                    parts[seen % heldout_every == heldout_every - 1].append(ids)
                    seen += 1
                for w, docs in zip(writers, parts):
                    w.write(docs)
                progress.tokens(sum(len(d) for p in parts for d in p), seen)
            if not writers[1].n_docs and writers[0].n_docs > 1:  # fewer than k documents: hold out the last
                _move_last(writers[0], writers[1], tmp / "train.tokens")
            for f in (ft, fh):
                f.flush()
                os.fsync(f.fileno())
        for name, w in zip(SPLITS, writers):
            np.save(tmp / f"{name}.offsets.npy", w.offsets(), allow_pickle=False)
        seal(tmp, {"dtype": dtype.name, "documents": seen, "skipped": reader.records.skipped,
                   "first_skipped": reader.records.first, "short": reader.records.short, "tokenizer": tok.name})
        try:
            os.rename(tmp, dest)
        except OSError:  # another process finished the same cache first: keep theirs
            if not (dest / "meta.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


META = "meta.json"


def _digest(path: Path) -> str:
    with path.open("rb") as f:  # streamed: a whole token file is never held in memory to hash it
        return hashlib.file_digest(f, "sha256").hexdigest()


def _checksum(meta: dict) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode()).hexdigest()


def seal(folder: Path, meta: dict, digested: Iterable[str] | None = None) -> None:
    """Write meta.json: `meta`, every file's size, the digests of the files named `digested` (by
    default the offsets: 8 bytes a document, cheap to hash at each open; a corpus's token files are
    only sized, being the bulk), and a checksum of it all."""
    names = [f"{s}.offsets.npy" for s in SPLITS] if digested is None else list(digested)
    meta = {**meta, "files": {p.name: p.stat().st_size for p in sorted(folder.iterdir())},
            "sha256": {name: _digest(folder / name) for name in names}}
    (folder / META).write_text(json.dumps({**meta, "checksum": _checksum(meta)}))


def problem(folder: Path) -> str | None:
    """Why the entry `folder` does not match its meta.json (so cannot be read as it is); None when it does."""
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        return f"no {META}"
    except (OSError, ValueError) as e:
        return f"{META} is not readable json: {str(e).splitlines()[0]}"
    if not isinstance(meta, dict) or meta.get("checksum") != _checksum(meta):
        return f"{META} does not match its checksum"
    for name, size in meta["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if (got := path.stat().st_size) != size:
            return f"{name} holds {got} bytes, not {size}"
    for name, digest in meta["sha256"].items():
        if _digest(folder / name) != digest:
            return f"{name} does not match its checksum"
    return None


def open_split(folder: Path, name: str) -> DocTokens:
    """Split `name` of an entry that `problem` found whole."""
    dtype = json.loads((folder / META).read_text())["dtype"]
    offsets = np.load(folder / f"{name}.offsets.npy", allow_pickle=False)
    path = folder / f"{name}.tokens"
    tokens = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype=dtype)
    return DocTokens(tokens, offsets)


def past_vocab(folder: Path, vocab: int) -> str | None:
    """An id the tokenizer cannot have made, in entry `folder` that `problem` found whole: its token
    files are only sized (they are the bulk), so bytes edited in place pass that check, and the
    embedding's IndexError ended the run in a traceback. One pass over the memory-mapped tokens,
    as a token file given as --data gets."""
    for name in SPLITS:
        tokens = open_split(folder, name).tokens
        if len(tokens) and (top := int(tokens.max())) >= vocab:
            return f"{name}.tokens holds id {top}, past the tokenizer's {vocab}"
    return None


def discard(folder: Path) -> None:
    """Remove the damaged entry `folder`: renamed aside first, so no reader finds half of it."""
    aside = Path(tempfile.mkdtemp(dir=physical(folder.parent), prefix=f".{folder.name}.", suffix=".damaged"))
    os.replace(folder, aside / folder.name)
    shutil.rmtree(aside, ignore_errors=True)


def build_arrays(dest: Path, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """A cache entry of whole arrays (`NAME.npy` each) at folder `dest`: built beside it, sealed with
    every file's size and digest (a bounded corpus: hashing it at each open is cheap), then renamed
    into place, as `build`'s entries are."""
    tmp = Path(tempfile.mkdtemp(dir=physical(dest.parent), prefix=f".{dest.name}.", suffix=".tmp"))
    try:
        for name, arr in arrays.items():
            with (tmp / f"{name}.npy").open("wb") as f:
                np.save(f, arr, allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
        seal(tmp, meta, [f"{name}.npy" for name in arrays])
        try:
            os.rename(tmp, dest)
        except OSError:  # another process finished the same entry first: keep theirs
            if not (dest / META).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_or_build(key: str, files: list[Path], reader: Reader, tok: Tokenizer,
                  heldout_every: int) -> tuple[DocTokens, DocTokens]:
    """(train, held-out) documents, built on the first call for this key (or when the entry no
    longer matches its meta.json) and memory-mapped after."""
    folder = cache_dir() / f"docs-{key}"

    def damage() -> str | None:
        return problem(folder) or past_vocab(folder, tok.vocab_size)

    def make() -> None:
        if folder.exists():
            print(f"pipezero: warning: the token cache entry {folder} is damaged ({damage()}); rebuilding it",
                  file=sys.stderr, flush=True)
            discard(folder)
        build(folder, files, reader, tok, heldout_every)
        if reason := problem(folder):
            raise ConfigError(f"the token cache entry {folder} is damaged right after it was built ({reason}); "
                              f"check the disk, or point PIPEZERO_CACHE at another folder")
        if reader.records.summary():
            print(f"pipezero: {reader.records.summary()}", flush=True)

    build_once(folder.name, lambda: damage() is None, make)
    train, heldout = (open_split(folder, s) for s in SPLITS)
    if train.n_docs == 0:
        raise ConfigError(nothing_kept(json.loads((folder / META).read_text()), len(files)))
    return train, heldout


def nothing_kept(meta: dict, n_files: int) -> str:
    """Why an entry (its meta.json) holds no document: with --on-bad-record skip, every record may have
    been skipped as bad, where "give more text" would send the user the wrong way."""
    skipped, short = meta.get("skipped", 0), meta.get("short", 0)
    if not skipped:
        return f"--data holds no document of two tokens or more ({n_files} files); give more text"
    first = f" (first: {meta['first_skipped']})" if meta.get("first_skipped") else ""
    said = (f"{skipped:,} records were skipped as bad{first} and {short:,} documents are shorter than two tokens"
            if short else f"all {skipped:,} records were skipped as bad{first}")
    return f"--data holds no document: {said}; fix them (--on-bad-record fail stops at the first)"


class BuildProgress:
    """A rich progress bar over the input bytes, with documents and tokens per second; shown by one
    process only (the launcher, or rank 0 under an outside torchrun)."""

    def __init__(self, files: list[Path]) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.files = files
        self.show = os.environ.get("RANK", "0") == "0"
        self.bar = Progress(TextColumn("tokenizing {task.description}"), BarColumn(),
                            TextColumn("{task.percentage:>3.0f}% {task.fields[docs]:,} docs {task.fields[rate]}"),
                            TimeRemainingColumn(), disable=not self.show, transient=True)
        self.task = self.bar.add_task("", total=sum(f.stat().st_size for f in files), docs=0, rate="")
        self.n_tokens = 0

    def __enter__(self) -> "BuildProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(*exc)

    def file(self, i: int, f: Path) -> None:
        self.bar.update(self.task, description=f"file {i + 1}/{len(self.files)} {f.name}")

    def advance(self, n_bytes: int) -> None:
        self.bar.advance(self.task, n_bytes)

    def tokens(self, n: int, docs: int) -> None:
        self.n_tokens += n
        elapsed = self.bar.tasks[0].elapsed or 0.0
        rate = f"{self.n_tokens / elapsed / 1e6:.2f}M tokens/s" if elapsed > 0 else ""
        self.bar.update(self.task, docs=docs, rate=rate)
