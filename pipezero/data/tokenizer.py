"""Tokenizers: raw UTF-8 bytes, a byte-level BPE trained locally with Hugging Face `tokenizers`, or
a model's own tokenizer.json.

The BPE is trained once on the training documents and cached by a hash of those documents and
the vocabulary size, so every rank and every later run loads the identical vocabulary.

A model's own tokenizer.json is used as it is, post-processor included: that is where a Llama
folder's BOS lives, and it is what transformers 5 follows too (with a tokenizer.json present,
`AutoTokenizer` drops tokenizer_config.json's add_bos_token / add_eos_token and keeps the file's
post-processor). Its config.json says EOS (put between documents) and, with
generation_config.json and tokenizer_config.json, the padding id (models/hf.py). One difference
remains possible: for a tokenizer class of its own (LlamaTokenizer, Qwen2Tokenizer), transformers 5
rebuilds the normalizer and pre-tokenizer from that class's code and takes only the vocabulary,
merges and post-processor from tokenizer.json; the two agree whenever the class saved the file.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pipezero.errors import ConfigError
from pipezero.data.cache_folder import build_once, cache_dir
from pipezero.files import atomic_write_bytes


EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>")  # what tokenizers commonly call end-of-document


class Tokenizer(Protocol):
    vocab_size: int
    name: str
    eos_id: int | None  # the id packed between documents; None: documents are packed back to back
    pad_id: int | None  # the id filling a row past its document (never attended to, never a target); None: EOS's

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """One token a UTF-8 byte: vocabulary 256, nothing to train."""

    vocab_size = 256
    name = "bytes"
    eos_id = 0  # NUL: never inside a document (sources refuse text that is not UTF-8 text)
    pad_id = None

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A Hugging Face byte-level BPE: never produces unknown tokens, decodes back to the exact text."""

    def __init__(self, hf: HFTokenizer, eos_id: int | None = None, pad_id: int | None = None) -> None:
        # A tokenizer.json can carry truncation and padding (whoever saved it had called
        # enable_truncation / enable_padding); encode_batch would then cut every document at
        # max_length and pad it to the batch's longest. transformers switches both off for a call
        # that asks for neither, and documents are tokenized whole here too.
        hf.no_truncation()
        hf.no_padding()
        self.hf = hf
        self.file: Path | None = None  # the tokenizer.json it was read from (from_file)
        # Named by its content (the post-processor that adds BOS included), so cached token arrays
        # follow the vocabulary, not a file name: two different tokenizer.json files called alike
        # never share a cache entry.
        self.name = f"bpe-{hashlib.sha256(hf.to_str().encode()).hexdigest()[:16]}"
        self.vocab_size = largest_id(hf)[0] + 1  # ids need not be contiguous: the rows they need
        self.eos_id = next((i for t in EOS_TOKENS if (i := hf.token_to_id(t)) is not None), None)
        if eos_id is not None:  # a model's own end-of-sequence id (its config.json) wins over a guess
            self.name += f"-eos{eos_id}"
            self.eos_id = eos_id
        self.pad_id = pad_id
        if pad_id is not None:
            self.name += f"-pad{pad_id}"
        # A post-processor that ends every text with EOS itself (add_eos_token style): the token
        # cache puts one EOS after each document, so the text's own is dropped, not doubled.
        probe, plain = hf.encode("a"), hf.encode("a", add_special_tokens=False)
        self._post_eos = (self.eos_id is not None and len(probe.ids) > len(plain.ids)
                          and probe.ids[-1] == self.eos_id)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids as the tokenizer's own pipeline gives them (BOS first where its
        post-processor adds one), without a trailing EOS."""
        ids = [e.ids for e in self.hf.encode_batch(list(texts))]
        return [d[:-1] for d in ids] if self._post_eos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode([int(i) for i in ids])

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, eos: bool = False) -> "BPETokenizer":
        """Train on `texts` (any iterable: documents stream through); with `eos`, the vocabulary
        holds an end-of-document token for packing."""
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=[EOS_TOKENS[0]] if eos else [],
            show_progress=False,
        )
        hf.train_from_iterator(texts, trainer)
        return cls(hf)

    @classmethod
    def from_file(cls, path: str | Path) -> "BPETokenizer":
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - `tokenizers` raises a bare Exception for any bad file
            reason = not_a_tokenizer(Path(path)) or (str(e).splitlines()[0] if str(e) else type(e).__name__)
            raise ConfigError(f"tokenizer file {str(path)!r} is not a Hugging Face tokenizer.json ({reason}); "
                              f"pass a tokenizer saved by `tokenizers`, or --tokenizer bpe / bytes") from None
        check_unknown_token(hf, path)
        if not hf.encode("a", add_special_tokens=False).ids:  # every text would encode to nothing, and the
            # corpus be blamed for holding no tokens
            raise ConfigError(f"tokenizer file {str(path)!r} encodes text to no tokens (its vocabulary holds "
                              f"{hf.get_vocab_size(with_added_tokens=False)}); pass a tokenizer saved by `tokenizers`, "
                              f"or --tokenizer bpe / bytes")
        tok = cls(hf, *model_ids(Path(path).parent, hf))
        tok.file = Path(path).absolute()  # what a checkpoint records, and an export copies
        return tok


def not_a_tokenizer(path: Path) -> str | None:
    """Why a file `tokenizers` refused is valid JSON yet no tokenizer (its error then gives a parse
    position, "missing field `model` at line 1 column 8", in a file that parses); None when it is
    not valid JSON (the position is then the fix)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return f"it is valid JSON, but a {type(data).__name__}, where a tokenizer is an object"
    if "model" not in data:
        return "it is valid JSON, but has no 'model' key, which every tokenizer.json holds"
    return None


def check_unknown_token(hf: HFTokenizer, path: str | Path) -> None:
    """Refuse a tokenizer whose model names an unknown token its vocabulary lacks: `tokenizers`
    loads it, then raises a bare Exception at the first text it cannot match (our probe of "a", or
    any document later), far from the file."""
    unk = json.loads(hf.to_str()).get("model", {}).get("unk_token")
    if isinstance(unk, str) and hf.token_to_id(unk) is None:
        raise ConfigError(f"tokenizer file {str(path)!r} names the unknown token {unk!r}, which is not in its "
                          f"vocabulary, so encoding fails at the first text it cannot match: add {unk!r} to the "
                          f"vocabulary (or set its model's unk_token to null), or use --tokenizer bpe / bytes")


def largest_id(hf: HFTokenizer) -> tuple[int, str]:
    """(the largest id `hf` can put into a row, its token), from the vocabulary, the added tokens and
    what the post-processor inserts (a BOS may be named there by id alone). Not the token count:
    ids need not be contiguous, and an edited or merged tokenizer.json can hold id 1000 among 300
    tokens, which every rank's embedding lookup would fail on mid-run."""
    found = max(((i, t) for t, i in hf.get_vocab(with_added_tokens=True).items()), default=(-1, ""))
    probe = hf.encode("a")  # truncation and padding are off (BPETokenizer): only the post-processor adds
    return max([found, *zip(probe.ids, probe.tokens)])


def id_bound(tok: Tokenizer) -> int:
    """One past the largest id `tok` puts into a row: its vocabulary, or an EOS or padding id that a
    model's config.json names beyond it (a padded embedding). The token cache's dtype and the model's
    embedding rows must hold these ids too, not only the tokenizer's own."""
    extra = [i for i in (tok.eos_id, tok.pad_id) if i is not None]
    return max([tok.vocab_size, *(i + 1 for i in extra)])


def model_ids(folder: Path, hf: HFTokenizer) -> tuple[int | None, int | None]:
    """(EOS, pad) of the Hugging Face model whose folder holds a tokenizer.json, as its config
    files say (BOS comes from the tokenizer's own post-processor); (None, None) beside no model's
    config.json. An EOS or padding id outside the model's vocabulary is a ConfigError naming the file."""
    if not (folder / "config.json").is_file():
        return None, None
    from pipezero.models.hf import eos_id, pad_id, read_json

    try:
        read_json(folder / "config.json")
    except ConfigError:  # a config.json that is not a model's: the tokenizer stands alone
        return None, None
    return eos_id(folder, hf.token_to_id), pad_id(folder, hf.token_to_id)


def texts_digest(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(hashlib.sha256(t.encode("utf-8", errors="replace")).digest())
    return h.hexdigest()[:16]


def load_tokenizer(kind: str, train_texts: Sequence[str], bpe_vocab: int) -> Tokenizer:
    """`bytes`, `bpe` (trained on every 4th training document, cached), or a tokenizer.json path."""
    if kind != "bpe":
        return cached_tokenizer(kind, bpe_vocab, "", list)
    sample = list(train_texts[::4]) or list(train_texts)
    return cached_tokenizer(kind, bpe_vocab, texts_digest(sample), lambda: sample)


def cached_tokenizer(kind: str, bpe_vocab: int, key: str, texts: Callable[[], Iterable[str]],
                     eos: bool = False) -> Tokenizer:
    """`bytes`, a tokenizer.json path, or the BPE cached under `key` (what it was trained on),
    trained on `texts()` the first time; with `eos` it has an end-of-document token."""
    if kind == "bytes":
        return ByteTokenizer()
    if kind != "bpe":
        return BPETokenizer.from_file(kind)
    path = cache_dir() / f"bpe-{bpe_vocab}{'-eos' if eos else ''}-{key}.json"
    mark = path.with_name(path.name + ".sha256")  # the digest of what was built: a file swapped in is not it

    def train() -> None:
        if path.exists():  # the user never gave this file, so it is not theirs to fix
            print(f"pipezero: warning: the cached tokenizer {path} is damaged ({_not_built(path, mark)}); "
                  f"rebuilding it", file=sys.stderr, flush=True)
        text = BPETokenizer.train(texts(), bpe_vocab, eos).hf.to_str().encode()
        atomic_write_bytes(path, text)
        atomic_write_bytes(mark, f"{hashlib.sha256(text).hexdigest()}\n".encode())

    build_once(path.name, lambda: _not_built(path, mark) is None, train)
    return BPETokenizer.from_file(path)


def _not_built(path: Path, mark: Path) -> str | None:
    """Why the cached tokenizer `path` is not the one pipezero built there (its digest in `mark`):
    unreadable, or another valid tokenizer put in its place (it was used silently, tokenizing every
    document differently); None when it is."""
    if (why := _unreadable(path)) is not None:
        return why
    try:
        want = mark.read_text().strip()
        have = hashlib.sha256(path.read_bytes()).hexdigest()
    except (OSError, UnicodeDecodeError):
        return "its checksum file is missing or unreadable"
    return None if have == want else "its content is not what pipezero built there (checksum mismatch)"


def _unreadable(path: Path) -> str | None:
    """Why `path` is not a tokenizer.json `tokenizers` loads; None when it is."""
    if not path.is_file():
        return "missing"
    try:
        HFTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - `tokenizers` raises a bare Exception for any bad file
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None
