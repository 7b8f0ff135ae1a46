"""Bring your own model: Hugging Face llama, mistral and qwen2 folders, made here at random with
transformers (nothing downloaded), load into pipezero with transformers' logits, train on every
layout like one process and like transformers + torch AdamW, and export back to a folder
transformers loads. Bad folders are one line and exit 2 before any process group."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hf_models import FAMILIES, hf_logits, hf_overrides, make_model, pipezero_logits, tokenizer_folder, tokenizer_json
from one_line import run_main
from pipezero.cli import main
from pipezero.config import ModelConfig
from pipezero.errors import ConfigError
from pipezero.settings import build_config
from pipezero.models.hf import from_hf, to_hf
from pipezero.models.hf_weights import expected_shapes

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: make_model(root / family, family) for family in FAMILIES}


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file of `folder` with its size and modification time: to prove nothing wrote there."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_names_map_both_ways() -> None:
    """Every parameter of a model with every optional part has a Hugging Face name and back; a
    tied head reads the embedding."""
    for tied in (False, True):
        cfg = ModelConfig(n_layers=3, qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=tied,
                          pretrained="x")
        names = expected_shapes(cfg)
        hf = {n: to_hf(n, 3, tied) for n in names}
        assert hf["layers.2.attn.wq.bias"] == "model.layers.1.self_attn.q_proj.bias"
        assert hf["layers.3.mlp.w1.weight"] == "model.layers.2.mlp.gate_proj.weight"
        assert hf["layers.4.proj.weight"] == ("model.embed_tokens.weight" if tied else "lm_head.weight")
        for ours, theirs in hf.items():
            assert from_hf(theirs, 3) == (ours if ours != "layers.4.proj.weight" or not tied else "layers.0.weight")
    with pytest.raises(KeyError):
        from_hf("model.layers.3.self_attn.q_proj.weight", 3)  # a 4th block of a 3-block model


def test_tokenizer_takes_eos_from_the_model_config(models: dict[str, Path], tmp_path: Path) -> None:
    """The model's own tokenizer.json, with the end-of-sequence id its config.json names (packing
    puts it between documents), and a cache name of its own when that id is not the guessed one."""
    from pipezero.data.tokenizer import BPETokenizer

    folder = tmp_path / "eos"
    shutil.copytree(models["llama"], folder)
    guessed = BPETokenizer.from_file(folder / "tokenizer.json")
    assert guessed.eos_id == guessed.hf.token_to_id("<|endoftext|>")  # make_model's config names it
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": [7, 8]}))
    named = BPETokenizer.from_file(folder / "tokenizer.json")
    assert named.eos_id == 7 and named.name != guessed.name
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 320}))  # vocab_size 320
    with pytest.raises(ConfigError, match="end-of-sequence id 320 is not a row of the embedding"):
        BPETokenizer.from_file(folder / "tokenizer.json")


def test_documents_tokenize_as_the_models_own_tokenizer(tmp_path: Path) -> None:
    """Each document's ids are what transformers' AutoTokenizer gives for its text (BOS first for a
    BOS-adding Llama tokenizer, none for Qwen2's), then one EOS; rows past a short document hold
    the pad id the model's config files name (config.json, else generation_config.json, else
    tokenizer_config.json's pad_token) and are never targets. A changed BOS or pad setup is a new
    token cache, never the stale one."""
    from transformers import AutoTokenizer

    from pipezero.config import DataConfig, Packing
    from pipezero.data import load_corpus
    from pipezero.data.packing import IGNORE

    texts = [f"def f{i}(x):\n    return x * {i}  # \u00fcn\u00efcode {'word ' * (i % 5)}" for i in range(20)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    folders = {  # name: (folder, the pad id expected, BOS expected)
        "llama": (tokenizer_folder(tmp_path / "llama", "llama", {"config": 3, "generation": 7}, add_bos_token=True),
                  3, True),
        "llama-eos": (tokenizer_folder(tmp_path / "llama-eos", "llama", {"generation": 7}, add_bos_token=True,
                                       add_eos_token=True), 7, True),
        "qwen2": (tokenizer_folder(tmp_path / "qwen2", "qwen2", {}, pad_token="<|pad|>"), None, False),
    }

    def corpus(folder: Path):  # noqa: ANN202
        return load_corpus(DataConfig(path=[str(data)], tokenizer=str(folder / "tokenizer.json"), seq_len=64,
                                      heldout_fraction=0.1, packing=Packing.NONE))

    for name, (folder, pad, bos) in folders.items():
        theirs = AutoTokenizer.from_pretrained(folder)
        eos = theirs.eos_token_id
        want = [ids if ids[-1] == eos else [*ids, eos] for ids in theirs(texts)["input_ids"]]
        assert all((ids[0] == theirs.bos_token_id) == bos for ids in want), name
        assert sum(ids.count(eos) for ids in want) == len(texts), name  # one EOS a document, never two
        c = corpus(folder)
        (train, held), tokens = (s.docs for s in c.samples), (c.train, c.heldout)
        got = [np.asarray(t[o[d]:o[d + 1]]).tolist() for t, docs in zip(tokens, (train, held))
               for o in [docs.offsets] for d in range(docs.n_docs)]
        assert got == [w for i, w in enumerate(want) if i % 10 != 9] + want[9::10], name
        pad = pad if pad is not None else theirs.convert_tokens_to_ids("<|pad|>")
        assert c.samples[0].pad_id == pad, name
        x, y = c.samples[0].rows(np.arange(train.n_docs))
        n = np.diff(train.offsets)  # each row: its document, then padding that is never a target
        for r in range(train.n_docs):
            assert (x[r, n[r]:] == pad).all() and (y[r, n[r] - 1:] == IGNORE).all()
            assert (y[r, :n[r] - 1] != IGNORE).all()
    # what changes the ids or the padding changes the cache: BOS off, another pad id
    folder = folders["llama"][0]
    before = corpus(folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    a, b = ({"Sequence": {"id": s, "type_id": i}} for i, s in enumerate("AB"))
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [a], "pair": [a, b], "special_tokens": {}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    no_bos = corpus(folder)
    assert no_bos.tokenizer.name != before.tokenizer.name
    assert no_bos.train[0] != 1 and no_bos.samples[0].docs.offsets[1] == before.samples[0].docs.offsets[1] - 1
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "pad_token_id": 5}))
    repadded = corpus(folder)
    assert repadded.samples[0].pad_id == 5 and repadded.tokenizer.name != no_bos.tokenizer.name
    (folder / "config.json").write_text(json.dumps({**config, "pad_token_id": 320}))
    with pytest.raises(ConfigError, match="padding id 320 is not a row of the embedding"):
        corpus(folder)


def test_tokenizer_files_truncation_and_padding_are_not_applied(tmp_path: Path) -> None:
    """A tokenizer.json saved with truncation or padding switched on (`enable_truncation` and
    `enable_padding` persist in the file) still gives each document whole and unpadded, as
    AutoTokenizer does when called without truncation or padding: never cut at max_length, never
    padded to the longest document of a batch."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from pipezero.data.tokenizer import BPETokenizer

    path = tmp_path / "tokenizer.json"
    tokenizer_json(path)
    texts = ["def f(x):\n    return x * 2  # a document longer than eight tokens", "x"]
    whole = BPETokenizer.from_file(path)
    hf = Tokenizer.from_file(str(path))
    hf.enable_truncation(max_length=8)
    hf.enable_padding(pad_id=0)
    hf.save(str(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path)(texts)["input_ids"]
    ours = BPETokenizer.from_file(path)
    assert ours.encode_many(texts) == whole.encode_many(texts) == theirs
    assert len(theirs[0]) > 8
    assert ours.name == whole.name  # the same tokens: the same token cache


def test_logits_equal_transformers(models: dict[str, Path]) -> None:
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))  # > the windows of 8
    diffs = {f: (hf_logits(d, tokens) - pipezero_logits(d, tokens)).abs().max().item() for f, d in models.items()}
    assert all(d <= 1e-5 for d in diffs.values()), diffs


def test_qwen2_window_layers_follow_layer_types(models: dict[str, Path], tmp_path: Path) -> None:
    """Qwen2's window applies to the blocks layer_types calls sliding_attention (blocks 3-6 of the
    qwen2-window model, whose logits equal transformers' above); a config.json without
    layer_types (transformers 4) gives the same blocks from max_window_layers; without
    use_sliding_window no block has one."""
    from pipezero.models.hf import model_fields

    folder = tmp_path / "older"
    shutil.copytree(models["qwen2-window"], folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"][2:4] == ["full_attention", "sliding_attention"]
    assert (model_fields(folder)["sliding_window"], model_fields(folder)["window_layers"]) == (8, [3, 4, 5, 6])
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "layer_types"}))
    assert model_fields(folder)["window_layers"] == [3, 4, 5, 6]
    (folder / "config.json").write_text(json.dumps({**config, "use_sliding_window": False}))
    assert model_fields(folder)["sliding_window"] is None
    (folder / "config.json").write_text(json.dumps({**config, "layer_types": ["sliding_attention"] * 3}))
    with pytest.raises(ConfigError, match="field 'layer_types' must list"):
        model_fields(folder)
    windowed = pipezero_logits(models["qwen2-window"], tokens := torch.randint(0, 300, (1, 24)))
    (folder / "config.json").write_text(json.dumps({**config, "use_sliding_window": False}))
    assert (pipezero_logits(folder, tokens) - windowed).abs().max() > 1e-3  # the window matters at T=24


def test_sliding_window_holds_with_document_masks() -> None:
    """Packed documents keep Mistral's window: a row of one document gives the same output through
    the document-mask path as through the plain causal one (which matches transformers above), and
    the window changes the output once a row is longer than it."""
    from pipezero.models.llama import Attention, DocMask

    torch.manual_seed(0)
    windowed = Attention(ModelConfig(dim=32, n_heads=4, n_kv_heads=2, sliding_window=5))
    x = torch.randn(2, 12, 32)
    one_doc = DocMask.of(torch.zeros(2, 12, dtype=torch.long))
    with torch.no_grad():
        plain, masked = windowed(x), windowed(x, one_doc)
        full = Attention(ModelConfig(dim=32, n_heads=4, n_kv_heads=2))
        full.load_state_dict(windowed.state_dict())
        assert (plain - masked).abs().max() <= 1e-6
        assert (plain - full(x)).abs().max() > 1e-3


@pytest.mark.distributed  # full lane: seconds of one-process training or planning
def test_training_equals_transformers_with_adamw(models: dict[str, Path], text_dir: Path, tmp_path: Path) -> None:
    """K steps of pipezero (one process) = K steps of the transformers model with torch's AdamW:
    decay on matrices only (pipezero decays tensors of 2+ dimensions), global-norm clipping, the
    same warm-up + cosine rate, the same batches (concat packing: plain causal attention)."""
    from transformers import AutoModelForCausalLM

    from pipezero.data import load_corpus
    from pipezero.engine import train
    from pipezero.optim import lr_at

    for family in ("llama", "qwen2"):  # biased and untied; tied
        cfg = build_config(None, hf_overrides(models[family], str(text_dir), str(tmp_path / family),
                                              **{"data.packing": "concat"}))
        ours = train(cfg).losses
        corpus, o, g = load_corpus(cfg.data), cfg.optim, cfg.global_batch
        model = AutoModelForCausalLM.from_pretrained(models[family], dtype=torch.float32)
        params = [p for p in model.parameters()]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
        theirs = []
        for step in range(cfg.run.max_steps):
            x, y = corpus.batch(step, step * g, cfg.run.seed, g, cfg.data.seq_len)[:2]
            loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten(), reduction="sum") / (y != -100).sum()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, o, cfg.run.max_steps)
            opt.step()
            theirs.append(loss.item())
        rel = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
        assert max(rel) <= 1e-5, (family, ours, theirs, rel)


def layout_cases() -> list[dict]:
    """Layouts of 4 ranks: every ZeRO stage at P = 2, D = 2 (split and fused backward), every
    schedule at P = 4 (the fewest micro-batches it allows, of 4 and 8)."""
    from pipezero.config import ScheduleKind as K
    from pipezero.schedules.registry import check_layout, default_virtual

    v_of = {kind: default_virtual(kind) for kind in K}
    cases: list[dict] = [{"parallel.pp": 2, "parallel.dp": 2, "parallel.zero": z, "parallel.schedule": s}
                         for z, s in ((0, "1f1b"), (1, "zb-h1"), (2, "gpipe"), (3, "zb-h1"))]
    for kind in K:
        m = next(m for m in (4, 8) if _allowed(check_layout, kind, m, v_of.get(kind, 1)))
        cases.append({"parallel.pp": 4, "parallel.dp": 1, "parallel.schedule": kind.value,
                      "parallel.microbatches": m, "parallel.virtual_stages": v_of.get(kind, 1)})
    return cases


def _allowed(check, kind, m: int, v: int) -> bool:  # noqa: ANN001
    try:
        check(kind, 4, m, v)
    except ValueError:
        return False
    return True


def train_layouts(rank: int, world: int, folder: str, data: str, out: str, cases: list[dict]) -> list[list[float]]:
    """The losses of each case's two steps, trained in this process group."""
    from pipezero.engine import train

    return [train(build_config(None, hf_overrides(Path(folder), data, f"{out}/{i}", **{"run.max_steps": 2, **c})))
            .losses for i, c in enumerate(cases)]


@pytest.mark.distributed
@pytest.mark.slow(28)
def test_every_layout_equals_one_process(models: dict[str, Path], text_dir: Path, tmp_path: Path) -> None:
    """A loaded llama (7 blocks: neither 2 nor 4 divides its 9 layers; biases through split
    backward) has the first-step loss of one process on P in {2, 4}, D in {1, 2}, ZeRO 0-3 and
    every schedule, and the second step's (which its gradients and the optimizer step decide):
    one spawned group of 4 runs them all."""
    from pipezero.engine import train
    from ranks import run_ranks

    folder, data = models["llama"], str(text_dir)
    cases = layout_cases()
    refs: dict[int, list[float]] = {}  # first, so the ranks find the corpus tokenized in the cache
    for case in cases:
        m = case.get("parallel.microbatches", 2) * case.get("parallel.dp", 1)  # the same global batch
        if m not in refs:
            refs[m] = train(build_config(None, hf_overrides(folder, data, str(tmp_path / f"ref{m}"), **{
                "run.max_steps": 2, "parallel.microbatches": m}))).losses
    per_rank = run_ranks(train_layouts, 4, str(folder), data, str(tmp_path), cases, timeout=600)
    for rank, got in enumerate(per_rank):
        for case, losses in zip(cases, got):
            ref = refs[case.get("parallel.microbatches", 2) * case.get("parallel.dp", 1)]
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref)), (rank, case, losses, ref)


@pytest.mark.distributed  # full lane: seconds of one-process training or planning
def test_export_hf_loads_in_transformers(models: dict[str, Path], text_dir: Path, tmp_path: Path) -> None:
    """A fine-tuned qwen2 (tied) and a built-in preset run export as folders transformers loads,
    in shards with an index, with the input's config keys and tokenizer; logits equal ours."""
    from transformers import AutoModelForCausalLM

    from pipezero.checkpoint.export import read_model
    from pipezero.checkpoint.store import committed

    folder = models["qwen2"]
    before = tree(folder)
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    tokenizer_json(tok)
    runs = {"qwen2": ["--model", str(folder)], "preset": ["--preset", "tiny", "--tokenizer", str(tok)]}
    for name, flags in runs.items():
        run, out = tmp_path / f"run-{name}", tmp_path / f"export-{name}"
        assert main(["train", *flags, "--data", str(text_dir), "--seq-len", "16", "--max-steps", "2",
                     "--checkpoint-every", "2", "--out", str(run), "--no-progress", "--sample-tokens", "0",
                     "--microbatches", "2", "--micro-batch-size", "2"]) == 0
        assert main(["export", str(run), "--format", "hf", "--out", str(out), "--shard-size", "40KB"]) == 0
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1, "expected several shards"
        assert (out / "tokenizer.json").is_file()
        exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ours = read_model(committed(run / "checkpoints")[-1][1]).eval()
        with torch.no_grad():
            diff = (exported(tokens).logits - ours(tokens)).abs().max().item()
        assert diff <= 1e-5, (name, diff)
        if name == "qwen2":
            assert set(json.loads((out / "config.json").read_text())) == set(json.loads((folder / "config.json").read_text()))
        else:
            assert exported.config.model_type == "llama"
    assert tree(folder) == before, "the model folder was written to"


def test_export_keeps_the_chat_template(models: dict[str, Path], text_dir: Path, tmp_path: Path) -> None:
    """transformers 5 saves a tokenizer's chat template as chat_template.jinja beside
    tokenizer_config.json: the export of a fine-tuned chat model keeps it, so apply_chat_template
    gives on the export what it gave on the input."""
    from transformers import AutoTokenizer

    folder = tmp_path / "chat"
    shutil.copytree(models["qwen2"], folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(folder)
    assert (folder / "chat_template.jinja").is_file()
    run, out = tmp_path / "run", tmp_path / "export"
    assert main(["train", "--model", str(folder), "--data", str(text_dir), "--seq-len", "16", "--max-steps", "1",
                 "--checkpoint-every", "1", "--out", str(run), "--no-progress", "--sample-tokens", "0",
                 "--microbatches", "1", "--micro-batch-size", "1"]) == 0
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    chat = [{"role": "user", "content": "hi"}]
    assert (AutoTokenizer.from_pretrained(out).apply_chat_template(chat, tokenize=False)
            == tok.apply_chat_template(chat, tokenize=False) == "<|user|>hi")
    # an export onto a folder that holds files (here the model it started from) is refused, the
    # folder untouched; nothing half-written is left beside it
    before = tree(folder)
    assert main(["export", str(run), "--format", "hf", "--out", str(folder)]) == 2
    assert tree(folder) == before and not list(tmp_path.glob(".*.tmp"))


def test_export_of_a_moved_checkpoint(models: dict[str, Path], text_dir: Path, tmp_path: Path, capsys) -> None:
    """A checkpoint folder copied away from its run (so without RUN/hf) of a qwen2 (q/k/v biases, a
    model no Llama config describes) exports with the model folder's own config, logits equal to
    ours; with that folder gone too, the export is refused in one line, never written as a Llama."""
    from transformers import AutoModelForCausalLM

    from pipezero.checkpoint.export import read_model

    folder = tmp_path / "qwen2"
    shutil.copytree(models["qwen2"], folder)
    run = tmp_path / "run"
    assert main(["train", "--model", str(folder), "--data", str(text_dir), "--seq-len", "16", "--max-steps", "1",
                 "--checkpoint-every", "1", "--out", str(run), "--no-progress", "--sample-tokens", "0",
                 "--microbatches", "1", "--micro-batch-size", "1"]) == 0
    moved = tmp_path / "moved"
    shutil.copytree(run / "checkpoints" / "step-00000001", moved)
    assert main(["export", str(moved), "--format", "hf", "--out", str(tmp_path / "export")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (exported(tokens).logits - read_model(moved).eval()(tokens)).abs().max().item() <= 1e-5
    assert exported.config.model_type == "qwen2"
    shutil.rmtree(folder)
    capsys.readouterr()
    assert main(["export", str(moved), "--format", "hf", "--out", str(tmp_path / "export2")]) == 2
    err = capsys.readouterr().err
    assert f"was trained from --model {folder}" in err and err.count("\n") == 1, err
    assert not (tmp_path / "export2").exists()


def test_bad_folders_are_one_line_exit_2(models: dict[str, Path], text_dir: Path, tmp_path: Path, capsys) -> None:
    from safetensors.torch import load_file, save_file

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(models["llama"], dst)
        return dst

    def edit_config(folder: Path, **changes: object) -> Path:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
        return folder

    def edit_weights(folder: Path, fn) -> Path:
        tensors = load_file(folder / "model.safetensors")
        fn(tensors)
        save_file(tensors, folder / "model.safetensors")
        return folder

    def misindexed() -> Path:  # two shards; the index names the wrong one for one tensor
        folder = copy("misindexed")
        tensors = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        names = sorted(tensors)
        halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        weight_map = {}
        for file, group in halves.items():
            save_file({n: tensors[n] for n in group}, folder / file)
            weight_map.update(dict.fromkeys(group, file))
        weight_map[names[0]] = "model-00002-of-00002.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        return folder

    (missing_config := copy("no-config")).joinpath("config.json").unlink()
    (missing_weights := copy("no-weights")).joinpath("model.safetensors").unlink()
    big_tok = copy("big-tokenizer")
    tokenizer_json(big_tok / "tokenizer.json", vocab=400)  # config.json: vocab_size 320
    cases = {
        "nowhere": (tmp_path / "nowhere", [], "not a folder"),
        "config": (missing_config, [], "config.json does not exist"),
        "weights": (missing_weights, [], "model.safetensors does not exist"),
        "type": (edit_config(copy("gpt2"), model_type="gpt2"), [], "model_type 'gpt2' is not supported; supported: llama, mistral, qwen2"),
        "shape": (edit_weights(copy("shape"), lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(47, 32)})),
                  [], "tensor 'model.layers.2.mlp.up_proj.weight' has shape [47, 32]"),
        "missing": (edit_weights(copy("missing"), lambda t: t.pop("model.layers.6.self_attn.k_proj.bias")),
                    [], "tensor 'model.layers.6.self_attn.k_proj.bias' is missing"),
        "tokenizer": (big_tok, [], "has 400 tokens but config.json's vocab_size is 320"),
        "index": (misindexed(), [], "model.safetensors.index.json puts tensor 'lm_head.weight' in "
                                    "model-00002-of-00002.safetensors, which does not hold it"),
        "stages": (models["llama"], ["--pp", "16"], "pp x virtual-stages = 16 stage chunks but the model has only 9 layers"),
    }
    for name, (folder, flags, message) in cases.items():
        before = tree(folder) if folder.exists() else None
        code = main(["train", "--model", str(folder), "--data", str(text_dir), "--out", str(tmp_path / "out"), *flags])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (name, code, err)
        assert (tree(folder) if folder.exists() else None) == before, name
    assert not (tmp_path / "out").exists()  # refused before a run directory or process group


def test_a_manifest_tokenizer_path_copies_only_the_tokenizer_the_run_read(tmp_path: Path) -> None:
    """A built-in run's export copies the tokenizer.json its checkpoint names; a manifest is data, so a
    path in it naming some other local .json file, a missing one, or a tokenizer whose content is not
    the one the run trained with, copies nothing, and says why."""
    from pipezero.data.identity import tokenizer_file_of
    from pipezero.data.tokenizer import BPETokenizer

    real, other, changed = tmp_path / "tok.json", tmp_path / "secrets.json", tmp_path / "changed.json"
    BPETokenizer.train(["some text to learn from"] * 4, 300).hf.save(str(real))
    BPETokenizer.train(["other text entirely"] * 4, 280).hf.save(str(changed))
    other.write_text('{"token": "not a tokenizer"}')
    name = BPETokenizer.from_file(real).name
    assert tokenizer_file_of({"tokenizer": name, "tokenizer_file": str(real)})[0] == real
    for file, why in ((other, "is no longer a tokenizer.json"), (tmp_path / "missing.json", "is gone"),
                      (changed, "changed since the run read it")):
        copied, said = tokenizer_file_of({"tokenizer": name, "tokenizer_file": str(file)})
        assert copied is None and said.startswith("no tokenizer: ") and why in said, said


def test_weights_with_more_blocks_than_config_json_train_the_first_with_a_warning(tmp_path, capsys):
    """transformers warns of the weights it leaves unread; pipezero says so too."""
    import json

    from hf_models import make_model

    folder = make_model(tmp_path / "m", "llama")
    cfg = json.loads((folder / "config.json").read_text())
    held = cfg["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": held - 1}))
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"{i}.txt").write_text(f"some words to train on, {i} " * 20)
    code, err = run_main(["train", "--model", str(folder), "--data", str(docs), "--seq-len", "16", "--max-steps", "1",
                          "--no-progress", "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
    assert f"num_hidden_layers = {held - 1}, but the weights hold {held} blocks: the run trains blocks 0-{held - 2}" in err


def test_an_export_ships_the_tokenizer_the_run_read_and_says_what_it_holds(trained_run, tmp_path, monkeypatch, capsys):
    """A run's settings hold --tokenizer as typed (relative to where it started); an export from
    another folder found a different tok.json there, or none. It ships the file the run read, checked
    against the content it trained with, and says in one line what the folder holds, or why no
    tokenizer (a bytes run)."""
    from pipezero.data.tokenizer import BPETokenizer
    from tiny_runs import TRAIN_TINY_SMALLEST

    started, elsewhere = tmp_path / "started", tmp_path / "elsewhere"
    started.mkdir()
    elsewhere.mkdir()
    BPETokenizer.train(["the quick brown fox jumps"] * 4, 300).hf.save(str(started / "tok.json"))
    BPETokenizer.train(["another text entirely"] * 4, 280).hf.save(str(elsewhere / "tok.json"))
    monkeypatch.chdir(started)
    assert main([*TRAIN_TINY_SMALLEST, "--tokenizer", "tok.json", "--data", str(trained_run.parent / "docs"),
                 "--out", str(tmp_path / "run")]) == 0
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert f"tokenizer.json: the run's, from {started / 'tok.json'}" in capsys.readouterr().out
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (started / "tok.json").read_bytes()
    assert main(["export", str(trained_run), "--format", "hf", "--out", str(tmp_path / "bytes")]) == 0
    assert "no tokenizer: the run used --tokenizer bytes" in capsys.readouterr().out
    assert not (tmp_path / "bytes" / "tokenizer.json").exists()
