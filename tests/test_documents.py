"""Documents from jsonl, json, parquet and text files: the token cache, bad records, packing, order."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipezero.config import DataConfig, OnBadRecord, Packing
from pipezero.errors import ConfigError
from pipezero.data import load_corpus
from pipezero.data.packing import IGNORE

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def doc(i: int) -> str:
    rng = np.random.default_rng(i)
    return " ".join(rng.choice(WORDS, size=int(rng.integers(5, 60))))


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """A folder of every document kind: jsonl, a json array, parquet (two row groups), txt and md."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    write_jsonl(root / "a.jsonl", [doc(i) for i in range(40)])
    (root / "b.json").write_text(json.dumps([{"text": doc(100 + i)} for i in range(10)]))
    pq.write_table(pa.table({"text": [doc(200 + i) for i in range(30)]}), root / "sub" / "c.parquet", row_group_size=16)
    (root / "sub" / "d.txt").write_text(doc(300))
    (root / "e.md").write_text("# title\n\n" + doc(301))
    return root


def cfg_of(paths: list[Path] | Path, **kw) -> DataConfig:
    paths = paths if isinstance(paths, list) else [paths]
    return DataConfig(path=[str(p) for p in paths], tokenizer="bytes", seq_len=32, heldout_fraction=0.1, **kw)


def test_every_kind_is_read_once_into_a_cache(corpus_dir: Path, monkeypatch):
    c = load_corpus(cfg_of(corpus_dir))
    train, held = (s.docs for s in c.samples)
    assert train.n_docs + held.n_docs == 82 and held.n_docs == 8  # every 10th document held out
    assert c.train.dtype == np.uint16 and isinstance(c.train, np.memmap)
    text = bytes(np.asarray(c.train[train.offsets[0]:train.offsets[1] - 1]).astype(np.uint8)).decode()
    assert text == doc(0) and c.train[train.offsets[1] - 1] == 0  # a document, then EOS
    # read again: from the cache, nothing tokenized
    import pipezero.data.cache as cache

    monkeypatch.setattr(cache, "build", lambda *a, **k: pytest.fail("rebuilt a cached corpus"))
    again = load_corpus(cfg_of(corpus_dir))
    assert np.array_equal(again.train, c.train)
    # a changed input file is a different corpus
    monkeypatch.undo()
    write_jsonl(corpus_dir / "a.jsonl", [doc(i) for i in range(41)])
    assert sum(s.docs.n_docs for s in load_corpus(cfg_of(corpus_dir)).samples) == 83


def test_globs_fields_and_bpe(tmp_path: Path):
    write_jsonl(tmp_path / "x1.jsonl", [doc(i) for i in range(30)], field="body")
    write_jsonl(tmp_path / "x2.jsonl", [doc(50 + i) for i in range(30)], field="body")
    cfg = cfg_of([], text_field="body")
    cfg.path, cfg.tokenizer, cfg.bpe_vocab = [str(tmp_path / "x*.jsonl")], "bpe", 300
    c = load_corpus(cfg)
    assert c.tokenizer.eos_id is not None and c.vocab_size == 300
    ends = c.samples[0].docs.offsets[1:] - 1
    assert (np.asarray(c.train)[ends] == c.tokenizer.eos_id).all()
    assert c.tokenizer.decode(c.train[: c.samples[0].docs.offsets[1] - 1]) == doc(0)


BAD = [
    ("bad.jsonl", b'{"text": "fine"}\n{"text": oops}\n', "bad.jsonl:2: invalid JSON"),
    ("bad.jsonl", b'{"text": "fine"}\n{"body": "x"}\n', "bad.jsonl:2: no field 'text' (pass --text-field NAME)"),
    ("bad.jsonl", b'{"text": "fine"}\n{"text": 5}\n', "bad.jsonl:2: field 'text' holds int"),
    ("bad.jsonl", b'{"text": "fine"}\n\n{"text": "\xff\xfe"}\n', "bad.jsonl:3: invalid UTF-8"),
    ("bad.txt", b"line one\nline \xff two\n", "bad.txt:2: is not UTF-8 text"),
    ("bin.txt", b"line one\nPNG\x00\x00\x01 header\n", "bin.txt:2: holds a NUL byte (at byte 12): a binary file, not text"),
    ("empty.jsonl", b"", "empty.jsonl: the file is empty"),
]


@pytest.mark.parametrize("name,data,needle", BAD, ids=[b[2][:24] for b in BAD])
def test_bad_records_name_file_and_line_or_are_counted(name, data, needle, tmp_path, capsys):
    write_jsonl(tmp_path / "good.jsonl", [doc(i) for i in range(30)])
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ConfigError, match="--on-bad-record skip") as e:
        load_corpus(cfg_of(tmp_path))
    assert needle in str(e.value) and "\n" not in str(e.value)
    c = load_corpus(cfg_of(tmp_path, on_bad_record=OnBadRecord.SKIP))
    assert "skipped 1 bad records" in capsys.readouterr().out and c.samples[0].docs.n_docs > 20


def test_empty_inputs_short_documents_and_small_corpora(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no document files"):
        load_corpus(cfg_of(tmp_path / "empty"))
    write_jsonl(tmp_path / "tiny.jsonl", ["a", "b", "hello there", "x y z", "some words"])
    with pytest.raises(ConfigError, match="needs 1"):  # too few tokens for held-out samples
        load_corpus(cfg_of(tmp_path / "tiny.jsonl"))
    assert "skipped 2 documents shorter than two tokens" in capsys.readouterr().out
    c = load_corpus(cfg_of(write_jsonl(tmp_path / "more.jsonl", [doc(i) for i in range(12)])))
    with pytest.raises(ConfigError, match="needs 1000"):
        c.check_batch(1000)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": [doc(1)]}), tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match="no column 'text'.*--text-field"):
        load_corpus(cfg_of(tmp_path / "t.parquet"))


def test_interrupted_build_leaves_nothing_read(corpus_dir, monkeypatch):
    from pipezero.data import tokenizer
    from pipezero.data.cache_folder import cache_dir

    calls = []

    def dying(self, texts):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return [list(t.encode()) for t in texts]

    monkeypatch.setattr("pipezero.data.cache.BATCH_DOCS", 8)
    monkeypatch.setattr(tokenizer.ByteTokenizer, "encode_many", dying)
    cfg = cfg_of(corpus_dir)
    cfg.heldout_fraction = 0.125  # a key of its own
    before = set(cache_dir().iterdir())
    with pytest.raises(KeyboardInterrupt):
        load_corpus(cfg)
    assert set(cache_dir().iterdir()) == before  # neither a cache nor a temporary folder is left
    monkeypatch.undo()
    assert load_corpus(cfg).samples[0].docs.n_docs > 0


def packed(docs: list[list[int]], seq_len: int, packing: Packing):
    from pipezero.data.cache import DocTokens
    from pipezero.data.packing import PackedSamples

    flat = np.array([t for d in docs for t in [*d, 0]], dtype=np.uint16)
    offsets = np.cumsum([0, *[len(d) + 1 for d in docs]])
    return PackedSamples(DocTokens(flat, offsets), seq_len, packing)


def test_packing_masks_targets_at_document_ends():
    docs = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16]]
    x, y, d = packed(docs, 8, Packing.DOC_MASKED).rows(np.array([0]))
    assert x.tolist() == [[5, 6, 7, 0, 8, 9, 0, 10]]
    assert y.tolist() == [[6, 7, 0, IGNORE, 9, 0, IGNORE, 11]]
    assert d.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    x, y = packed(docs, 8, Packing.CONCAT).rows(np.array([0]))
    assert y.tolist() == [[6, 7, 0, 8, 9, 0, 10, 11]]
    x, y = packed(docs, 4, Packing.NONE).rows(np.array([1, 2]))
    assert x.tolist() == [[8, 9, 0, 0], [10, 11, 12, 13]] and y.tolist() == [[9, 0, IGNORE, IGNORE], [11, 12, 13, 14]]


def test_order_is_seeded_covers_each_epoch_and_resumes():
    s = packed([list(range(1, 40))] * 10, 8, Packing.CONCAT)
    n = len(s)
    first = s.order(seed=3, start=0, n=n)
    assert sorted(first.tolist()) == list(range(n))  # an epoch reads every sample once
    assert not np.array_equal(first, s.order(seed=4, start=0, n=n))
    steps = [s.global_batch(4 * k, 3, 4)[0] for k in range(6)]  # global batch 4: positions 0, 4, 8, ...
    fresh = packed([list(range(1, 40))] * 10, 8, Packing.CONCAT)  # a resumed run: nothing remembered
    assert torch.equal(fresh.global_batch(20, 3, 4)[0], steps[5])
    from pipezero.data import microbatches_for_rank

    index = torch.from_numpy(s.order(3, 0, 4))[:, None]  # the samples of step 0, as a batch
    replicas = [set(mb[0].flatten().tolist()) for d in range(2) for mb in microbatches_for_rank((index,), d, 2, 1)]
    assert replicas[0].isdisjoint(replicas[1]) and len(replicas[0] | replicas[1]) == 4  # disjoint samples
    assert not np.array_equal(s.order(3, n, n), first)  # the next epoch is another permutation


@pytest.mark.parametrize("kv", [None, 2])
def test_packed_document_loss_equals_each_document_alone(kv):
    """fp32: a document inside a doc-masked packed row has exactly the loss it has alone."""
    import dataclasses

    from pipezero.config import ModelConfig
    from pipezero.models import apply_preset, build_chunk

    torch.manual_seed(0)
    cfg = dataclasses.replace(apply_preset(ModelConfig(), "tiny"), n_kv_heads=kv, vocab_size=64)
    model = build_chunk(cfg, 0, cfg.n_layers + 2, seed=1)
    docs = [torch.randint(1, 64, (n,)).tolist() for n in (9, 4, 10, 6)]  # 33 tokens with EOS: one row
    s = packed(docs, 32, Packing.DOC_MASKED)
    x, y, d = (t.expand(2, -1) for t in s.rows(np.array([0])))  # a batch of two rows
    with torch.no_grad():
        logits = model(x, d)
        losses = torch.nn.functional.cross_entropy(logits[0], y[0], reduction="none")
        start = 0
        for tokens in docs:
            alone = torch.tensor([tokens + [0]])
            ref = torch.nn.functional.cross_entropy(model(alone[:, :-1])[0], alone[0, 1:], reduction="none")
            torch.testing.assert_close(losses[start:start + len(tokens)], ref, rtol=1e-5, atol=1e-5)
            if start + len(tokens) < 32:
                assert y[0, start + len(tokens)] == IGNORE  # EOS predicts no next document
            start += len(tokens) + 1
        assert not torch.allclose(model(x)[0, 10:20], logits[0, 10:20])  # without the mask it differs


def test_whole_documents_cut_each_micro_batch_to_its_own_length_with_the_same_loss():
    """`--packing none`: a micro-batch is as long as its longest document (rounded up to a power of
    two), and cutting the padding changes neither the loss nor any gradient."""
    import dataclasses

    from pipezero.config import ModelConfig
    from pipezero.data.packing import fit_length
    from pipezero.models import apply_preset, build_chunk, lm_loss

    torch.manual_seed(0)
    docs = [torch.randint(1, 64, (n,)).tolist() for n in (5, 3, 20, 40, 12, 10)]
    s = packed(docs, 32, Packing.NONE)
    full = s.rows(np.arange(len(docs)))
    cut = [fit_length(tuple(t[i:i + 2] for t in full)) for i in (0, 2, 4)]
    assert [mb[0].shape[1] for mb in cut] == [8, 32, 16]  # longest documents 5, 40 (cut at 32), 12 tokens
    assert sum(int((mb[1] != IGNORE).sum()) for mb in cut) == int((full[1] != IGNORE).sum())  # none dropped
    cfg = dataclasses.replace(apply_preset(ModelConfig(), "tiny"), vocab_size=64)
    model = build_chunk(cfg, 0, cfg.n_layers + 2, seed=1)
    grads = []
    for x, y in [tuple(t[:2] for t in full), cut[0]]:
        model.zero_grad()
        loss = lm_loss(model(x), y, 10.0)
        loss.backward()
        grads.append((loss.detach(), [q.grad.clone() for q in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-7)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.distributed  # full lane: seconds of one-process training
def test_cli_trains_on_a_folder_with_packing(corpus_dir, tmp_path, capsys):
    from one_line import run_main

    out = tmp_path / "run"
    base = ["train", "--data", str(corpus_dir / "a.jsonl"), str(corpus_dir / "sub"), "--tokenizer", "bytes",
            "--seq-len", "32", "--micro-batch-size", "2", "--microbatches", "2", "--max-steps", "3", "--no-progress",
            "--heldout-fraction", "0.1", "--packing", "doc-masked", "--sample-tokens", "0", "--out", str(out)]
    code, err = run_main(base, capsys)
    assert code == 0, err
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in lines)
    write_jsonl(tmp_path / "broken.jsonl", [doc(1)])
    with (tmp_path / "broken.jsonl").open("a") as f:
        f.write("{nope\n")
    code, err = run_main([*base[:2], str(tmp_path / "broken.jsonl"), "--out", str(tmp_path / "r2")], capsys)
    assert code == 2 and err.count("\n") == 1 and "broken.jsonl:2: invalid JSON" in err, err


def test_an_eos_beyond_uint16_widens_the_token_cache(tmp_path):
    """A model folder whose config.json names an EOS id >= 65536 beside a tokenizer of fewer tokens:
    the cache stores that EOS (uint32), and the corpus counts it among the ids the model must embed."""
    from pipezero.data.tokenizer import BPETokenizer

    docs = [doc(i) for i in range(30)]
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text(BPETokenizer.train(docs, 300, eos=True).hf.to_str())
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 70000, "eos_token_id": 65600}))
    cfg = cfg_of(write_jsonl(tmp_path / "a.jsonl", docs))
    cfg.tokenizer = str(model / "tokenizer.json")
    c = load_corpus(cfg)
    assert c.train.dtype == np.uint32 and c.vocab_size == 65601
    ends = c.samples[0].docs.offsets[1:] - 1
    assert (np.asarray(c.train)[ends] == 65600).all()


def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path):
    """Files saved with a UTF-8 byte order mark (Windows editors, Excel, PowerShell): jsonl with CRLF
    line ends and no newline after its last line, a json array, a text file."""
    docs = [doc(i) for i in range(30)]
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + "\r\n".join(json.dumps({"text": d}) for d in docs[:20]).encode())
    (tmp_path / "b.json").write_bytes(bom + json.dumps([{"text": d} for d in docs[20:29]], indent=1).encode())
    (tmp_path / "c.txt").write_bytes(bom + docs[29].encode())
    c = load_corpus(cfg_of(tmp_path))
    read = [bytes(np.asarray(s.docs.tokens[a:b - 1]).astype(np.uint8)).decode()
            for s in c.samples for a, b in zip(s.docs.offsets[:-1], s.docs.offsets[1:])]
    assert sorted(read) == sorted(docs)


def test_a_file_named_twice_is_read_once(tmp_path):
    """A folder, a glob and a file that overlap (`--data docs/ 'docs/*.jsonl' docs/a.jsonl`): each file
    is one set of documents, so no held-out document has a copy among the training documents."""
    root = tmp_path / "docs"
    root.mkdir()
    write_jsonl(root / "a.jsonl", [doc(i) for i in range(40)])
    (root / "b.txt").write_text(doc(99))
    c = load_corpus(cfg_of([root, root / "*.jsonl", root / "a.jsonl", tmp_path / "docs" / ".." / "docs" / "b.txt"]))
    train, held = (s.docs for s in c.samples)
    assert train.n_docs + held.n_docs == 41

    def texts(d):
        return {bytes(np.asarray(d.tokens[a:b - 1]).astype(np.uint8)) for a, b in zip(d.offsets[:-1], d.offsets[1:])}

    assert texts(train).isdisjoint(texts(held))


def test_a_file_rewritten_with_its_old_size_and_modification_time_is_read_again(tmp_path):
    """Same path, same size, same mtime, other text: what a filesystem with coarse timestamps (1-2 s:
    HFS+, FAT, some NFS servers) gives for an edit within the tick, and what `cp -p`, `rsync -t` or
    `tar x` give for a new version of a file. The change time (never set by a tool) tells them apart."""
    path = write_jsonl(tmp_path / "a.jsonl", [doc(i) for i in range(30)])
    st = path.stat()
    first = load_corpus(cfg_of(path))
    write_jsonl(path, [doc(i)[::-1] for i in range(30)])  # the same length, other text
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    again = load_corpus(cfg_of(path))
    assert not np.array_equal(np.asarray(again.train), np.asarray(first.train))
