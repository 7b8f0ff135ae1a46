"""Shared by the distributed training tests: a tiny model config and the one-process comparison."""

from __future__ import annotations

from typing import Any

import torch

from pipezero.config import ScheduleKind as K
from pipezero.config import build_config

V_OF = {K.INTERLEAVED_1F1B: 2, K.LOOPED_BFS: 2, K.ZB_V: 2, K.DUALPIPE_V: 2}
STEPS = 5
# With tied embeddings at lr 1e-2, two one-process runs that differ only in how the batch is cut
# into micro-batches (summation order) already end 8e-5 apart (relative, attention weights: Adam
# amplifies rounding in their near-zero early gradients); at 1e-3 that floor is 1.4e-6, so the
# 1e-5 comparison below means something. Measured with tests' tiny model, 5 steps.
TIED_LR = {"optim.lr": 1e-3}


def tiny_overrides(data: str, out: str, pp: int, dp: int, kind: K, m: int, **extra: Any) -> dict:
    base = {
        "model.preset": "tiny", "model.n_layers": 6, "model.dim": 64, "model.n_heads": 4, "model.vocab_size": 256,
        "data.path": data, "data.tokenizer": "bytes", "data.seq_len": 32,
        "parallel.pp": pp, "parallel.dp": dp, "parallel.schedule": kind.value, "parallel.microbatches": m,
        "parallel.micro_batch_size": 2, "parallel.virtual_stages": V_OF.get(kind, 1) if pp > 1 else 1,
        "parallel.timeout_s": 60.0, "parallel.bucket_mb": 0.05,  # several buckets even for a tiny model
        "run.max_steps": STEPS, "run.out": out, "run.progress": False, "run.sample_tokens": 0, "run.eval_every": 0,
        "run.eval_batches": 1, "optim.warmup_steps": 2, "optim.lr": 1e-2,
    }
    base.update(extra)
    return base


def train_cases(rank: int, world: int, data: str, out: str, cases: list[dict]) -> list[dict]:
    """Train each case (keyword arguments of tiny_overrides) in this process group, in order."""
    from pipezero.engine import train

    results = []
    for i, case in enumerate(cases):
        cfg = build_config(None, tiny_overrides(data, f"{out}/case{i}", **case))
        res = train(cfg, snapshot=True)
        results.append({"case": case, "losses": res.losses, "params": res.params, "peak_live": res.peak_live})
    return results


def reference(data: str, out: str, global_mb: int, **model: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    from pipezero.engine import train

    cfg = build_config(None, tiny_overrides(data, out, 1, 1, K.ONE_F_ONE_B, global_mb, **model))
    res = train(cfg, snapshot=True)
    params = dict(res.params)
    if cfg.model.tie_embeddings:  # one tensor serves both ends here; pipelines hold two equal copies
        params[f"layers.{cfg.model.n_layers + 1}.proj.weight"] = params["layers.0.weight"]
    return res.losses, params


def assert_same_training(results: list[list[dict]], data: str, tmp_path) -> None:
    """`results[rank][case]`: every case's losses and merged parameters equal the one-process run."""
    refs: dict[tuple, tuple] = {}
    for per_rank in zip(*results):
        case = per_rank[0]["case"]
        # the same model, optimizer and data, one process
        model = {k: v for k, v in case.items() if k.startswith(("model.", "optim.", "data."))}
        key = (case["m"] * case["dp"], tuple(sorted(model.items())))
        if key not in refs:
            refs[key] = reference(data, str(tmp_path / f"ref{len(refs)}"), key[0], **model)
        ref_losses, ref_params = refs[key]
        for r in per_rank:
            assert r["losses"] == pytest_approx(ref_losses), case
        merged: dict[str, torch.Tensor] = {}
        for r in per_rank:
            merged.update(r["params"])
        assert set(merged) == set(ref_params), case
        for name, value in merged.items():
            # Relative error of the whole tensor: Adam turns rounding noise in a near-zero gradient
            # element into a ~1e-6 step of that element alone, so element-wise ratios near zero
            # are noise, while the tensor's error measures whether the same model was trained.
            ref = ref_params[name]
            rel = float((value - ref).norm() / ref.norm())
            assert rel <= 1e-5, f"{case} {name}: relative error {rel:.2e}"


def pytest_approx(values: list[float]):
    import pytest

    return pytest.approx(values, rel=1e-5)
