"""Bad inputs on the data surfaces (documents, tokenizers, the token cache, Hugging Face config.json
and weights): each is one line naming the input and the fix, exit 2, before any rank starts, and a
damaged cache entry is rebuilt rather than read.

Everything runs in this process (`pipezero.cli.main`); model folders are written here by hand
(config.json, a tiny BPE tokenizer.json, random safetensors), not with transformers, to stay fast.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from one_line import assert_one_line, run_main
from tiny_runs import TINY_FLAGS, TRAIN_TINY, write_docs
from pipezero.config import OnBadRecord
from pipezero.errors import ConfigError

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "eos_token_id": 0}


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of 40 small text documents (Python source)."""
    import inspect

    root = tmp_path_factory.mktemp("docs")
    text = inspect.getsource(inspect)
    for i in range(40):
        (root / f"{i:02d}.txt").write_text(text[i * 3000:(i + 1) * 3000])
    return root


@pytest.fixture(scope="module")
def tokenizer_text(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 300-token byte-level BPE whose id 0 is <|endoftext|>."""
    from hf_models import tokenizer_json

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer_json(path)
    return path.read_text()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, tokenizer_text: str) -> Path:
    """A 2-block Llama folder with random weights that pipezero loads as it is."""
    from safetensors.torch import save_file

    from pipezero.config import ModelConfig
    from pipezero.models.hf import model_fields, to_hf
    from pipezero.models.hf_weights import expected_shapes

    folder = tmp_path_factory.mktemp("model")
    (folder / "tokenizer.json").write_text(tokenizer_text)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    cfg = ModelConfig(**model_fields(folder), pretrained=str(folder))
    gen = torch.Generator().manual_seed(0)
    tensors = {to_hf(n, cfg.n_layers, cfg.tie_embeddings): 0.02 * torch.randn(shape, generator=gen)
               for n, shape in expected_shapes(cfg).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def copy_model(model: Path, dest: Path, config: dict | None = None, tokenizer: dict | None = None) -> Path:
    """A copy of `model` with config.json's keys replaced by `config` (None values are removed) and
    tokenizer.json replaced by `tokenizer`."""
    import shutil

    shutil.copytree(model, dest)
    if config is not None:
        merged = {**json.loads((dest / "config.json").read_text()), **config}
        (dest / "config.json").write_text(json.dumps({k: v for k, v in merged.items() if v is not None}))
    if tokenizer is not None:
        (dest / "tokenizer.json").write_text(json.dumps(tokenizer))
    return dest


def train_argv(model: Path | None, docs: Path, out: Path, *flags: str) -> list[str]:
    return ["train", *(["--model", str(model)] if model else []), "--data", str(docs), "--seq-len", "16",
            "--max-steps", "1", "--no-progress", "--out", str(out), *flags]


# --- 1. tokenizer ids past the embedding -----------------------------------------------------------

def tokenizer_with(text: str, change) -> dict:
    t = json.loads(text)
    change(t)
    return t


def _move_token(t: dict) -> None:
    t["model"]["vocab"]["e"] = 1000  # a frequent token: the count stays 300, the largest id is 1000


def _added_token(t: dict) -> None:  # the end-of-text token renumbered (added token and vocabulary alike)
    t["added_tokens"][0]["id"] = t["model"]["vocab"]["<|endoftext|>"] = 700


def _bos_template(t: dict) -> None:  # a post-processor putting BOS (id 900, in no vocabulary) first
    t["post_processor"] = {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [900], "tokens": ["<s>"]}}}


@pytest.mark.parametrize("change,needle", [
    (_move_token, "gives id 1000 ('e') but config.json's vocab_size is 320"),
    (_added_token, "gives id 700 ('<|endoftext|>') but config.json's vocab_size is 320"),
    (_bos_template, "gives id 900 ('<s>') but config.json's vocab_size is 320"),
], ids=["vocab", "added", "post-processor"])
def test_a_tokenizer_id_past_the_embedding_is_refused_before_any_rank(change, needle, model, tokenizer_text, docs,
                                                                        tmp_path, capsys):
    folder = copy_model(model, tmp_path / "m", tokenizer=tokenizer_with(tokenizer_text, change))
    assert_one_line(*run_main(train_argv(folder, docs, tmp_path / "out"), capsys), needle)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_alone_counts_its_largest_id(tokenizer_text, docs, tmp_path, capsys):
    """--tokenizer FILE with the built-in model: the rows the model needs are one past the largest
    id, not the count, and the token cache's dtype follows it too."""
    from pipezero.data.tokenizer import BPETokenizer, id_bound

    path = tmp_path / "moved.json"
    path.write_text(json.dumps(tokenizer_with(tokenizer_text, _move_token)))
    assert id_bound(BPETokenizer.from_file(path)) == 1001
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps(tokenizer_with(tokenizer_text, lambda t: t["model"]["vocab"].update(e=70000))))
    assert id_bound(BPETokenizer.from_file(wide)) == 70001
    config = tmp_path / "run.toml"
    config.write_text("[model]\nvocab_size = 512\n")
    assert_one_line(*run_main([*train_argv(None, docs, tmp_path / "out", "--tokenizer", str(path)),
                               "--config", str(config)], capsys), "set model.vocab_size >= 1001")


# --- 2. config.json values of the wrong kind, impossible, or ids given as tokens ------------------

def _llama3(**changes: object) -> dict:
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return {"rope_parameters": {**rope, **changes}}


CONFIG_CASES = [
    ({"hidden_size": "32"}, "field 'hidden_size' = \"32\" is not an integer"),
    ({"hidden_size": None}, "field 'hidden_size' is missing"),
    ({"hidden_size": 0}, "field 'hidden_size' = 0 must be at least 1"),
    ({"hidden_size": -32}, "field 'hidden_size' = -32 must be at least 1"),
    ({"vocab_size": 0}, "field 'vocab_size' = 0 must be at least 1"),
    ({"num_hidden_layers": 0}, "field 'num_hidden_layers' = 0 must be at least 1"),
    ({"intermediate_size": -1}, "field 'intermediate_size' = -1 must be at least 1"),
    ({"max_position_embeddings": 0}, "field 'max_position_embeddings' = 0 must be at least 1"),
    ({"max_position_embeddings": 16.0}, "field 'max_position_embeddings' = 16.0 is not an integer"),
    ({"max_position_embeddings": 8}, "--seq-len 16 is longer than the model allows (config.json's "
                                     "max_position_embeddings is 8); lower --seq-len"),
    ({"num_attention_heads": 0}, "field 'num_attention_heads' = 0 must be at least 1"),
    ({"num_attention_heads": 5}, "hidden_size 32 is not a multiple of num_attention_heads 5"),
    ({"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"num_key_value_heads": 0}, "field 'num_key_value_heads' = 0 must be at least 1"),
    ({"head_dim": 0}, "field 'head_dim' = 0 must be at least 1"),
    ({"head_dim": 7}, "head_dim 7 is odd: rotary positions turn pairs of a head's dimensions"),
    ({"rms_norm_eps": 0}, "field 'rms_norm_eps' = 0 must be a number > 0"),
    ({"rms_norm_eps": -1e-6}, "field 'rms_norm_eps' = -1e-06 must be a number > 0"),
    ({"rms_norm_eps": float("inf")}, "field 'rms_norm_eps' = Infinity must be a number > 0"),
    ({"rms_norm_eps": "1e-6"}, "field 'rms_norm_eps' = \"1e-6\" is not a number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}},
     "field 'rope_parameters.rope_theta' = \"abc\" is not a number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": None}},
     "field 'rope_parameters.rope_theta' is missing"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "field 'rope_parameters.rope_theta' = 0 must be a number > 0"),
    ({"rope_parameters": None, "rope_theta": "x"}, "field 'rope_theta' = \"x\" is not a number"),
    (_llama3(factor=0), "field 'rope_parameters.factor' = 0 must be a number > 0"),
    (_llama3(factor=True), "field 'rope_parameters.factor' = true is not a number"),
    (_llama3(low_freq_factor=4.0), "rope_parameters' high_freq_factor 4.0 must be above its low_freq_factor 4.0"),
    (_llama3(low_freq_factor=0), "field 'rope_parameters.low_freq_factor' = 0 must be a number > 0"),
    (_llama3(original_max_position_embeddings=0),
     "field 'rope_parameters.original_max_position_embeddings' = 0 must be at least 1"),
    (_llama3(original_max_position_embeddings=None), "llama3 rope scaling lacks original_max_position_embeddings"),
    ({"model_type": "mistral", "sliding_window": 0}, "field 'sliding_window' = 0 must be at least 1"),
    ({"tie_word_embeddings": 1}, "field 'tie_word_embeddings' = 1 is not true or false"),
    ({"hidden_act": None}, "field 'hidden_act' = null; only silu (SwiGLU) is supported"),
    # ids written as tokens, or as numbers that are not integer ids: refused, never silently ignored
    ({"eos_token_id": "<|endoftext|>"},
     "field 'eos_token_id' = \"<|endoftext|>\" is a token, not an id: write its id, 0 in tokenizer.json"),
    ({"eos_token_id": "</s>"}, "field 'eos_token_id' = \"</s>\" is a token, not an id, and tokenizer.json "
                               "has no such token: write the end-of-sequence id"),
    ({"eos_token_id": ["<|endoftext|>"]}, "field 'eos_token_id' = [\"<|endoftext|>\"] is a token, not an id"),
    ({"eos_token_id": 0.0}, "field 'eos_token_id' = 0.0 is not an integer id"),
    ({"eos_token_id": True}, "field 'eos_token_id' = true is not an integer id"),
    ({"pad_token_id": "<|endoftext|>"}, "field 'pad_token_id' = \"<|endoftext|>\" is a token, not an id: write "
                                        "its id, 0 in tokenizer.json"),
    ({"pad_token_id": 1.5}, "field 'pad_token_id' = 1.5 is not an integer id"),
    # the expected shapes were built a block at a time: 10^9 blocks never finished (past a minute, 1.3 GB)
    ({"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000, but the weights hold 2 blocks"),
    ({"num_hidden_layers": 3}, "num_hidden_layers = 3, but the weights hold 2 blocks"),
]


@pytest.mark.parametrize("change,needle", CONFIG_CASES, ids=[json.dumps(c[0])[:60] for c in CONFIG_CASES])
def test_a_bad_config_json_value_is_one_line_naming_the_key(change, needle, model, docs, tmp_path, capsys):
    folder = copy_model(model, tmp_path / "m")
    merged = {**json.loads((folder / "config.json").read_text()), **change}
    (folder / "config.json").write_text(json.dumps(merged))
    code, err = run_main(train_argv(folder, docs, tmp_path / "out"), capsys)
    assert_one_line(code, err, needle)
    assert "config.json" in err and not (tmp_path / "out").exists()


def test_a_generation_config_pad_token_written_as_a_token_is_refused(model, docs, tmp_path, capsys):
    folder = copy_model(model, tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"pad_token_id": "<|endoftext|>"}))
    assert_one_line(*run_main(train_argv(folder, docs, tmp_path / "out"), capsys),
                    "generation_config.json: field 'pad_token_id' = \"<|endoftext|>\" is a token, not an id")


# --- 3. weights holding NaN or inf ------------------------------------------------------------------

def with_tensors(folder: Path, change) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _poison(tensors: dict[str, torch.Tensor]) -> None:
    tensors["model.layers.1.self_attn.q_proj.weight"][3, 5] = float("nan")
    tensors["lm_head.weight"][7] = float("inf")  # a whole row: 32 values
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
    tensors["model.norm.weight"][0] = float("-inf")


def test_non_finite_weights_are_named_before_any_rank(model, docs, tmp_path, capsys, monkeypatch):
    folder = with_tensors(copy_model(model, tmp_path / "m"), _poison)
    code, err = run_main(train_argv(folder, docs, tmp_path / "out"), capsys)
    assert_one_line(code, err, "3 tensors hold NaN or inf: lm_head.weight (32 of 10240 values), "
                               "model.layers.1.self_attn.q_proj.weight (1 of 1024), model.norm.weight (1 of 32)")
    assert not (tmp_path / "out").exists()


def test_a_rank_loading_non_finite_weights_refuses_them(model, tmp_path):
    """Under an outside torchrun each rank loads its chunks itself: a tensor that is not finite is
    refused there too (the launcher's scan is not run)."""
    from pipezero.config import ModelConfig
    from pipezero.models import build_chunk
    from pipezero.models.hf import model_fields
    from pipezero.models.hf_weights import FlatReader, load_chunk

    folder = with_tensors(copy_model(model, tmp_path / "m"), _poison)
    cfg = ModelConfig(**model_fields(folder), pretrained=str(folder))
    with pytest.raises(ConfigError, match=r"tensor 'model.norm.weight' holds NaN or inf"):
        load_chunk(build_chunk(cfg, 3, 4, seed=0), cfg)
    with pytest.raises(ConfigError, match=r"tensor 'model.layers.1.self_attn.q_proj.weight' holds NaN or inf"):
        FlatReader(cfg)("layers.2.attn.wq.weight", 0, 1024)
    load_chunk(build_chunk(cfg, 0, 1, seed=0), cfg)  # the embedding is finite


# --- 4. a cache folder that is a file, or cannot be written -----------------------------------------

def _cache_cases(tmp_path: Path) -> list[tuple[str, str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return [
        (str(a_file), f"the cache folder {a_file} (PIPEZERO_CACHE) is a file, not a folder"),
        (str(a_file / "sub"), f"the cache folder {a_file / 'sub'} (PIPEZERO_CACHE) cannot be made"),
        ("/proc/pipezero-cache", "the cache folder /proc/pipezero-cache (PIPEZERO_CACHE) cannot be made"),
        ("/proc", "the cache folder /proc (PIPEZERO_CACHE) cannot be written"),
    ]


@pytest.mark.parametrize("launch", [[], ["--nproc", "2", "--pp", "2"]], ids=["one-process", "launcher"])
def test_a_cache_folder_that_is_a_file_or_unwritable_is_one_line(launch, docs, tmp_path, capsys, monkeypatch):
    for cache, needle in _cache_cases(tmp_path):
        monkeypatch.setenv("PIPEZERO_CACHE", cache)
        code, err = run_main([*train_argv(None, docs, tmp_path / "out", "--tokenizer", "bytes"), *launch], capsys)
        assert_one_line(code, err, needle)
        assert "point PIPEZERO_CACHE at a folder you can write" in err
    assert (tmp_path / "a-file").read_text() == "x"


def test_the_default_cache_folder_names_where_it_comes_from(tmp_path, monkeypatch):
    from pipezero.data.cache_folder import cache_dir

    (tmp_path / "xdg").write_text("x")
    monkeypatch.delenv("PIPEZERO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.raises(ConfigError, match=r"\(XDG_CACHE_HOME\) cannot be made .*; point PIPEZERO_CACHE at a folder"):
        cache_dir()


# --- 5. damaged token cache entries -----------------------------------------------------------------

def _cut(name: str, n_bytes: int):
    def damage(entry: Path) -> None:
        path = entry / name
        size = path.stat().st_size
        with path.open("r+b") as f:
            f.truncate(size - n_bytes if n_bytes > 0 else size // 2)
    return damage


def _grow(entry: Path) -> None:
    with (entry / "train.tokens").open("ab") as f:
        f.write(b"\0\0" * 8)


def _swap_offsets(entry: Path) -> None:  # same size, other content: documents cut elsewhere
    import numpy as np

    offsets = np.load(entry / "train.offsets.npy")
    offsets[1], offsets[2] = offsets[1] + 1, offsets[2] - 1
    np.save(entry / "train.offsets.npy", offsets)


def _edit_meta(**changes: object):
    def damage(entry: Path) -> None:
        meta = json.loads((entry / "meta.json").read_text())
        (entry / "meta.json").write_text(json.dumps({**meta, **changes}))
    return damage


DAMAGE = {
    "tokens cut by a byte": _cut("train.tokens", 1),
    "tokens cut by a token": _cut("train.tokens", 2),  # keeps uint16's alignment
    "tokens cut in half": _cut("train.tokens", 0),
    "held-out tokens cut by a token": _cut("heldout.tokens", 2),
    "tokens grown": _grow,
    "tokens removed": lambda e: (e / "train.tokens").unlink(),
    "offsets cut": _cut("train.offsets.npy", 8),
    "offsets edited": _swap_offsets,
    "offsets removed": lambda e: (e / "heldout.offsets.npy").unlink(),
    "meta dtype edited": _edit_meta(dtype="uint32"),
    "meta count edited": _edit_meta(documents=3),
    "meta not json": lambda e: (e / "meta.json").write_text('{"dtype": "uin'),
    "meta removed": lambda e: (e / "meta.json").unlink(),
}


def _documents(tmp_path: Path):
    from pipezero.config import DataConfig

    (tmp_path / "d").mkdir()
    words = "the quick brown fox jumps over a lazy dog".split()
    (tmp_path / "d" / "a.jsonl").write_text("".join(json.dumps({"text": " ".join(words[i % 9:] + words[:i % 9]) * 3})
                                                    + "\n" for i in range(60)))
    return DataConfig(path=[str(tmp_path / "d")], tokenizer="bytes", seq_len=32, heldout_fraction=0.1)


def _arrays(corpus) -> list:
    import numpy as np

    return [np.asarray(a).copy() for s in corpus.samples for a in (s.docs.tokens, s.docs.offsets)]


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_cache_entry_is_rebuilt(damage, tmp_path, capsys, monkeypatch):
    import numpy as np

    from pipezero.data import load_corpus
    from pipezero.data.cache_folder import cache_dir

    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "cache"))
    cfg = _documents(tmp_path)
    before = _arrays(load_corpus(cfg))
    [entry] = cache_dir().glob("docs-*")
    capsys.readouterr()
    DAMAGE[damage](entry)
    after = _arrays(load_corpus(cfg))
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    err = capsys.readouterr().err
    assert f"pipezero: warning: the token cache entry {entry} is damaged (" in err and "); rebuilding it" in err
    assert err.count("\n") == 1
    assert [p.name for p in cache_dir().iterdir() if p.name.startswith(".docs-")] == []  # nothing left beside it
    _arrays(load_corpus(cfg))
    assert capsys.readouterr().err == ""  # rebuilt whole: read as it is from then on


def test_damaged_stdlib_and_tokenizer_caches_are_rebuilt(tmp_path, capsys, monkeypatch):
    import numpy as np

    from pipezero.config import DataConfig
    from pipezero.data import load_corpus
    from pipezero.data.cache_folder import cache_dir

    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "cache"))
    stdlib = DataConfig(tokenizer="bytes", max_bytes=100_000, seq_len=32)
    first = load_corpus(stdlib)
    train, held = np.asarray(first.train).copy(), np.asarray(first.heldout).copy()
    [path] = cache_dir().glob("tokens-*/train.npy")
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 2)
    again = load_corpus(stdlib)
    assert np.array_equal(again.train, train) and np.array_equal(again.heldout, held)
    assert f"the token cache entry {path.parent} is damaged" in capsys.readouterr().err

    bpe = _documents(tmp_path)
    bpe.tokenizer, bpe.bpe_vocab = "bpe", 300
    tokens = np.asarray(load_corpus(bpe).train).copy()
    [path] = cache_dir().glob("bpe-300-*.json")
    path.write_text('{"model": ')
    capsys.readouterr()
    assert np.array_equal(load_corpus(bpe).train, tokens)
    assert f"the cached tokenizer {path} is damaged" in capsys.readouterr().err


# --- 6. --out inside a --data folder ---------------------------------------------------------------

def test_out_inside_the_data_is_refused(docs, tmp_path, capsys, monkeypatch):
    """The run's own files (metrics.jsonl, hf/config.json, ...) would be read as documents when it
    resumes, changing the corpus under it: refused before anything is written, whichever way the
    data names the folder; a glob that cannot reach the run's files is fine."""
    from pipezero.settings import build_config

    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.jsonl").write_text('{"text": "hello there"}\n')
    (root / "b.txt").write_text("hello")
    (tmp_path / "link").symlink_to(root)
    (root / "old-run").mkdir()
    (root / "old-run" / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.chdir(tmp_path)
    refused = [
        ([str(root)], root / "run"),
        ([str(root)], root),
        ([str(root / "sub")], root),  # --out holds the data
        (["data"], root / "run"),  # relative
        ([str(tmp_path / "link")], root / "run"),  # through a link
        ([str(root / "**" / "*.jsonl")], root / "run"),
        (["data/*/*.jsonl"], root / "run"),
        ([str(root / "old-run" / "metrics.jsonl")], root / "old-run"),
    ]
    for data, out in refused:
        with pytest.raises(ConfigError, match=r"^--out '.*' (is inside|holds) --data '.*': the run's own files"):
            build_config(None, {"data.path": data, "run.out": str(out)})
    for data, out in [([str(root / "*.txt")], root / "run"), ([str(root / "sub")], root / "run"),
                      (["data/*.txt"], "data/run")]:
        build_config(None, {"data.path": data, "run.out": str(out)})  # the run's files are out of reach
    code, err = run_main(train_argv(None, root, root / "run", "--tokenizer", "bytes"), capsys)
    assert_one_line(code, err, "put --out outside the data")
    assert not (root / "run").exists()


# --- 7. a document too large to tokenize in bounded memory ------------------------------------------

def _oversized(root: Path, mb: float) -> dict[str, Path]:
    """One file of each kind whose second document is `mb` MB, beside small ones."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    big = "word " * int(mb * (1 << 20) / 5)
    small = [f"document number {i} " * 20 for i in range(30)]
    root.mkdir()
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in [small[0], big, *small[1:]]))
    (root / "b.json").write_text(json.dumps([{"text": t} for t in [small[0], big, *small[1:]]]))
    pq.write_table(pa.table({"text": [small[0], big, *small[1:]]}), root / "c.parquet")
    (root / "d.txt").write_text(big)
    return {"jsonl": root / "a.jsonl", "json": root / "b.json", "parquet": root / "c.parquet", "txt": root / "d.txt"}


@pytest.mark.parametrize("kind,where", [("jsonl", "a.jsonl:2"), ("json", "b.json: record 1"),
                                        ("parquet", "c.parquet: row 2"), ("txt", "d.txt")])
def test_a_document_over_the_limit_is_one_line_or_skipped(kind, where, tmp_path, capsys):
    from pipezero.config import DataConfig, OnBadRecord
    from pipezero.data import load_corpus

    path = _oversized(tmp_path / "d", 1.5)[kind]
    cfg = DataConfig(path=[str(path)], tokenizer="bytes", seq_len=32, heldout_fraction=0.1, max_document_mb=1)
    with pytest.raises(ConfigError, match=rf"{where}: a document of 1.5 MB, over data.max_document_mb = 1 "
                                          rf"\(--max-document-mb\).*; fix the record or pass --on-bad-record skip"):
        load_corpus(cfg)
    if kind != "txt":  # the others are kept
        cfg.on_bad_record = OnBadRecord.SKIP
        corpus = load_corpus(cfg)
        assert sum(s.docs.n_docs for s in corpus.samples) == 30
        assert "skipped 1 bad records (first: " in capsys.readouterr().out
    cfg.max_document_mb, cfg.on_bad_record = 2, OnBadRecord.FAIL  # under a higher limit it is read
    cfg.path = [str(path), str(path.parent / "a.jsonl")]  # (a text file alone cannot be split for held-out)
    assert sum(s.docs.n_docs for s in load_corpus(cfg).samples) == {"jsonl": 31, "txt": 32}.get(kind, 62)


def test_an_over_long_jsonl_line_is_never_held_whole(tmp_path):
    """A 24 MB line under a 1 MB limit is skipped over in blocks: the reader's own allocations stay
    near the limit, not the line's size (the tokenizer never sees it)."""
    import tracemalloc

    from pipezero.config import OnBadRecord
    from pipezero.data.sources import BadRecords, Reader

    path = tmp_path / "a.jsonl"
    with path.open("w") as f:
        f.write(json.dumps({"text": "before"}) + "\n")
        f.write(json.dumps({"text": "x" * (24 << 20)}) + "\n")
        f.write(json.dumps({"text": "after"}) + "\n")
    reader = Reader("text", BadRecords(OnBadRecord.SKIP), max_document_bytes=1 << 20)
    tracemalloc.start()
    try:
        texts = [t for t, _ in reader.documents(path)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert texts == ["before", "after"] and reader.records.skipped == 1
    assert peak < 4 << 20, peak


def test_the_document_limit_is_a_setting_with_a_flag(docs, tmp_path, capsys):
    from pipezero.settings import build_config

    assert build_config().data.max_document_mb == 8
    assert_one_line(*run_main(train_argv(None, docs, tmp_path / "out", "--max-document-mb", "0"), capsys),
                    "--max-document-mb 0: expected an integer >= 1")


# --- 8. a full disk while the cache is built, and JSON the reader cannot follow --------------------

def test_a_full_disk_during_the_cache_build_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """The token cache's write fails half way (ENOSPC): one line naming the cache folder and the
    fix, and neither the half-written temporary folder nor an entry is left behind."""
    import errno

    from pipezero.data import cache

    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "cache"))
    _documents(tmp_path)
    written = cache._SplitWriter.write

    def fills_up(self, docs):  # noqa: ANN001
        written(self, docs[: len(docs) // 2])  # part of the batch reaches the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache._SplitWriter, "write", fills_up)
    code, err = run_main(train_argv(None, tmp_path / "d", tmp_path / "out", "--tokenizer", "bytes"), capsys)
    assert_one_line(code, err, f"the cache folder {tmp_path / 'cache'} (PIPEZERO_CACHE) could not hold docs-")
    assert "(No space left on device); free space there, or point PIPEZERO_CACHE at a folder with room" in err
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []  # no entry, no temporary folder, no lock
    monkeypatch.undo()


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_json_the_reader_cannot_follow_is_a_bad_record(kind, tmp_path, capsys):
    """Nesting past Python's recursion limit, an integer of 5,001 digits and a lone surrogate
    escape (RecursionError, ValueError, the tokenizer's UnicodeEncodeError inside the reader): each
    is a bad record, named, or skipped with --on-bad-record skip."""
    from pipezero.config import DataConfig, OnBadRecord
    from pipezero.data import load_corpus

    good = [json.dumps({"text": f"document number {i} " * 20}) for i in range(30)]
    bad = {"deep": '{"text": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
           "digits": '{"text": "a", "n": 1' + "0" * 5000 + "}", "surrogate": '{"text": "abc \\ud800 def"}'}
    for name, record in bad.items():
        path = tmp_path / name / f"a.{kind}"
        path.parent.mkdir()
        lines = [good[0], record, *good[1:]]
        path.write_text("\n".join(lines) if kind == "jsonl" else "[" + ",\n".join(lines) + "]")
        where = f"a.{kind}:2" if kind == "jsonl" else f"a.{kind}: record 1"
        needle = {"deep": "nested deeper than the JSON reader follows", "digits": "value has 5001 digits",
                  "surrogate": "holds a lone UTF-16 surrogate (\\ud800 at character 4)"}[name]
        cfg = DataConfig(path=[str(path)], tokenizer="bytes", seq_len=32, heldout_fraction=0.1)
        with pytest.raises(ConfigError, match=re.escape(f"{where}: ") + ".*" + re.escape(needle)):
            load_corpus(cfg)
        cfg.on_bad_record = OnBadRecord.SKIP
        assert sum(s.docs.n_docs for s in load_corpus(cfg).samples) == 30
        assert "skipped 1 bad records" in capsys.readouterr().out


def test_a_json_array_is_read_a_record_at_a_time(tmp_path):
    """A 20 MB array of small records: the reader's own allocations stay near its block (1 MB of
    text), not the file's size (json.loads of the whole file held several times the file)."""
    import tracemalloc

    from pipezero.data.sources import BadRecords, Reader

    path = tmp_path / "a.json"
    records = [{"text": f"document {i} " + "word " * 200, "id": i} for i in range(20_000)]
    path.write_text(json.dumps(records))
    assert path.stat().st_size > 20e6
    reader = Reader("text", BadRecords(OnBadRecord.FAIL))
    tracemalloc.start()
    try:
        count = sum(1 for _ in reader.documents(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert count == len(records)
    assert peak < 6 << 20, peak


@pytest.mark.parametrize("text, needle", [
    ('[{"text": "a"} {"text": "b"}]', "a.json:1: invalid JSON (expected ',' or ']' after a record)"),
    ('[{"text": "a"},\n{"text": "b"', "a.json:2: invalid JSON (Expecting ',' delimiter)"),
    ('[{"text": "a"}] trailing', "a.json:1: invalid JSON (extra data after the array)"),
    ('[{"text": "a"},\n', "a.json:2: invalid JSON (the file ends inside the array (no closing ']'))"),
])
def test_a_broken_json_array_names_its_line(text, needle, tmp_path):
    from pipezero.data.sources import BadRecords, Reader

    (tmp_path / "a.json").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        list(Reader("text", BadRecords(OnBadRecord.SKIP)).documents(tmp_path / "a.json"))


def test_data_that_is_a_pipe_is_one_line(tmp_path, capsys):
    """A named pipe was reported as a glob that 'matches no files'; read as a document it would block."""
    import os

    os.mkfifo(tmp_path / "pipe.txt")
    assert_one_line(*run_main(train_argv(None, tmp_path / "pipe.txt", tmp_path / "out"), capsys),
                    f"--data '{tmp_path / 'pipe.txt'}' is a pipe (FIFO), not a file")


def test_a_file_name_that_is_not_utf8_is_hashed_as_its_bytes(tmp_path):
    """A file name is bytes to the filesystem: one no UTF-8 can hold is hashed as those bytes."""
    from pipezero.data.sources import fingerprint

    odd = tmp_path / os.fsdecode(b"x\xff.txt")
    odd.write_text("hello")
    assert len(fingerprint([odd])) == 16


def test_a_text_field_with_no_records_to_read_it_from_is_one_line(tmp_path, capsys):
    """Text files are read whole: a --text-field there would be read by nothing."""
    (tmp_path / "a.txt").write_text("hello there " * 50)
    argv = [*TRAIN_TINY, "--data", str(tmp_path / "a.txt"), "--text-field", "body", "--out", str(tmp_path / "o")]
    assert_one_line(*run_main(argv, capsys), "--text-field 'body' names a field of .jsonl/.json/.parquet records")


@pytest.mark.parametrize("argv, needle", [
    ([*TRAIN_TINY, "--data", "{fifo}.npy"], "--data '{fifo}.npy' is a pipe (FIFO), not a file"),  # np.load would block
    ([*TRAIN_TINY, "--data", "{fifo}"], "--data '{fifo}' is a pipe (FIFO), not a file"),
    ([*TRAIN_TINY, "--data", "/dev/zero"], "--data '/dev/zero' is a device, not a file"),
    ([*TRAIN_TINY, "--tokenizer", "{fifo}.json"], "tokenizer file '{fifo}.json' is a pipe (FIFO), not a file"),
    ([*TRAIN_TINY, "--tokenizer", "{tmp}"], "is a folder; name a tokenizer.json"),
    (["simulate", "--from-trace", "{fifo}"], "--from-trace '{fifo}' is a pipe (FIFO), not a file"),
    (["train", "--model", "{model}"], "config.json is a pipe (FIFO), not a file"),
])
def test_a_pipe_or_device_is_named_as_what_it_is(argv, needle, tmp_path, capsys):
    """A pipe or device given as a data or model path is named as what it is, never read (it
    would wait for ever) nor reported as missing."""
    fifo = tmp_path / "fifo"
    for name in ("fifo", "fifo.npy", "fifo.json"):
        os.mkfifo(tmp_path / name)
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "config.json")
    subst = {"fifo": str(fifo), "model": str(model), "tmp": str(tmp_path / "tok.json")}
    (tmp_path / "tok.json").mkdir()
    argv = [a.format(**subst) for a in argv]
    assert_one_line(*run_main(argv, capsys), needle.format(**subst))


@pytest.mark.parametrize("flags, toml, needle", [
    (["--data", "{npy}", "--on-bad-record", "skip"], "", "--on-bad-record skip applies to documents; --data {npy} is "
                                                         "a token file"),
    (["--data", "{npy}", "--tokenizer", "bytes"], "", "--tokenizer bytes tokenizes nothing: --data {npy} holds token "
                                                      "ids already"),
    (["--data", "{npy}", "--text-field", "body"], "", "--text-field body applies to documents"),
    (["--data", "{npy}", "--max-document-mb", "2"], "", "--max-document-mb 2 applies to documents"),
    (["--data", "{npy}", "--sample-tokens", "10"], "", "--sample-tokens 10 is read only with a tokenizer that decodes "
                                                       "the text sample; --data {npy} holds token ids"),
    (["--data", "{npy}"], "[run]\nsample_tokens = 10\n", "run.sample_tokens (in {toml}) 10 is read only with a "
                                                           "tokenizer"),
    (["--on-bad-record", "skip"], "", "--on-bad-record skip applies to --data documents; the built-in corpus"),
    (["--data", "{npy}"], "[data]\nbpe_vocab = 300\n", "data.bpe_vocab (in {toml}) 300 sizes the BPE"),
    (["--tokenizer", "bytes"], "[data]\nbpe_vocab = 300\n", "the tokenizer is bytes"),
    (["--data", "{npy}"], "[data]\nmax_bytes = 3000\n", "data.max_bytes (in {toml}) 3000 cuts the built-in corpus"),
])
def test_a_data_setting_the_source_does_not_read_is_one_line(flags, toml, needle, tmp_path, capsys):
    """Each setting is read by no part of this source: accepted, it would change nothing."""
    npy = tmp_path / "tokens.npy"
    np.save(npy, np.arange(1000, dtype=np.uint16))
    (tmp_path / "run.toml").write_text(toml)
    subst = {"npy": str(npy), "toml": str(tmp_path / "run.toml")}
    argv = [*TRAIN_TINY, "--out", str(tmp_path / "out"), *(f.format(**subst) for f in flags)]
    assert_one_line(*run_main([*argv, "--config", subst["toml"]] if toml else argv, capsys), needle.format(**subst))
    assert not (tmp_path / "out").exists()


def test_a_tiny_heldout_fraction_holds_out_nothing_instead_of_overflowing():
    """--heldout-fraction 1e-320: 1 / x is inf, which round() cannot take; every k-th past 2**62 is none."""
    from pipezero.data.corpus import every_kth, split_documents

    assert every_kth(0.25) == 4 and every_kth(1e-320) == 2**62
    train, held = split_documents(["a\n" * 50] * 3, 1e-320)
    assert train and held  # fewer documents than k: the tail of the text is held out


def test_an_empty_data_path_list_is_refused_not_the_built_in_corpus(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("[data]\npath = []\n")
    assert_one_line(*run_main([*TRAIN_TINY, "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "o")], capsys),
                    "data.path = []: name document files")
    assert not (tmp_path / "o").exists()


def test_rope_settings_given_twice_that_differ_are_refused(tmp_path):
    """transformers 5 reads rope_scaling and rope_theta over rope_parameters: a yarn scaling added
    beside rope_parameters, read from rope_parameters alone, would train another model than the one
    transformers loads."""
    from pipezero.errors import ConfigError
    from pipezero.models.hf import _rope

    base = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert _rope(base, tmp_path) == (500000.0, None)
    assert _rope({**base, "rope_theta": 500000.0}, tmp_path) == (500000.0, None)  # the same, twice: fine
    for extra, needle in (({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "in rope_scaling (rope_type)"),
                          ({"rope_scaling": {"type": "yarn"}}, "in rope_scaling (rope_type)"),
                          ({"rope_theta": "big"}, "in rope_theta (rope_theta)"),
                          ({"rope_theta": 10000.0}, "in rope_theta")):
        with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            _rope({**base, **extra}, tmp_path)


def test_a_cache_entry_edited_to_hold_an_id_past_the_vocabulary_is_rebuilt(tmp_path, capsys, monkeypatch):
    """Token files are only sized at each open (they are the bulk): bytes edited in place to an id
    past the tokenizer's vocabulary would pass that, and end the run in the embedding's IndexError.
    The ids are checked: the entry is rebuilt, with a warning."""
    import numpy as np

    from pipezero.data import load_corpus
    from pipezero.data.cache_folder import cache_dir

    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "cache"))
    cfg = _documents(tmp_path)
    before = _arrays(load_corpus(cfg))
    [entry] = cache_dir().glob("docs-*")
    capsys.readouterr()
    tokens = entry / "train.tokens"
    tokens.write_bytes(b"\xff\xff" + tokens.read_bytes()[2:])
    after = _arrays(load_corpus(cfg))
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    err = capsys.readouterr().err
    assert f"the token cache entry {entry} is damaged (train.tokens holds id 65535" in err, err
    assert err.count("\n") == 1


def test_a_cached_tokenizer_swapped_for_another_is_rebuilt(tmp_path, capsys, monkeypatch):
    """A cached bpe-*.json is checked against what pipezero built there: another tokenizer, valid or
    not, is rebuilt with a warning, never used."""
    import numpy as np

    from pipezero.data import load_corpus
    from pipezero.data.cache_folder import cache_dir

    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "cache"))
    cfg = _documents(tmp_path)
    cfg.tokenizer, cfg.bpe_vocab = "bpe", 300
    tokens = np.asarray(load_corpus(cfg).train).copy()
    [path] = cache_dir().glob("bpe-300-*.json")
    built = path.read_bytes()
    other = json.loads(built)
    vocab = other["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[260:262]  # two learned tokens' ids swapped: still a valid tokenizer
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(other))
    for name in cache_dir().glob("docs-*"):
        shutil.rmtree(name)  # token arrays are keyed by the tokenizer's content: make the swap matter
    capsys.readouterr()
    assert np.array_equal(load_corpus(cfg).train, tokens)
    err = capsys.readouterr().err
    assert f"the cached tokenizer {path} is damaged (its content is not what pipezero built there" in err, err
    assert path.read_bytes() == built


def test_rope_scaling_that_lacks_keys_rope_parameters_has_is_refused(tmp_path):
    """transformers 5 reads rope_scaling over rope_parameters: one naming llama3 with only its factor,
    beside a complete rope_parameters, is a config transformers refuses (low/high_freq_factor missing),
    so pipezero must not train it from rope_parameters alone."""
    from pipezero.errors import ConfigError
    from pipezero.models.hf import _rope

    full = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    base = {"rope_parameters": full}
    assert _rope({**base, "rope_scaling": {k: v for k, v in full.items() if k != "rope_theta"}}, tmp_path)[1] == \
        [8.0, 1.0, 4.0, 16.0]  # the same settings twice (rope_theta in rope_parameters only): fine
    with pytest.raises(ConfigError, match=r"in rope_scaling \(low_freq_factor\)"):
        _rope({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, tmp_path)


def test_a_jsonl_whose_every_record_is_bad_says_so(tmp_path, monkeypatch, capsys):
    """With --on-bad-record skip, every record skipped leaves no document: said so, with the first
    record's fault, since "give more text" would send the user the wrong way. The same line again
    when the token cache already holds the (empty) result."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"x": 1}\n' * 20)
    argv = ["train", "--preset", "tiny", "--tokenizer", "bytes", "--data", "d.jsonl", "--on-bad-record", "skip",
            "--seq-len", "16", "--max-steps", "1", "--no-progress", "--out", "o"]
    needle = ("--data holds no document: all 20 records were skipped as bad (first: d.jsonl:1: no field 'text' "
              "(pass --text-field NAME))")
    for _ in range(2):
        code, err = run_main(argv, capsys)
        err = "\n".join(line for line in err.splitlines() if not line.startswith("pipezero: skipped"))
        assert_one_line(code, err, needle)
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("cache", ["docs/cache", "docs", "docs/a/b"])
def test_a_cache_folder_inside_the_data_is_refused(cache, tmp_path, monkeypatch, capsys):
    """PIPEZERO_CACHE=docs/cache with --data docs: the first run would train, and every later one read
    the cached tokenizer's json as a document and stop at its missing 'text' field."""
    write_docs(tmp_path, 8, "some words to train on, file {i} ", 20)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPEZERO_CACHE", cache)
    code, err = run_main(["train", *TINY_FLAGS, "--data", "docs", "--max-steps", "1", "--no-progress", "--out", "o"], capsys)
    assert_one_line(code, err, f"the cache folder {cache} (PIPEZERO_CACHE) is inside --data 'docs'")
    assert not (tmp_path / "o").exists()


def test_a_cache_folder_beside_the_data_or_holding_it_is_fine(tmp_path, monkeypatch):
    from pipezero.data.sources import check_cache_out_of_reach

    write_docs(tmp_path, 8, "some words to train on, file {i} ", 20)
    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "docs-cache"))  # a prefix of the name, not a folder above
    check_cache_out_of_reach([str(tmp_path / "docs"), str(tmp_path / "docs" / "0.txt")])
    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path))  # the data inside the cache: the cache's files are not read
    check_cache_out_of_reach([str(tmp_path / "docs")])


def test_a_tokenizer_wider_than_the_model_is_refused_before_any_text_is_tokenized(tokenizer_text, tmp_path, capsys,
                                                                                  monkeypatch):
    """The built-in corpus takes minutes to tokenize with a user's tokenizer: its size is held against
    the model's rows as it is loaded, not after the whole corpus is read."""
    import pipezero.data
    import pipezero.engine

    def never(*_: object) -> None:
        raise AssertionError("the corpus was read before the tokenizer's size was checked")

    monkeypatch.setattr(pipezero.data, "load_corpus", never)
    monkeypatch.setattr(pipezero.engine, "load_corpus", never)
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps(tokenizer_with(tokenizer_text, lambda t: t["model"]["vocab"].update(e=70000))))
    argv = ["train", "--preset", "tiny", "--tokenizer", str(wide), "--max-steps", "1", "--out", str(tmp_path / "out")]
    assert_one_line(*run_main(argv, capsys), "the tokenizer has 70001 tokens but the model only 4096 rows")
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_with_an_empty_vocabulary_is_named(tokenizer_text, tmp_path):
    """Every text would encode to nothing; the corpus would then be blamed for holding no tokens."""
    from pipezero.data.tokenizer import BPETokenizer

    def empty(t: dict) -> None:
        t["model"]["vocab"], t["model"]["merges"] = {}, []  # the end-of-text token is left: it matches no text

    path = tmp_path / "empty.json"
    path.write_text(json.dumps(tokenizer_with(tokenizer_text, empty)))
    with pytest.raises(ConfigError, match=r"empty.json' encodes text to no tokens \(its vocabulary holds 0\)"):
        BPETokenizer.from_file(path)


def test_a_tokenizer_file_named_without_json_is_told_to_be_renamed(tokenizer_text, tmp_path, capsys):
    """A tokenizer.json saved under another name was told to use "a tokenizer.json path", which it is."""
    path = tmp_path / "my-tokenizer"
    path.write_text(tokenizer_text)
    argv = [*TINY_FLAGS[:2], "--tokenizer", str(path), "--max-steps", "1", "--out", str(tmp_path / "out")]
    assert_one_line(*run_main(["train", *argv], capsys),
                    f"--tokenizer (data.tokenizer) {str(path)!r} is a file, and pipezero reads a tokenizer file only "
                    f"by a name ending .json: rename it")
    assert not (tmp_path / "out").exists()


def _without_root_rights(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """`pipezero <argv>` as a user whom file modes bind: root lets itself read anything, so as root
    it runs without the rights that override modes (setpriv drops them from its bounding set)."""
    import sys

    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("root here, and no setpriv to drop root's rights over file modes")
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else []
    return subprocess.run([*drop, sys.executable, "-m", "pipezero.cli", *argv], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.distributed  # as a user file modes bind: a process of its own
def test_data_this_user_cannot_read_is_one_line_before_anything_runs(docs, tmp_path):
    """A document without read rights was tokenized and then said as a write refused ("cannot be
    written ... free space"), exit 1; a folder that cannot be listed (or one under it) was passed by in
    silence: "holds no document files", or a corpus without its files."""
    shut = tmp_path / "docs"
    shutil.copytree(docs, shut)
    one, inner = shut / "00.txt", shut / "inner"
    inner.mkdir()
    (inner / "more.txt").write_text("text the search passed by\n" * 50)
    try:
        one.chmod(0)
        done = _without_root_rights(train_argv(None, one, tmp_path / "out", "--tokenizer", "bytes"))
        assert_one_line(done.returncode, done.stderr,
                        f"--data file '{one}' cannot be read (Permission denied): make it readable")
        one.chmod(0o644)
        inner.chmod(0)
        done = _without_root_rights(train_argv(None, shut, tmp_path / "out", "--tokenizer", "bytes"))
        assert_one_line(done.returncode, done.stderr,
                        f"--data '{shut}': the folder '{inner}' cannot be read (Permission denied)")
    finally:
        one.chmod(0o644)
        inner.chmod(0o755)
    assert not (tmp_path / "out").exists()
