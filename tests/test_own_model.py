"""A model of the user's own through the ModelSpec protocol: examples/own_model.py's GPT-style decoder
pipelines (P=2, D=2, ZeRO-2, zb-h1) to the same training as one process; split backward's W rules
for torch's own weighted modules equal autograd's."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # spawned ranks inherit it

import own_model  # noqa: E402

from pipezero.errors import ConfigError  # noqa: E402
from pipezero.checkpoint.export import read_model  # noqa: E402
from pipezero.config import DType  # noqa: E402
from pipezero.models import build_chunk  # noqa: E402
from pipezero.models.llama import RMSNorm  # noqa: E402
from pipezero.parallel.mesh import Mesh  # noqa: E402
from ranks import run_ranks  # noqa: E402
from pipezero.runtime.weight_grad import WeightGradCapture, apply_weight_grads  # noqa: E402
from pipezero.verify import TOLERANCES, RankResult, compare_params, compare_steps, failure, relative_error  # noqa: E402


class Scale(nn.Module):
    """y = x * w, a layer of one's own that says its weight's gradient (runtime/weight_grad.OwnWeightGrad)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight

    def weight_grad(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        return (dy * x).reshape(-1, x.shape[-1]).sum(0)


@pytest.mark.parametrize("make", [lambda: nn.LayerNorm(8), lambda: nn.RMSNorm(8, eps=1e-5),
                                  lambda: nn.Embedding(10, 8, padding_idx=1), lambda: nn.Linear(8, 5),
                                  lambda: RMSNorm(8, 1e-5), lambda: Scale(8)])
def test_weight_grad_rules_equal_autograd(make):
    torch.manual_seed(0)
    module = make()
    for p in module.parameters():
        p.data.normal_()  # norms start at weight 1, bias 0: make the rule see general values
    x = torch.randint(0, 10, (3, 7)) if isinstance(module, nn.Embedding) else torch.randn(3, 7, 8)
    y = module(x)
    dy = torch.randn_like(y)
    want = torch.autograd.grad(y, list(module.parameters()), dy)
    apply_weight_grads([(module, x, dy)])
    for p, g in zip(module.parameters(), want):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_a_module_w_cannot_split_is_named():
    block = nn.Sequential(nn.Linear(4, 4), nn.Conv1d(4, 4, 1), nn.LayerNorm(4))
    assert WeightGradCapture(block).unsupported == ["Conv1d"]
    assert WeightGradCapture(build_chunk(own_model.GPTSpec(), 1, 6, seed=0)).supported


def test_spec_names_and_counts_are_the_built_models():
    spec = own_model.GPTSpec()
    model = build_chunk(spec, 0, spec.n_layers + 2, seed=0)
    assert spec.param_names() == [n for n, _ in model.named_parameters()]
    assert spec.layer_param_counts() == [sum(p.numel() for p in m.parameters()) for _, m in model.layer_modules()]


def train_noting_fallback(rank: int, world: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """own_model.train_rank, and the executor's warnings that W fell back to autograd."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = own_model.train_rank(rank, world, overrides)
    return {**out, "fallback": [str(w.message) for w in seen if "split backward keeps" in str(w.message)]}


@pytest.mark.distributed
def test_own_model_pp2_dp2_zero2_zb_h1_matches_one_process(text_dir, tmp_path):
    """One 4-rank group; every replica of every stage against one process of the same global batch,
    with W split for every block (no fallback to autograd)."""
    ref = own_model.train_rank(0, 1, own_model.settings(str(text_dir), str(tmp_path / "one"), 1, 1, microbatches=8))
    four = {**own_model.settings(str(text_dir), str(tmp_path / "four"), 2, 2, microbatches=4),
            "run.checkpoint_every": 5}  # settings() runs 5 steps: one checkpoint, at the end
    per_rank = run_ranks(train_noting_fallback, 4, four, timeout=300)
    ranks = [RankResult(rank, (m := Mesh(2, 2, rank)).pp_rank, m.dp_rank, r["losses"], r["grad_norms"], r["params"])
             for rank, r in enumerate(per_rank)]
    tol = TOLERANCES[DType.FP32]
    checks, problems = compare_params(ranks, ref["params"], tol.params)
    checks += compare_steps(ranks, ref["losses"], ref["grad_norms"], tol)
    bad = problems + [failure(c, ranks) for c in checks if not c.ok]
    assert not bad, "; ".join(bad)
    assert not [w for r in per_rank for w in r["fallback"]]
    saved = read_model(tmp_path / "four" / "checkpoints" / "step-00000005", own_model.GPTSpec())  # by its names
    far = {n: relative_error(p.detach(), ref["params"][n]) for n, p in saved.named_parameters()}
    assert far.keys() == ref["params"].keys() and max(far.values()) < tol.params, far
    assert ref["losses"][-1] < ref["losses"][0]  # it learns


EXAMPLES = str(Path(own_model.__file__).parent)
SPEC = "own_model:GPTSpec"


def spec_toml(tmp_path: Path, data: Path) -> str:
    """A run of own_model's GPTSpec named by `[model] spec`, on bytes tokens of concatenated documents."""
    path = tmp_path / "own.toml"
    path.write_text(f'[model]\nspec = "{SPEC}"\n[data]\npath = ["{data}"]\ntokenizer = "bytes"\nseq_len = 32\n'
                    f'packing = "concat"\n[parallel]\nmicrobatches = 4\nmicro_batch_size = 2\ntimeout_s = 60.0\n'
                    f'[run]\nmax_steps = 2\nprogress = false\nsample_tokens = 0\neval_every = 0\neval_batches = 1\n'
                    f'[optim]\nwarmup_steps = 1\nlr = 0.01\n')
    return str(path)


@pytest.mark.distributed
@pytest.mark.slow(51)
def test_model_spec_from_the_command_line(text_dir, tmp_path, monkeypatch, capsys):
    """`[model] spec` (`--model-spec`) names examples/own_model.py's GPTSpec: `pipezero verify` trains
    it at pp=2 on two ranks torchrun starts (which import it themselves) and finds every rank equal
    to one process; `pipezero train` at pp=2 trains the same and checkpoints it, and `pipezero
    export` rebuilds it from the run's settings, with the spec's sizes in its config.json; the
    Hugging Face format refuses it."""
    from pipezero.checkpoint.export import load_exported
    from pipezero.cli import main

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (EXAMPLES, os.environ.get("PYTHONPATH")) if p))
    conf = spec_toml(tmp_path, text_dir)
    assert main(["verify", "--config", conf, "--pp", "2", "--nproc", "2", "--steps", "2",
                 "--out", str(tmp_path / "verify")]) == 0
    assert json.loads((tmp_path / "verify" / "verify.json").read_text())["ok"]
    run = tmp_path / "run"
    assert main(["train", "--config", conf, "--pp", "2", "--nproc", "2", "--out", str(run),
                 "--checkpoint-every", "2"]) == 0
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    layout = json.loads((tmp_path / "verify" / "verify.json").read_text())["checks"]
    assert losses == [c["value"] for c in layout if c["what"] == "loss" and c["rank"] == 0]  # the same run
    assert main(["export", str(run), "--out", str(tmp_path / "export"), "--model-spec", SPEC]) == 0
    with pytest.raises(ConfigError, match="name it yourself, --model-spec"):
        load_exported(tmp_path / "export")  # the export's config.json alone chooses no code
    exported = load_exported(tmp_path / "export", SPEC)
    assert isinstance(exported.spec, own_model.GPTSpec)
    saved = read_model(run / "checkpoints" / "step-00000002", own_model.GPTSpec())
    theirs = dict(saved.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in exported.named_parameters())
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (config["spec"], config["n_layers"], config["dim"], config["vocab_size"]) == (SPEC, 4, 64, 256)
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 2
    assert "a model of your own with no Hugging Face form" in capsys.readouterr().err


SPEC_MISTAKES = [  # (flags, what the one line says)
    (["--model-spec", "own_model"], "write MODULE:NAME"),
    (["--model-spec", "no_such_module_here:make"], "no module named 'no_such_module_here' in the working directory"),
    (["--model-spec", "own_model:Nope"], "has no attribute 'Nope'"),
    (["--model-spec", "own_model:GPTShape"], "gives a GPTShape, not a pipezero.models.ModelSpec"),
    (["--model-spec", "own_model:settings"], "settings needs arguments"),
    (["--model-spec", SPEC, "--preset", "small"], "is the whole model; drop --preset"),
    (["--model-spec", SPEC, "--model", "some/folder"], "is the whole model; drop --model"),
    (["--model-spec", SPEC, "--pp", "8"], "8 stage chunks but the model has only 6 layers (embedding + 4 blocks"),
    (["--model-spec", SPEC, "--freeze", "attn"], "--freeze 'attn' matches no parameter; names look like layers.0.tok"),
    (["--model-spec", SPEC, "--seq-len", "256"], "longer than the model allows (max_seq_len=128)"),
    (["--model-spec", SPEC, "--data", "DATA"], "GPTSpec has no doc_mask"),
    (["--model-spec", "my_decoder:two_blocks", "--pp", "5"], "only 4 layers (embedding + 2 blocks + head)"),
    (["--model-spec", SPEC, "--data", "DATA", "--packing", "concat", "--tokenizer", "TOKENIZER", "--nproc", "2",
      "--pp", "2"], "tokens but the model only 256 rows"),  # the launcher's check, before torchrun
    # the fit check has no prediction for a spec's layers: the limit was accepted and read by nothing
    (["--model-spec", SPEC, "--gpu-memory", "1"], "--gpu-memory 1.0 is read only by the fit check"),
]


def test_model_spec_mistakes_are_one_line(text_dir, tmp_path, monkeypatch, capsys):
    """Each mistake with --model-spec is one line naming the fix, exit status 2, before any process
    group; a module in the working directory is found (my_decoder.py, written there)."""
    from test_bad_inputs import assert_one_line, run_main

    from pipezero.data.tokenizer import BPETokenizer

    (tmp_path / "my_decoder.py").write_text("from own_model import GPTShape, GPTSpec\n\n\ndef two_blocks():\n"
                                            "    return GPTSpec(GPTShape(n_layers=2))\n")
    BPETokenizer.train(["hello world, hello tokens"] * 20, 300).hf.save(str(tmp_path / "tokenizer.json"))
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # restored after
    monkeypatch.chdir(tmp_path)
    fill = {"DATA": str(text_dir), "TOKENIZER": str(tmp_path / "tokenizer.json")}
    for flags, needle in SPEC_MISTAKES:
        argv = ["train", *(fill.get(f, f) for f in flags), "--out", str(tmp_path / "out")]
        assert_one_line(*run_main(argv, capsys), needle)
    assert not (tmp_path / "out").exists()


def test_a_spec_deeper_than_the_limit_is_refused_before_its_layers_are_built(monkeypatch):
    """A spec of 5000 blocks had each built and probed (minutes) before model.n_layers' range
    refused it; its depth is said first, no layer built."""
    from pipezero.models.user_spec import load_spec

    built: list[int] = []
    monkeypatch.setattr(own_model.GPTSpec, "build_layer", lambda self, i: built.append(i))
    monkeypatch.setattr(own_model, "deep", lambda: own_model.GPTSpec(own_model.GPTShape(n_layers=5000)), raising=False)
    with pytest.raises(ConfigError, match="has n_layers = 5000: at most 4096 blocks"):
        load_spec("own_model:deep")
    assert built == []
