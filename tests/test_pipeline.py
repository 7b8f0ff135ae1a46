"""Central test: every schedule, on several layouts, trains the same model as one process does."""

from __future__ import annotations

import pytest
import torch

from dist import run_ranks
from pipezero.config import ScheduleKind as K
from pipezero.config import build_config

V_OF = {K.INTERLEAVED_1F1B: 2, K.LOOPED_BFS: 2, K.ZB_V: 2, K.DUALPIPE_V: 2}
STEPS = 5


def tiny_overrides(data: str, out: str, pp: int, dp: int, kind: K, m: int) -> dict:
    return {
        "model.preset": "tiny", "model.n_layers": 6, "model.dim": 64, "model.n_heads": 4, "model.vocab_size": 256,
        "data.path": data, "data.tokenizer": "bytes", "data.seq_len": 32,
        "parallel.pp": pp, "parallel.dp": dp, "parallel.schedule": kind.value, "parallel.microbatches": m,
        "parallel.micro_batch_size": 2, "parallel.virtual_stages": V_OF.get(kind, 1) if pp > 1 else 1,
        "parallel.timeout_s": 60.0,
        "run.max_steps": STEPS, "run.out": out, "run.progress": False, "run.sample_tokens": 0, "run.eval_every": 0,
        "run.eval_batches": 1, "optim.warmup_steps": 2, "optim.lr": 1e-2,
    }


def layouts(pp: int, dp: int) -> list[tuple[K, int]]:
    """Every schedule with M in {P, 2P, 3P+1} where the schedule allows it."""
    from pipezero.schedules.registry import check_layout

    cases = []
    for kind in K:
        for m in (pp, 2 * pp, 3 * pp + 1):
            try:
                check_layout(kind, pp, m, V_OF.get(kind, 1))
            except ValueError:
                continue
            cases.append((kind, m))
    return cases


def train_layouts(rank: int, world: int, data: str, out: str, pp: int, dp: int, cases: list) -> list:
    from pipezero.engine import train

    results = []
    for kind, m in cases:
        cfg = build_config(None, tiny_overrides(data, f"{out}/{kind.value}-{m}", pp, dp, kind, m))
        res = train(cfg)
        results.append((kind, m, res.losses, res.params, res.peak_live))
    return results


def reference(data: str, out: str, global_mb: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    from pipezero.engine import train

    res = train(build_config(None, tiny_overrides(data, out, 1, 1, K.ONE_F_ONE_B, global_mb)))
    return res.losses, res.params


def assert_same_training(results: list, dp: int, data: str, tmp_path) -> None:
    refs: dict[int, tuple] = {}
    for per_rank in zip(*results):
        kind, m = per_rank[0][0], per_rank[0][1]
        if m * dp not in refs:
            refs[m * dp] = reference(data, str(tmp_path / f"ref{m * dp}"), m * dp)
        ref_losses, ref_params = refs[m * dp]
        for rank_result in per_rank:
            assert rank_result[2] == pytest.approx(ref_losses, rel=1e-5), (kind, m)
        merged: dict[str, torch.Tensor] = {}
        for rank_result in per_rank:
            merged.update(rank_result[3])
        assert set(merged) == set(ref_params), (kind, m)
        for name, value in merged.items():
            # Relative error of the whole tensor: Adam turns rounding noise in a near-zero gradient
            # element into a ~1e-6 step of that element alone, so element-wise ratios near zero
            # are noise, while the tensor's error measures whether the same model was trained.
            ref = ref_params[name]
            rel = float((value - ref).norm() / ref.norm())
            assert rel <= 1e-5, f"{kind.value} M={m} {name}: relative error {rel:.2e}"

def test_two_ranks_every_schedule_matches_one_process(text_dir, tmp_path):
    cases = layouts(2, 1)
    results = run_ranks(train_layouts, 2, str(text_dir), str(tmp_path), 2, 1, cases, timeout=600)
    assert_same_training(results, 1, str(text_dir), tmp_path)
    # measured peak live activations equal the simulator's in-flight count
    from pipezero.schedules.check import simulate
    from pipezero.schedules.generators import build_schedule

    for rank, per_rank in enumerate(results):
        for kind, m, _, _, peak in per_rank:
            assert peak == simulate(build_schedule(kind, 2, m, V_OF.get(kind, 1))).peak_activations[rank], (kind, m)


def train_many(rank: int, world: int, data: str, out: str, plan: list) -> list:
    """Several (pp, dp, cases) layouts in one process group: spawning costs more than training."""
    return [train_layouts(rank, world, data, f"{out}/{pp}x{dp}", pp, dp, cases) for pp, dp, cases in plan]


def test_data_parallel_two_ranks_matches_one_process(text_dir, tmp_path):
    plan = [(1, 2, [(K.ONE_F_ONE_B, 1), (K.ONE_F_ONE_B, 3)])]
    results = run_ranks(train_many, 2, str(text_dir), str(tmp_path), plan, timeout=300)
    assert_same_training([r[0] for r in results], 2, str(text_dir), tmp_path)


@pytest.mark.slow
def test_four_ranks_every_schedule_pp2_dp2_and_pp4(text_dir, tmp_path):
    plan = [(2, 2, layouts(2, 2)), (4, 1, layouts(4, 1))]
    results = run_ranks(train_many, 4, str(text_dir), str(tmp_path), plan, timeout=900)
    for i, (pp, dp, _) in enumerate(plan):
        assert_same_training([r[i] for r in results], dp, str(text_dir), tmp_path)


@pytest.mark.slow
def test_eight_ranks_pp4_dp2(text_dir, tmp_path):
    cases = layouts(4, 2)
    results = run_ranks(train_many, 8, str(text_dir), str(tmp_path), [(4, 2, cases)], timeout=900)
    assert_same_training([r[0] for r in results], 2, str(text_dir), tmp_path)


@pytest.mark.slow
def test_cli_nproc_launches_through_torchrun(text_dir, tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "pipezero.cli", "train", "--nproc", "2", "--pp", "2", "--dp", "1",
           "--schedule", "zb-h1", "--microbatches", "4", "--data", str(text_dir), "--tokenizer", "bytes",
           "--seq-len", "32", "--max-steps", "6", "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 7))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layout"]["pp"] == 2 and summary["layout"]["schedule"] == "zb-h1"
    assert summary["peak_live_activations"]["measured"] == summary["peak_live_activations"]["simulated"]
