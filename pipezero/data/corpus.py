"""Find the training text, tokenize it once, and cache the token arrays.

The user's documents (`--data` files, folders, globs) stream through data/sources.py into the
token cache of data/cache.py and are read as packed samples (data/packing.py). The default corpus is the Python standard library of the running interpreter (found through
`sysconfig`), read in sorted path order, so every machine with the same Python has the same corpus
with nothing downloaded. The last `heldout_fraction` of its bytes (cut at a line end) is held out.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import sys
import sysconfig
from dataclasses import dataclass
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from pipezero.config import DataConfig, Packing
from pipezero.errors import ConfigError
from pipezero.data.batches import global_batch, heldout_batches, microbatches_for_rank
from pipezero.data.cache import SPLITS, build_arrays, discard, load_or_build, problem
from pipezero.data.packing import PackedSamples, Rows, check_enough, fit_length
from pipezero.data.sources import RECORD_SUFFIXES, TABLE_SUFFIXES, BadRecords, Reader, expand, fingerprint
from pipezero.data.tokenizer import Tokenizer, cached_tokenizer, id_bound, load_tokenizer, texts_digest
from pipezero.data.cache_folder import build_once, cache_dir

TOKEN_SUFFIXES = {".bin", ".npy"}
CACHE_VERSION = 5  # bump when the token cache's layout or contents change (2: no EOS doubled by a post-processor,
# 3: a UTF-8 byte order mark is no longer read as part of a file's first record, 4: meta.json records sizes,
# digests and its checksum, 5: the built-in corpus's entry is a sealed folder too)


@dataclass
class Corpus:
    train: np.ndarray  # 1-D token ids
    heldout: np.ndarray
    tokenizer: Tokenizer | None  # None for a token file without a tokenizer.json
    source: str
    # Documents: packed samples. None: random windows over one token stream (built-in corpus, token files).
    samples: tuple[PackedSamples, PackedSamples] | None = None  # (train, held-out)

    @functools.cached_property
    def record(self) -> dict:
        """What a checkpoint records of this corpus, for a resume and an export to check (data/identity.py)."""
        from pipezero.data.identity import data_record

        return data_record(self)

    @property
    def vocab_size(self) -> int:
        """Rows the model's embedding needs: every id a row can hold (EOS and padding included)."""
        if self.tokenizer is not None:
            return id_bound(self.tokenizer)
        return int(max(self.train.max(initial=0), self.heldout.max(initial=0))) + 1

    def batch(self, step: int, position: int, seed: int, n_rows: int, seq_len: int) -> Rows:
        """The global batch of optimizer step `step`, whose samples start at `position` (the number
        of samples read before it): random windows drawn from (seed, step), or packed samples."""
        if self.samples is None:
            return global_batch(self.train, step, seed, n_rows, seq_len)
        return self.samples[0].global_batch(position, seed, n_rows)

    def microbatches(self, batch: Rows, dp_rank: int, dp: int, m: int) -> list[Rows]:
        """Data-parallel rank `dp_rank`'s M micro-batches of `batch`; whole documents (`none`
        packing) each cut to its own length."""
        mbs = microbatches_for_rank(batch, dp_rank, dp, m)
        if self.samples is not None and self.samples[0].packing is Packing.NONE:
            return [fit_length(mb) for mb in mbs]
        return mbs

    def eval_batches(self, n_batches: int, batch_size: int, seq_len: int) -> list[Rows]:
        if self.samples is None:
            return heldout_batches(self.heldout, n_batches, batch_size, seq_len)
        return self.samples[1].heldout(n_batches, batch_size)

    def check_batch(self, n_rows: int) -> None:
        """Refuse a corpus that cannot fill one global batch without repeating a sample."""
        if self.samples is not None:
            check_enough(self.samples[0], n_rows, f"--data {self.source!r}")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def write_stdlib_sample(root: Path, chars: int = 400_000) -> Path:
    """A small folder of documents: the standard library's first files, about `chars` characters,
    one .py file each (tests and benches that need documents without downloading any)."""
    root.mkdir(parents=True, exist_ok=True)
    total = 0
    for i, f in enumerate(stdlib_files()):
        text = f.read_text(encoding="utf-8", errors="replace")
        (root / f"{i:04d}.py").write_text(text)
        total += len(text)
        if total > chars:
            break
    return root


def read_documents(files: list[Path], max_bytes: int | None) -> list[str]:
    docs: list[str] = []
    total = 0
    for f in files:
        text = f.read_bytes().decode("utf-8", errors="replace")
        if max_bytes is not None and total + len(text) > max_bytes:
            docs.append(text[: max_bytes - total])
            break
        docs.append(text)
        total += len(text)
    return [d for d in docs if d]


def every_kth(heldout_fraction: float) -> int:
    """k: every k-th document is held out. A fraction of 1e-320 made 1 / x inf (an OverflowError
    traceback): k is capped, holding out none, which the size checks then name."""
    return max(2, round(min(1.0 / heldout_fraction, 2.0**62)))


def split_documents(docs: list[str], heldout_fraction: float) -> tuple[list[str], list[str]]:
    """Hold out every k-th document (k = 1 / fraction), so the held-out text is drawn from the whole
    corpus rather than whatever sorts last. With fewer than k documents, hold out the tail of the
    text instead, cut at a line end."""
    k = every_kth(heldout_fraction)
    if len(docs) >= k:
        return [d for i, d in enumerate(docs) if i % k != k - 1], [d for i, d in enumerate(docs) if i % k == k - 1]
    text = "".join(docs)
    cut = int(len(text) * (1.0 - heldout_fraction))
    at = text.rfind("\n", 0, cut) + 1 or cut
    return [text[:at]], [text[at:]]


def _encode(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
    ids = tok.encode_many(docs)
    return np.fromiter((t for doc in ids for t in doc), dtype=dtype, count=sum(len(d) for d in ids))


def read_tokens(path: Path) -> np.ndarray:
    """The ids of a token file, memory-mapped: a `.npy` of unsigned or signed integers (never
    unpickled: a file cannot run code), or a raw `.bin` of uint16 (uint32 when the name says u32)."""
    name = str(path)
    try:
        if path.suffix == ".npy":
            return np.load(path, mmap_mode="r", allow_pickle=False)
        dtype = np.dtype(np.uint32 if "u32" in path.name else np.uint16)
        size = path.stat().st_size
        if size == 0:
            raise ConfigError(f"token file {name!r} is empty: write its ids, or leave it out of --data")
        if size % dtype.itemsize:
            raise ConfigError(f"token file {name!r} holds {size} bytes, not a whole number of {dtype.name} ids "
                              f"({dtype.itemsize} bytes each; name it *u32*.bin for uint32)")
        return np.memmap(path, dtype=dtype, mode="r")
    except ConfigError:
        raise
    except (ValueError, OSError) as e:  # object arrays, a broken header, an unreadable file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"token file {name!r} cannot be read as token ids ({reason}); write it with "
                          f"numpy.save of an integer array") from None


def load_token_file(path: Path, cfg: DataConfig) -> Corpus:
    tokens = read_tokens(path)
    name = str(path)
    if tokens.dtype.kind not in "iu":
        raise ConfigError(f"token file {name!r} holds {tokens.dtype} values; token ids must be integers")
    if tokens.ndim != 1 or len(tokens) < 2 * (cfg.seq_len + 1):
        raise ConfigError(f"token file {name!r} must be 1-D with at least {2 * (cfg.seq_len + 1)} tokens")
    if tokens.min() < 0:
        raise ConfigError(f"token file {name!r} holds negative ids (smallest {int(tokens.min())}); ids must be >= 0")
    tok = load_tokenizer(cfg.tokenizer, [], cfg.bpe_vocab) if cfg.tokenizer.endswith(".json") else None
    if tok is not None and int(tokens.max()) >= tok.vocab_size:
        raise ConfigError(f"token file {name!r} holds id {int(tokens.max())}, but the tokenizer "
                          f"{cfg.tokenizer!r} has only {tok.vocab_size} tokens: tokenize with that tokenizer")
    cut = int(len(tokens) * (1.0 - cfg.heldout_fraction))
    need = cfg.seq_len + 2  # one window and its next-token targets, each split (batches.heldout_batches)
    if min(cut, len(tokens) - cut) < need:
        raise ConfigError(f"token file {name!r} gives {cut} train and {len(tokens) - cut} held-out tokens "
                          f"(--heldout-fraction {cfg.heldout_fraction}); each needs at least {need} for --seq-len "
                          f"{cfg.seq_len}: give more tokens, a shorter --seq-len or a larger --heldout-fraction")
    return Corpus(np.asarray(tokens[:cut]), np.asarray(tokens[cut:]), tok, name)


def load_documents(cfg: DataConfig) -> Corpus:
    """The user's documents, tokenized into the cache on first use, as packed samples."""
    assert cfg.path is not None
    files = expand(cfg.path)
    if cfg.text_field != DataConfig.text_field and not any(f.suffix in RECORD_SUFFIXES | TABLE_SUFFIXES for f in files):
        raise ConfigError(f"--text-field {cfg.text_field!r} names a field of .jsonl/.json/.parquet records, but --data "
                          f"holds none (text files are read whole): drop it")  # it was ignored, exit 0
    every = every_kth(cfg.heldout_fraction)
    inputs = fingerprint(files, cfg.text_field, cfg.on_bad_record.value, cfg.max_document_mb)

    def reader() -> Reader:
        return Reader(cfg.text_field, BadRecords(cfg.on_bad_record), cfg.max_document_mb << 20)

    def sample() -> Iterable[str]:  # every 4th document trains a BPE, streamed
        r = reader()
        docs = itertools.chain.from_iterable(r.documents(f) for f in files)
        return (text for text, _ in itertools.islice(docs, 0, None, 4))

    tok = cached_tokenizer(cfg.tokenizer, cfg.bpe_vocab, inputs, sample, eos=True)
    key = hashlib.sha256(f"{CACHE_VERSION}\0{inputs}\0{tok.name}\0{every}".encode()).hexdigest()[:24]
    train, heldout = load_or_build(key, files, reader(), tok, every)
    packing = cfg.packing or Packing.DOC_MASKED
    pad = tok.pad_id if tok.pad_id is not None else tok.eos_id or 0  # `none` packing's filler, never a target
    samples = tuple(PackedSamples(d, cfg.seq_len, packing, pad) for d in (train, heldout))
    source = " ".join(cfg.path)
    for s, what in zip(samples, ("training documents", "held-out documents")):
        check_enough(s, 1, f"--data {source!r}: the {what}")
    return Corpus(train.tokens, heldout.tokens, tok, source, samples)  # type: ignore[arg-type]


def load_corpus(cfg: DataConfig) -> Corpus:
    """Tokenized train and held-out data for `cfg`, from the cache when this text was seen before."""
    paths = cfg.path or []
    if any(Path(p).suffix in TOKEN_SUFFIXES for p in paths):
        if len(paths) > 1:
            raise ConfigError(f"--data {' '.join(paths)}: a token file is a corpus by itself; pass it alone")
        corpus = load_token_file(Path(paths[0]), cfg)
    elif paths:
        return load_documents(cfg)
    else:
        corpus = load_stdlib(cfg)
    if cfg.packing is not None:
        raise ConfigError(f"--packing {cfg.packing.value} needs documents (--data .jsonl/.parquet/.txt ...); "
                          f"{corpus.source!r} is one token stream read in random windows")
    return corpus


def load_stdlib(cfg: DataConfig) -> Corpus:
    """The standard library's source, split by files and tokenized, cached by its content."""
    files = stdlib_files()
    source = "python-stdlib"
    docs = read_documents(files, cfg.max_bytes)
    train_docs, held_docs = split_documents(docs, cfg.heldout_fraction)
    tok = load_tokenizer(cfg.tokenizer, train_docs, cfg.bpe_vocab)
    key = f"tokens-v{CACHE_VERSION}-{texts_digest(train_docs)}-{texts_digest(held_docs)}-{tok.name}"
    folder = cache_dir() / key

    def make() -> None:
        if folder.exists():
            print(f"pipezero: warning: the token cache entry {folder} is damaged ({problem(folder)}); rebuilding it",
                  file=sys.stderr, flush=True)
            discard(folder)
        build_arrays(folder, {s: _encode(tok, docs) for s, docs in zip(SPLITS, (train_docs, held_docs))},
                     {"tokenizer": tok.name})

    build_once(key, lambda: problem(folder) is None, make)
    train, heldout = (np.load(folder / f"{s}.npy", mmap_mode="r", allow_pickle=False) for s in SPLITS)
    need = cfg.seq_len + 2
    if len(train) < need or len(heldout) < need:
        raise ConfigError(
            f"corpus {source!r} gives {len(train)} train and {len(heldout)} held-out tokens; each needs at least "
            f"{need} for --seq-len {cfg.seq_len}: give more text or a shorter --seq-len"
        )
    return Corpus(np.asarray(train), np.asarray(heldout), tok, source)
