import json

import numpy as np
import pytest
import torch

from pipezero.config import DataConfig
from pipezero.data import (
    BPETokenizer, ByteTokenizer, global_batch, heldout_batches, load_corpus, microbatches_for_rank, unigram_entropy,
)
from pipezero.data.corpus import split_documents

TOKENS = np.arange(10_000, dtype=np.uint16) % 977


@pytest.mark.parametrize("dp,m", [(1, 1), (1, 8), (2, 4), (4, 2), (8, 1)])
def test_global_batch_is_layout_independent(dp, m):
    g, t = 8 * 2, 32
    batch = global_batch(TOKENS, step=5, seed=7, n_seqs=g, seq_len=t)
    rows = [x for d in range(dp) for x, _ in microbatches_for_rank(batch, d, dp, m)]
    assert all(r.shape == (g // (dp * m), t) for r in rows)
    torch.testing.assert_close(torch.cat(rows), batch[0], rtol=0, atol=0)
    x, y = batch
    torch.testing.assert_close(x[:, 1:], y[:, :-1], rtol=0, atol=0)  # targets are inputs shifted by one


def test_batches_resume_at_any_step_and_differ_between_steps():
    a = [global_batch(TOKENS, s, 1, 4, 16)[0] for s in range(6)]
    resumed = global_batch(TOKENS, 4, 1, 4, 16)[0]
    torch.testing.assert_close(resumed, a[4], rtol=0, atol=0)
    assert not torch.equal(a[3], a[4])
    assert not torch.equal(global_batch(TOKENS, 4, 2, 4, 16)[0], a[4])  # the seed matters


def test_microbatches_refuse_uneven_split():
    batch = global_batch(TOKENS, 0, 0, 6, 8)
    with pytest.raises(ValueError, match="does not split"):
        microbatches_for_rank(batch, 0, 4, 1)


def test_heldout_batches_fixed():
    a = heldout_batches(TOKENS, 3, 2, 16)
    b = heldout_batches(TOKENS, 3, 2, 16)
    assert len(a) == 3 and a[0][0].shape == (2, 16)
    for (x1, _), (x2, _) in zip(a, b):
        assert torch.equal(x1, x2)


def test_tokenizers_round_trip():
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    docs = [text * 20, "class A:\n    pass\n" * 30]
    bpe = BPETokenizer.train(docs, 300)
    for tok in (ByteTokenizer(), bpe):
        ids = tok.encode_many([text])[0]
        assert tok.decode(ids) == text
    assert len(bpe.encode_many([text])[0]) < len(text.encode())  # BPE actually merges


def test_split_documents():
    docs = [f"doc {i}\n" for i in range(100)]
    train, held = split_documents(docs, 0.02)
    assert len(held) == 2 and set(train).isdisjoint(held) and len(train) + len(held) == 100
    train, held = split_documents(["line\n" * 100], 0.1)
    assert "".join(train + held) == "line\n" * 100 and held[0].startswith("line")


def test_corpus_from_folder_is_cached_and_split(text_dir):
    cfg = DataConfig(path=str(text_dir), tokenizer="bpe", bpe_vocab=512, seq_len=32)
    c1 = load_corpus(cfg)
    c2 = load_corpus(cfg)
    assert c1.vocab_size == 512 and len(c1.train) > len(c1.heldout) > 0
    train, held = (s.docs for s in c1.samples)
    assert held.n_docs == 1 and train.n_docs == len(list(text_dir.iterdir())) - 1  # fewer files than 1/0.02
    assert np.array_equal(c1.train, c2.train)
    assert 3.0 < unigram_entropy(c1.train) < np.log(512)


def test_token_file(tmp_path):
    path = tmp_path / "toks.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    c = load_corpus(DataConfig(path=str(path), seq_len=16))
    assert len(c.train) + len(c.heldout) == 5000 and c.tokenizer is None and c.vocab_size == 5000


def test_token_file_too_short_for_held_out_windows_is_one_line(tmp_path):
    """1000 tokens pass the length check (2 x (T + 1)), but 2% of them (20) cannot hold one held-out
    window of T = 32: said before training, not an IndexError at the first evaluation."""
    from pipezero.errors import ConfigError

    path = tmp_path / "short.npy"
    np.save(path, np.arange(1000, dtype=np.uint16) % 200)
    with pytest.raises(ConfigError, match="20 held-out tokens.*--heldout-fraction") as e:
        load_corpus(DataConfig(path=[str(path)], seq_len=32))
    assert "\n" not in str(e.value)
    c = load_corpus(DataConfig(path=[str(path)], seq_len=32, heldout_fraction=0.1))
    assert [b[0].shape for b in c.eval_batches(2, 2, 32)] == [(2, 32)] * 2


def open_corpus_counting_builds(rank: int, world: int, cfg: DataConfig, log: str) -> str:
    """One rank of a job an outside torchrun started: every rank opens the same new corpus at once.
    Building the BPE and the token cache is slowed so that the other ranks arrive mid-build."""
    import hashlib
    import time

    import torch.distributed as dist

    from pipezero.data import cache, tokenizer

    def counted(what: str, real):
        def slow(*args, **kwargs):
            with open(log, "a") as f:
                f.write(f"{what} {rank}\n")
            time.sleep(2.0)
            return real(*args, **kwargs)
        return slow

    cache.build = counted("cache", cache.build)
    tokenizer.BPETokenizer.train = counted("bpe", tokenizer.BPETokenizer.train)
    dist.barrier()
    c = load_corpus(cfg)
    return hashlib.sha256(np.ascontiguousarray(c.train).tobytes()).hexdigest() + str(c.vocab_size)


@pytest.mark.distributed
def test_ranks_opening_a_new_corpus_at_once_build_it_once(tmp_path, monkeypatch):
    from ranks import run_ranks

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum " * (i % 13)}) + "\n"
                            for i in range(300)))
    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "cache"))
    log = tmp_path / "builds.log"
    cfg = DataConfig(path=[str(docs)], tokenizer="bpe", bpe_vocab=300, seq_len=16, heldout_fraction=0.1)
    results = run_ranks(open_corpus_counting_builds, 3, cfg, str(log), timeout=120)
    builds = sorted(line.split()[0] for line in log.read_text().splitlines())
    assert builds == ["bpe", "cache"], log.read_text()  # one tokenizer and one cache for three ranks
    assert len(set(results)) == 1  # every rank reads the same tokens
    assert not list((tmp_path / "cache").glob(".*.lock"))  # the builders took their lock files away


@pytest.mark.parametrize("damage", ["half, as a valid .npy", "same size, other ids"])
def test_a_damaged_builtin_corpus_cache_entry_is_rebuilt_not_read(tmp_path, monkeypatch, capsys, damage):
    """The built-in corpus's cache entry carries its files' sizes and checksums (as the document
    caches' do): a token file cut to half with a header that says so (numpy maps it without a word),
    or ids changed in place, is rebuilt instead of training on what is left."""
    from pipezero.data.cache_folder import cache_dir

    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "cache"))
    cfg = DataConfig(tokenizer="bytes", max_bytes=100_000, seq_len=32)
    first = load_corpus(cfg)
    train, held = np.asarray(first.train).copy(), np.asarray(first.heldout).copy()
    [path] = [p for p in cache_dir().rglob("*.npy") if "train" in p.name]
    if damage.startswith("half"):
        np.save(path, train[:len(train) // 2])
    else:
        ids = np.load(path, mmap_mode="r+")
        ids[len(ids) // 2:len(ids) // 2 + 100] = 7
        ids.flush()
        del ids
    capsys.readouterr()
    again = load_corpus(cfg)
    assert np.array_equal(again.train, train) and np.array_equal(again.heldout, held)
    assert "is damaged" in capsys.readouterr().err


@pytest.mark.parametrize("make, needle", [
    (lambda d: (d / "loop").symlink_to("loop"), "is a symlink loop"),
    (lambda d: ((d / "a").symlink_to("b"), (d / "b").symlink_to("a")), "is a symlink loop"),
    (lambda d: (d / "loop").symlink_to("gone.txt"), "is a broken symlink (to gone.txt)"),
])
def test_data_that_is_a_link_going_nowhere_is_named_as_such(make, needle, tmp_path, monkeypatch, capsys):
    """A link that loops or leads nowhere is said to be one, not 'matches no files (.c, .csv, ...)'
    (glob takes a name it can list for a match, whatever the link leads to)."""
    from one_line import assert_one_line, run_main

    monkeypatch.chdir(tmp_path)
    make(tmp_path)
    name = "loop" if (tmp_path / "loop").is_symlink() else "a"
    assert_one_line(*run_main(["train", "--data", name, "--max-steps", "1", "--out", "o"], capsys),
                    f"--data {name!r} {needle}")


def test_data_that_cannot_be_read_is_named_as_such(tmp_path, monkeypatch):
    """A path whose folder the user may not search: its stat fails with EACCES (run as root here, so
    the refusal is simulated), said as such rather than a traceback or 'does not exist'."""
    import errno
    from pathlib import Path

    from pipezero.errors import ConfigError
    from pipezero.settings import build_config

    locked = tmp_path / "locked" / "docs.txt"
    real_stat = Path.stat

    def stat(self, *args, **kwargs):
        if self == locked:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    with pytest.raises(ConfigError, match=r"cannot be read \(Permission denied\)") as e:
        build_config(None, {"data.path": [str(locked)]})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("unk,vocab", [("[UNK]", {"hello": 0, "a": 1}), ("<nope>", {"hello": 0})])
def test_a_tokenizer_whose_unknown_token_is_not_in_its_vocabulary_is_one_line(unk, vocab, tmp_path, capsys):
    """`tokenizers` loads it, then raises a bare Exception at the first text it cannot match (a
    traceback from the vocabulary probe): named with its file as it is read."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from one_line import assert_one_line, run_main
    from tiny_runs import TRAIN_TINY, write_docs

    HFTokenizer(models.WordLevel(vocab, unk_token=unk)).save(str(tmp_path / "tok.json"))
    code, err = run_main([*TRAIN_TINY, "--data", str(write_docs(tmp_path)), "--tokenizer", str(tmp_path / "tok.json"),
                          "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, f"tokenizer file '{tmp_path / 'tok.json'}' names the unknown token {unk!r}, which is "
                               f"not in its vocabulary")


@pytest.mark.parametrize("text,needle", [
    ('{"a": 1}', "(it is valid JSON, but has no 'model' key, which every tokenizer.json holds)"),
    ("[1, 2]", "(it is valid JSON, but a list, where a tokenizer is an object)"),
    ('{"a": ', "at line 1 column"),  # not JSON: the position is the fix
])
def test_a_json_file_that_is_no_tokenizer_is_named_as_such(text, needle, tmp_path):
    """`tokenizers` answers a valid JSON file that is no tokenizer with a parse position ("missing
    field `model` at line 1 column 8"), sending the user to look for a syntax error."""
    from pipezero.data.tokenizer import BPETokenizer
    from pipezero.errors import ConfigError

    (tmp_path / "t.json").write_text(text)
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json") as e:
        BPETokenizer.from_file(tmp_path / "t.json")
    assert needle in str(e.value)
    if "valid JSON" in needle:
        assert "column" not in str(e.value)
