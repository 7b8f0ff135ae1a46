"""Central test: every schedule, on several layouts, trains the same model as one process does."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from ranks import run_ranks
from pipezero.config import ScheduleKind as K
from training import (STEPS, V_OF, assert_played, assert_same_training, layouts, peer_layouts, train_cases,
                      train_cases_watching_gathers)


def whole_documents(folder) -> dict:
    """Settings for `--packing none` on documents of 2 to 22 bytes-tokens: micro-batches of two rows
    come out 8, 16 or 32 tokens long (tests/test_documents.py checks the cut)."""
    path = folder / "short.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i % 10}" + " x" * (i % 11)}) + "\n" for i in range(400)))
    return {"data.path": str(path), "data.heldout_fraction": 0.1, "data.packing": "none"}


def assert_cut_by_memory(results: list[list[dict]], data: str, out) -> None:
    """Every rank of a `--partition memory` case held the cuts the policy chooses for its settings,
    and they are not uniform's (else the case would test nothing)."""
    from pipezero.settings import build_config
    from pipezero.memory.partition import balance
    from training import tiny_overrides

    cases = [r["case"] for r in results[0] if r["case"].get("parallel.partition") == "memory"]
    assert cases
    for case in cases:
        counts = list(balance(build_config(None, tiny_overrides(data, str(out), **case)), False).counts)
        assert len(set(counts)) > 1, counts
        for per_rank in results:
            (bounds,) = [r["bounds"] for r in per_rank if r["case"] == case]
            assert [b - a for a, b in bounds] == counts, (case, bounds, counts)


@pytest.mark.distributed
@pytest.mark.slow(29)
def test_two_ranks_every_schedule_matches_one_process(text_dir, tmp_path):
    from pipezero.schedules.check import simulate
    from pipezero.schedules.registry import build_schedule

    cases = layouts(2, 1) + peer_layouts(2, 1)
    cases += [{"pp": 2, "dp": 1, "kind": K.INTERLEAVED_1F1B, "m": 5}]  # rounds of 3 and 2: torch refuses M=5
    results = run_ranks(train_cases, 2, str(text_dir), str(tmp_path), cases, timeout=600)
    assert_same_training(results, str(text_dir), tmp_path)
    for rank, per_rank in enumerate(results):  # measured peak live activations = simulated in-flight
        for r in per_rank:
            kind, m = r["case"]["kind"], r["case"]["m"]
            assert r["peak_live"] == simulate(build_schedule(kind, 2, m, V_OF.get(kind, 1))).peak_activations[rank]


@pytest.mark.distributed
@pytest.mark.slow(22)
def test_data_parallel_two_ranks_matches_one_process(text_dir, tmp_path):
    cases = [{"pp": 1, "dp": 2, "kind": K.ONE_F_ONE_B, "m": m} for m in (1, 3)]
    # Activation recomputation and the cost partition change memory and cuts, not the model.
    cases += [{"pp": 2, "dp": 1, "kind": kind, "m": 4, "parallel.recompute": True, "parallel.partition": "cost"}
              for kind in (K.ONE_F_ONE_B, K.ZB_H1)]
    # Memory-balanced cuts over a V placement: (1, 1, 2, 4) layers, not uniform's (2, 2, 2, 2).
    cases += [{"pp": 2, "dp": 1, "kind": K.ZB_V, "m": 4, "parallel.partition": "memory"}]
    # Tied embeddings with the two ends on two ranks (1f1b, zb-h1) and on one rank (zb-v's V).
    cases += [{"pp": 2, "dp": 1, "kind": kind, "m": 4, "model.tie_embeddings": True}
              for kind in (K.ONE_F_ONE_B, K.ZB_H1, K.ZB_V)]
    # Short packed documents: most rows cross document boundaries, whose ids reach every stage.
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"doc {i}: " + "ab cd " * (i % 7)}) + "\n" for i in range(400)))
    cases += [{"pp": 2, "dp": 1, "kind": K.ZB_H1, "m": 4, "data.path": str(docs), "data.heldout_fraction": 0.1}]
    # Whole documents, one a row: each micro-batch as long as its longest document (8, 16 or 32
    # tokens), so activations and gradients of different shapes cross the pipeline in every schedule.
    cases += [{"pp": 2, "dp": 1, "kind": kind, "m": 4, **whole_documents(tmp_path)} for kind in K]
    # ZeRO-3 layer by layer under split backward: what B gathered is released after B and W, as
    # after a fused backward (measured right after every backward action; dp=1 still gathers).
    layerwise = {"parallel.zero": 3, "parallel.zero3_keep_gathered": False}
    cases += [{"pp": 2, "dp": 1, "kind": kind, "m": 4, **layerwise}
              for kind in (K.ONE_F_ONE_B, K.ZB_H1, K.ZB_H2, K.ZB_V, K.DUALPIPE_V)]
    results = run_ranks(train_cases_watching_gathers, 2, str(text_dir), str(tmp_path), cases)
    refs: dict = {}
    assert_same_training(results, str(text_dir), tmp_path, refs)
    assert_cut_by_memory(results, str(text_dir), tmp_path)
    for per_rank in results:
        fused = next(r["peak_gathered"] for r in per_rank if r["case"] == cases[-5])  # 1f1b, layer by layer
        for r in per_rank:
            if r["case"].get("parallel.zero3_keep_gathered") is False:
                assert r["gathered_after_backward"] == 0, r["case"]
                # and inside B and W too: never more gathered at once than a fused backward holds
                assert r["peak_gathered"] <= fused, (r["case"], r["peak_gathered"], fused)
    # The harness compares every replica: one replica of one parameter nudged by 1e-4 (relative) in
    # the first case (pp=1, dp=2) is caught and named, though the other replica is right.
    drifted = copy.deepcopy(results)
    w = drifted[1][0]["params"]["layers.1.attn.wq.weight"]
    w += 1e-4 * w.norm() / w.numel() ** 0.5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match=r"rank 1 \(stage 0, replica 1\) layers\.1\.attn\.wq\.weight"):
        assert_same_training([[r[0]] for r in drifted], str(text_dir), tmp_path, refs)
    for rank in (0, 1):  # a parameter no rank holds: the layout lost it
        del drifted[rank][0]["params"]["layers.2.attn.wq.weight"]
    with pytest.raises(AssertionError, match=r"no rank holds layers\.2\.attn\.wq\.weight"):
        assert_same_training([[r[0]] for r in drifted], str(text_dir), tmp_path, refs)


def heldout_of(rank: int, world: int, data: str, out: str, cases: list[dict]) -> list[dict[int, float]]:
    """Each case's held-out losses (step -> loss) on this rank."""
    from pipezero.engine import train
    from pipezero.settings import build_config
    from training import tiny_overrides

    return [train(build_config(None, tiny_overrides(data, f"{out}/case{i}", **case))).heldout
            for i, case in enumerate(cases)]


@pytest.mark.distributed
def test_the_heldout_loss_is_the_same_for_every_layout(text_dir, tmp_path):
    """The held-out windows follow the global batch only: micro-batches of 1, 2 and 4 sequences,
    over a pipeline or over replicas, evaluate the same windows and report the same loss (a
    replica evaluates its share; the loss is summed over every rank)."""
    from pipezero.engine import train
    from pipezero.settings import build_config
    from training import tiny_overrides

    extra = {"run.eval_every": 2, "run.eval_batches": 2}
    cases = [{"pp": 1, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 1, "parallel.micro_batch_size": 2, **extra},
             {"pp": 2, "dp": 1, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.micro_batch_size": 1, **extra}]
    per_rank = run_ranks(heldout_of, 2, str(text_dir), str(tmp_path), cases, timeout=600)
    one = train(build_config(None, tiny_overrides(str(text_dir), str(tmp_path / "one"), 1, 1, K.ONE_F_ONE_B, 1,
                                                  **{"parallel.micro_batch_size": 4, **extra}))).heldout
    assert sorted(one) == [2, STEPS]  # every second step and the last (training.STEPS: 3)
    for case, results in zip(cases, zip(*per_rank)):
        for rank, heldout in enumerate(results):
            assert sorted(heldout) == sorted(one), (case, rank)
            for step, loss in heldout.items():
                assert abs(loss - one[step]) <= 1e-5 * one[step], (case, rank, step, loss, one[step])


@pytest.mark.distributed
@pytest.mark.slow(63)
def test_four_ranks_every_schedule_pp2_dp2_and_pp4(text_dir, tmp_path):
    from pipezero.schedules.check import simulate
    from pipezero.schedules.registry import build_schedule

    cases = layouts(2, 2) + layouts(4, 1) + peer_layouts(4, 1)
    # A stage with no layer (hence no parameter) passes activations and gradients straight through.
    cases += [{"pp": 4, "dp": 1, "kind": kind, "m": 4, "parallel.stage_layers": [2, 0, 3, 3]}
              for kind in (K.ONE_F_ONE_B, K.ZB_H1)]
    # Memory-balanced cuts (memory/partition.py): (2, 1, 2, 3) layers, not uniform's (2, 2, 2, 2).
    cases += [{"pp": 4, "dp": 1, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.partition": "memory"}]
    # Micro-batches of different lengths through four stages, and through ZeRO 0-3 across replicas.
    cases += [{"pp": 4, "dp": 1, "kind": kind, "m": 4, **whole_documents(tmp_path)}
              for kind in (K.ONE_F_ONE_B, K.INTERLEAVED_1F1B, K.ZB_H2, K.ZB_V)]
    cases += [{"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": zero, **whole_documents(tmp_path)}
              for zero in (0, 1, 2, 3)]
    results = run_ranks(train_cases, 4, str(text_dir), str(tmp_path), cases, timeout=900)
    assert_same_training(results, str(text_dir), tmp_path)
    assert_played(cases, results[0])
    assert_cut_by_memory(results, str(text_dir), tmp_path)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            c = r["case"]
            sim = simulate(build_schedule(c["kind"], c["pp"], c["m"], V_OF.get(c["kind"], 1))).peak_activations
            assert r["peak_live"] == sim[rank // c["dp"]], c


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_nproc_launches_through_torchrun(text_dir, tmp_path, capfd):
    """`train --nproc 2` from this process: the launcher (torchrun) and both ranks are processes of
    their own, as under the console command."""
    from pipezero.cli import main

    out = tmp_path / "run"
    code = main(["train", "--nproc", "2", "--pp", "2", "--dp", "1", "--schedule", "zb-h1", "--microbatches", "4",
                 "--data", str(text_dir), "--tokenizer", "bytes", "--seq-len", "32", "--max-steps", "6",
                 "--out", str(out), "--no-progress"])
    assert code == 0, capfd.readouterr().err[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 7))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layout"]["pp"] == 2 and summary["layout"]["schedule"] == "zb-h1"
    assert summary["peak_live_activations"]["measured"] == summary["peak_live_activations"]["simulated"]
