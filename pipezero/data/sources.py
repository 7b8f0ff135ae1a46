"""Documents from the user's files: jsonl/json records, parquet rows, or whole text files.

Every reader streams (jsonl line by line, parquet one row group at a time, a text file at a time),
so a file larger than memory is never held whole; a document larger than data.max_document_mb is a
bad record, found from its size before it is decoded (a jsonl line that long is skipped over in
blocks, never held): tokenizing one document takes ~50-200x its text in memory, so a 48 MB line
peaked at 977 MB with bytes and 10.8 GB with a 300-token BPE. A bad record is reported as `file:line` so the
user can find it; with `skip` it is counted instead, and the count is printed once at the end.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from pipezero.config import OnBadRecord
import pipezero.data.json_array as json_array
from pipezero.errors import ConfigError

RECORD_SUFFIXES = {".jsonl", ".json"}
TABLE_SUFFIXES = {".parquet"}
# One document a file. Source-code suffixes stay accepted: a folder of code is a corpus too.
TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".toml", ".c", ".h", ".html", ".csv"}
DOCUMENT_SUFFIXES = RECORD_SUFFIXES | TABLE_SUFFIXES | TEXT_SUFFIXES
# What Windows editors, Excel and PowerShell put before UTF-8 text: a mark, never part of the first
# record (json refuses it, and in a text document it would be tokenized as content).
BOM = b"\xef\xbb\xbf"
# Half of a UTF-16 pair: JSON may escape one alone (\ud800), and no encoder, the tokenizer's included,
# can write it.
SURROGATE = re.compile("[\ud800-\udfff]")


def expand(paths: list[str]) -> list[Path]:
    """Files named by `paths` (files, folders searched recursively, or glob patterns), sorted within
    each argument so the order, and with it the corpus, is the same on every machine. A file that
    several arguments name (a folder and a glob inside it, a link) is read once, where it is first
    named: read twice, its documents would fall on both sides of the held-out split."""
    files: list[Path] = []
    seen: set[Path] = set()
    for arg in paths:
        p = Path(arg)
        if p.is_dir():
            if (closed := _unlisted(p)) is not None:  # the search passes it by: the corpus would lack its files
                raise ConfigError(f"--data {arg!r}: the folder {closed.filename!r} cannot be read "
                                  f"({closed.strerror}): make it readable (chmod a+rx), or name other folders")
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in DOCUMENT_SUFFIXES)
            what = f"folder {arg!r} holds no document files"
        elif p.is_file():
            found = [p]
            what = ""
        elif p.exists():  # a pipe, socket or device: read as a document it could block or never end
            raise ConfigError(f"--data {arg!r} is not a regular file or folder; pass document files, folders or globs")
        else:
            found = sorted(Path(f) for f in glob.glob(arg, recursive=True) if Path(f).is_file())
            what = f"--data {arg!r} matches no files"
        if not found:
            raise ConfigError(f"{what} ({', '.join(sorted(DOCUMENT_SUFFIXES))}); pass documents or a token file")
        for f in found:
            if f.suffix not in DOCUMENT_SUFFIXES:
                raise ConfigError(f"--data file {str(f)!r}: unknown kind {f.suffix or '(no suffix)'!r}; use "
                                  f".jsonl/.json/.parquet records, .txt/.md text, or .npy/.bin tokens")
        for f in found:
            try:
                os.close(os.open(f, os.O_RDONLY | os.O_NONBLOCK))
            except OSError as e:  # else met by the tokenizer on every rank, and said as a write refused
                raise ConfigError(f"--data file {str(f)!r} cannot be read ({e.strerror}): make it readable "
                                  f"(chmod a+r), or leave it out of --data") from None
            if (real := f.resolve()) not in seen:
                seen.add(real)
                files.append(f)
    return files


def _unlisted(folder: Path) -> OSError | None:
    """The first folder under `folder` (itself included) this user cannot list, as the OSError
    listing it raised; None where every one can be. pathlib's search skips such a folder in silence."""
    refused: list[OSError] = []
    for _ in os.walk(folder, onerror=refused.append):
        if refused:
            break
    return refused[0] if refused else None


MAGIC = re.compile(r"[*?[]")


def _glob_reaches(pattern: str, run: Path) -> bool:
    """Whether glob `pattern` can match a file inside the folder `run`, or lies inside it."""
    parts = Path(os.path.abspath(pattern)).parts
    fixed = next(i for i, part in enumerate(parts) if MAGIC.search(part))
    prefix, rest = Path(*parts[:fixed]).resolve(), parts[fixed:]
    if prefix == run or run in prefix.parents:
        return True
    if prefix not in run.parents:
        return False
    inside = run.relative_to(prefix).parts  # a file of the run is these and at least one more part
    if "**" in rest:
        rest = rest[:rest.index("**")]
    elif len(rest) <= len(inside):
        return False
    return all(fnmatch.fnmatchcase(name, part) for name, part in zip(inside, rest))


def check_out_of_reach(paths: list[str], out: str) -> None:
    """Refuse a run folder and documents that overlap: the run's own files (metrics.jsonl,
    hf/config.json, checkpoints' json) would be read as documents when it resumes, and the corpus
    would change under it. Refused rather than left out of the corpus: then `--data docs` would
    mean other documents in each command, and a run folder among the documents is a mistake to
    say before anything is written, not to work around."""
    if not out.strip():  # Path('') is the working directory, which holds the data: the command says 'empty'
        return
    run = Path(out).resolve()
    for arg in paths:
        path = Path(arg)
        real = path.resolve() if path.exists() else None
        if real is not None and run in real.parents:
            raise ConfigError(f"--out {out!r} holds --data {arg!r}: the run's own files could be read as documents "
                              f"when it resumes; put --out outside the data")
        if (real == run or real in run.parents) if real is not None else (MAGIC.search(arg) and _glob_reaches(arg, run)):
            raise ConfigError(f"--out {out!r} is inside --data {arg!r}: the run's own files would be read as "
                              f"documents when it resumes; put --out outside the data")


def check_cache_out_of_reach(paths: list[str]) -> None:
    """Refuse a cache folder inside a data folder: its tokenizers (.json) and token files are read as
    documents by the next run (with PIPEZERO_CACHE=docs/cache the first run trains, then every later
    one stops at 'docs/cache/bpe-....json:1: no field text'), and the corpus changes as the cache
    fills."""
    from pipezero.data.cache_folder import cache_root

    cache, source = cache_root()
    where = cache.resolve()
    for arg in paths:
        path = Path(arg)
        if path.is_dir() and (where == path.resolve() or path.resolve() in where.parents):
            raise ConfigError(f"the cache folder {cache} ({source}) is inside --data {arg!r}: its tokenizers and token "
                              f"files would be read as documents; point PIPEZERO_CACHE outside the data")


def fingerprint(files: list[Path], *extra: object) -> str:
    """A key for what these inputs hold: each path, size, modification and change time, plus
    `extra` settings that change the documents read. The modification time alone can stay the same
    across an edit: a filesystem with 1-2 s timestamps, or a tool that keeps it (`cp -p`, `rsync -t`,
    `tar x`); the change time is set by every write and by no tool, as git's index relies on."""
    h = hashlib.sha256(repr(extra).encode())
    for f in files:
        st = f.stat()
        line = f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n"
        h.update(line.encode(errors="surrogateescape"))  # a file name need not be UTF-8: it hashes as its bytes
    return h.hexdigest()[:16]


@dataclass
class BadRecords:
    """How bad records are handled, and how many were skipped (the first one named)."""

    policy: OnBadRecord
    skipped: int = 0
    first: str = ""
    short: int = 0  # documents under two tokens: always skipped, counted

    def bad(self, where: str, reason: str) -> None:
        if self.policy is OnBadRecord.FAIL:
            raise ConfigError(f"{where}: {reason}; fix the record or pass --on-bad-record skip")
        self.skipped += 1
        self.first = self.first or f"{where}: {reason}"

    def summary(self) -> str:
        parts = []
        if self.skipped:
            parts.append(f"skipped {self.skipped:,} bad records (first: {self.first})")
        if self.short:
            parts.append(f"skipped {self.short:,} documents shorter than two tokens")
        return "; ".join(parts)


def _lines(f: BinaryIO, limit: int) -> Iterator[tuple[bytes | None, int]]:
    """(line, its length in bytes) for each line of `f`; a line longer than `limit` comes as None,
    read past in blocks of at most `limit` bytes, so memory stays near `limit` whatever its length."""
    while raw := f.readline(limit + 1):
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield raw, len(raw)
            continue
        n = len(raw)
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(limit)
            n += len(raw)
        yield None, n


@dataclass
class Reader:
    """Yields (text, bytes read so far in the file) for each document of one file."""

    text_field: str
    records: BadRecords = field(default_factory=lambda: BadRecords(OnBadRecord.FAIL))
    max_document_bytes: int = 8 << 20  # DataConfig.max_document_mb

    def too_large(self, where: str, n_bytes: int) -> bool:
        """Whether a document of `n_bytes` is over the limit (then reported as a bad record)."""
        if n_bytes <= self.max_document_bytes:
            return False
        limit = self.max_document_bytes >> 20
        self.bad(where, f"a document of {n_bytes / (1 << 20):.1f} MB, over data.max_document_mb = {limit} "
                        f"(--max-document-mb): tokenizing takes many times a document's size in memory; split "
                        f"it or raise the limit")
        return True

    def documents(self, path: Path) -> Iterator[tuple[str, int]]:
        if path.stat().st_size == 0:
            self.bad(str(path), "the file is empty")
            return
        if path.suffix in TABLE_SUFFIXES:
            yield from self._parquet(path)
        elif path.suffix in RECORD_SUFFIXES:
            yield from self._records(path)
        else:
            yield from self._text(path)

    def bad(self, where: str, reason: str) -> None:
        self.records.bad(where, reason)

    def _field(self, record: object, where: str) -> str | None:
        if not isinstance(record, dict) or self.text_field not in record:
            self.bad(where, f"no field {self.text_field!r} (pass --text-field NAME)")
            return None
        text = record[self.text_field]
        if not isinstance(text, str):
            self.bad(where, f"field {self.text_field!r} holds {type(text).__name__}, not text")
            return None
        if lone := SURROGATE.search(text):  # JSON's \ud800 escapes decode to what UTF-8 cannot encode
            self.bad(where, f"field {self.text_field!r} holds a lone UTF-16 surrogate (\\u{ord(lone.group()):04x} at "
                            f"character {lone.start()}), which is not text")
            return None
        return None if self._text_too_large(where, text) else text

    def _text_too_large(self, where: str, text: str) -> bool:
        """`too_large` for decoded text (a json array's record, a parquet value): UTF-8 is at most 4
        bytes a character, so only text that might be over the limit is encoded to measure it."""
        return len(text) * 4 > self.max_document_bytes and self.too_large(where, len(text.encode("utf-8")))

    def _records(self, path: Path) -> Iterator[tuple[str, int]]:
        with path.open("rb") as f:
            head = f.read(64).removeprefix(BOM).lstrip()
        if path.suffix == ".json" and head.startswith(b"["):  # one JSON array
            yield from self._array(path)
            return
        done = 0
        with path.open("rb") as f:
            for n, (raw, size) in enumerate(_lines(f, self.max_document_bytes), 1):
                done += size
                where = f"{path}:{n}"
                if raw is None:
                    self.too_large(where, size)
                    continue
                if n == 1:
                    raw = raw.removeprefix(BOM)
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    self.bad(where, f"invalid UTF-8 at byte {e.start}")
                    continue
                except json.JSONDecodeError as e:
                    self.bad(where, f"invalid JSON ({e.msg}, column {e.colno})")
                    continue
                except RecursionError:
                    self.bad(where, "a record nested deeper than the JSON reader follows")
                    continue
                except ValueError as e:  # an integer of more digits than int() converts
                    self.bad(where, f"a record the JSON reader refuses ({str(e).split(';')[0]})")
                    continue
                text = self._field(record, where)
                if text is not None:
                    yield text, done

    def _array(self, path: Path) -> Iterator[tuple[str, int]]:
        """One JSON array of records, decoded a record at a time (json_array.py): memory follows the
        largest record, not the file. JSON may spell a byte as a 6-character escape, so a record is
        read past undecoded only when its text is over 6 x the document limit."""
        limit = 6 * self.max_document_bytes + json_array.BLOCK
        with path.open("rb") as f:
            try:
                for i, (record, done) in enumerate(json_array.records(f, limit)):
                    where = f"{path}: record {i}"
                    if isinstance(record, json_array.Skipped):
                        if record.reason == "over the limit":
                            self.too_large(where, record.chars)
                        else:
                            self.bad(where, record.reason)
                        continue
                    text = self._field(record, where)
                    if text is not None:
                        yield text, done
            except json_array.ArrayError as e:
                raise ConfigError(f"{path}:{e.line}: invalid JSON ({e.msg}); write one record a line (.jsonl) "
                                  f"or one array of records") from None

    def _parquet(self, path: Path) -> Iterator[tuple[str, int]]:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{path}: reading parquet needs pyarrow: pip install 'pipezero[data]'") from None
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a broken file
            raise ConfigError(f"{path}: not a parquet file ({str(e).splitlines()[0]})") from None
        if self.text_field not in pf.schema_arrow.names:
            raise ConfigError(f"{path}: no column {self.text_field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                              f"pass --text-field NAME")
        size, row = path.stat().st_size, 0
        for g in range(pf.num_row_groups):
            column = pf.read_row_group(g, columns=[self.text_field]).column(0)
            for text in column.to_pylist():
                row += 1
                if not isinstance(text, str):
                    self.bad(f"{path}: row {row}", f"column {self.text_field!r} holds {type(text).__name__}, not text")
                    continue
                if self._text_too_large(f"{path}: row {row}", text):
                    continue
                yield text, size * (g + 1) // pf.num_row_groups

    def _text(self, path: Path) -> Iterator[tuple[str, int]]:
        if self.too_large(str(path), path.stat().st_size):  # one document a file: known before it is read
            return
        data = path.read_bytes()
        text = data.removeprefix(BOM)
        if (nul := text.find(b"\0")) >= 0:  # valid UTF-8, but no text holds one: a binary file (an image, an archive)
            line = text[:nul].count(b"\n") + 1
            self.bad(f"{path}:{line}", f"holds a NUL byte (at byte {nul + len(data) - len(text)}): a binary file, not "
                                       f"text (pass text, or tokens as .bin/.npy)")
            return
        try:
            yield text.decode("utf-8"), len(data)
        except UnicodeDecodeError as e:
            line = text[: e.start].count(b"\n") + 1
            self.bad(f"{path}:{line}", "is not UTF-8 text (pass text, or tokens as .bin/.npy)")
