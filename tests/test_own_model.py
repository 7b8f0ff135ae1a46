"""A model of the user's own through the ModelSpec protocol: examples/own_model.py's GPT-style decoder
pipelines (P=2, D=2, ZeRO-2, zb-h1) to the same training as one process; split backward's W rules
for torch's own weighted modules equal autograd's."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # spawned ranks inherit it

import own_model  # noqa: E402

from pipezero.checkpoint.export import read_model  # noqa: E402
from pipezero.config import DType  # noqa: E402
from pipezero.models import build_chunk  # noqa: E402
from pipezero.models.llama import RMSNorm  # noqa: E402
from pipezero.parallel.mesh import Mesh  # noqa: E402
from pipezero.parallel.spawn import run_ranks  # noqa: E402
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
