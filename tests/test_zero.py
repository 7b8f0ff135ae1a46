"""ZeRO stages 0-3: the optimizer alone, then every stage on several layouts against one process."""

from __future__ import annotations

import json

import pytest
import torch

from ranks import run_ranks
from pipezero.config import GradReduce, OptimConfig
from pipezero.config import ScheduleKind as K
from pipezero.zero.adamw import ShardedAdamW
from pipezero.schedules.bucket_plan import group_tensors
from pipezero.schedules.model_shapes import TensorShape
from pipezero.zero.buckets import build_buckets
from training import assert_played, assert_same_training, layouts, train_cases


def make_buckets(named: list, bucket_mb: float, dp: int, dp_rank: int) -> list:
    """Buckets as a run makes them: the plan groups the tensors, zero/buckets.py builds them."""
    layouts = group_tensors([TensorShape(n, tuple(q.shape)) for n, q in named], bucket_mb)
    return build_buckets(layouts, named, dp, dp_rank)


def test_sharded_adamw_equals_torch_adamw():
    torch.manual_seed(0)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    w = torch.randn(7, 5)
    norm_w = torch.randn(5)
    ref = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(norm_w.clone())]
    opt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
                            lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
    mine = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(norm_w.clone())]
    (bucket,) = make_buckets([("a.weight", mine[0]), ("b.norm.weight", mine[1])], 1.0, dp=1, dp_rank=0)
    sharded = ShardedAdamW(cfg)
    sharded.add_shard(bucket.padded, bucket.decay_ranges(whole=True))
    for step in range(4):
        grads = [torch.randn(7, 5), torch.randn(5)]
        for p, gr in zip(ref, grads):
            p.grad = gr.clone()
        opt.step()
        bucket.attach_grads()
        for p, gr in zip(mine, grads):
            p.grad.copy_(gr)
        sharded.step([bucket.flat], [bucket.grad], 1e-2)
    for a, b in zip(ref, mine):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_decay_ranges_and_their_complement_cover_a_shard():
    from pipezero.zero.adamw import _complement

    assert _complement([(2, 5), (7, 9)], 12) == [(0, 2), (5, 7), (9, 12)]
    assert _complement([], 4) == [(0, 4)] and _complement([(0, 4)], 4) == []


def test_buckets_pad_to_multiple_of_dp_and_views_stay_live():
    params = [("x", torch.nn.Parameter(torch.randn(3, 3))), ("y", torch.nn.Parameter(torch.randn(2)))]
    (b,) = make_buckets(params, 1.0, dp=4, dp_rank=3)
    assert b.numel == 11 and b.padded == 12 and b.shard_size == 3 and b.shard == slice(9, 12)
    assert b.decay_ranges() == [(0, 2)]  # x (3x3) sits at 2..11; this shard is 9..12
    assert b.decay_ranges(whole=True) == [(2, 11)]
    b.flat[0] = 42.0
    assert params[1][1].data.flatten()[0] == 42.0  # reversed order: y comes first in the bucket
    b.flat.untyped_storage().resize_(0)
    b.flat.untyped_storage().resize_(12 * 4)
    b.flat.fill_(1.0)
    assert float(params[0][1].detach().sum()) == 9.0  # views survive a release and re-gather


def zero_cases(dp: int, pp: int) -> list[dict]:
    kinds = [K.ONE_F_ONE_B] if pp == 1 else [K.ONE_F_ONE_B, K.ZB_H1]
    cases = []
    for kind in kinds:
        for stage in (0, 1, 2, 3):
            modes = [GradReduce.STEP, GradReduce.MICROBATCH] if stage >= 2 else [GradReduce.STEP]
            for mode in modes:
                cases.append({"pp": pp, "dp": dp, "kind": kind, "m": 2 * pp, "parallel.zero": stage,
                              "parallel.grad_reduce": mode.value})
    # ZeRO-3 layer by layer is the default at pp=1; with a pipeline, ask for it explicitly. At pp=1
    # rank 0 alone also samples text at the end, which must not issue collectives.
    if pp == 1:
        cases.append({"pp": pp, "dp": dp, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 3, "run.sample_tokens": 8,
                      "run.eval_every": 2})
        # the updated weights' all-gather waited for at the step's end instead of layer by layer
        cases.append({"pp": pp, "dp": dp, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 2,
                      "parallel.overlap_gather": False})
        # more reduce-scatters running while the backward goes on (memory for overlap)
        cases.append({"pp": pp, "dp": dp, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 2,
                      "parallel.grad_reduce": "microbatch", "parallel.buckets_in_flight": 3})
        # the head tied to the embedding in one chunk: the head's layer gathers the embedding's bucket
        cases.append({"pp": pp, "dp": dp, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 3,
                      "model.tie_embeddings": True, "run.sample_tokens": 8})
    if pp > 1:
        cases.append({"pp": pp, "dp": dp, "kind": K.ONE_F_ONE_B, "m": 2 * pp, "parallel.zero": 3,
                      "parallel.zero3_keep_gathered": False})
        cases += [{"pp": pp, "dp": dp, "kind": K.ONE_F_ONE_B, "m": 2 * pp, "parallel.zero": stage,
                   "model.tie_embeddings": True} for stage in (0, 1, 2, 3)]
    return cases


def prefetch_cases(cases: list[dict]) -> list[tuple[int, dict]]:
    """ZeRO-3 layer by layer with each gather started 2 and 3 layers ahead (--zero3-prefetch), each
    beside the index of its depth-1 twin among `cases`: the same collectives in the same order on
    the same bytes, started earlier, so training is the same bit for bit."""
    out = []
    for i, c in enumerate(cases):
        if c.get("parallel.zero") == 3 and c.get("run.sample_tokens") and not c.get("parallel.zero3_keep_gathered"):
            out += [(i, {**c, "parallel.zero3_prefetch": d}) for d in (2, 3)]
    return out


def sublayer_cases(cases: list[dict]) -> list[tuple[int, dict]]:
    """ZeRO-3 layer by layer with a block's attention and MLP gathered and reduced apart
    (--zero3-unit sublayer), each beside the index of its whole-layer twin: at depth 1, and with the
    head tied to the embedding at depth 2 (a borrowed bucket, units kept across the actions' end)."""
    out = []
    for i, c in enumerate(cases):
        if c.get("parallel.zero") == 3 and c.get("run.sample_tokens") and not c.get("parallel.zero3_keep_gathered"):
            depth = 2 if c.get("model.tie_embeddings") else 1
            out.append((i, {**c, "parallel.zero3_unit": "sublayer", "parallel.zero3_prefetch": depth}))
    return out


@pytest.mark.distributed
@pytest.mark.slow(16)
def test_zero_dp2_every_stage_matches_one_process(text_dir, tmp_path):
    cases = zero_cases(2, 1)
    deeper = prefetch_cases(cases)
    assert len(deeper) == 4  # untied and tied, each at depth 2 and 3
    parts = sublayer_cases(cases)
    assert len(parts) == 2
    results = run_ranks(train_cases, 2, str(text_dir), str(tmp_path),
                        cases + [c for _, c in deeper] + [c for _, c in parts], timeout=600)
    assert_same_training(results, str(text_dir), tmp_path)
    for k, (twin, case) in enumerate(parts):  # a part's weights gathered at once, not a block's
        for rank in results:
            got, want = rank[len(cases) + len(deeper) + k], rank[twin]
            assert 0 < got["peak_gathered"] < want["peak_gathered"], (case, got["peak_gathered"], want["peak_gathered"])
        summary = json.loads((tmp_path / f"case{len(cases) + len(deeper) + k}" / "summary.json").read_text())
        assert summary["zero3_prefetch"]["unit"] == "sublayer", summary["zero3_prefetch"]
    for k, (twin, case) in enumerate(deeper):
        for rank in results:
            got, want = rank[len(cases) + k], rank[twin]
            assert got["losses"] == want["losses"] and got["grad_norms"] == want["grad_norms"], case
            assert got["params"].keys() == want["params"].keys()
            assert all(torch.equal(got["params"][n], want["params"][n]) for n in want["params"]), case
        summary = json.loads((tmp_path / f"case{len(cases) + k}" / "summary.json").read_text())
        assert summary["zero3_prefetch"]["depth"] == case["parallel.zero3_prefetch"], summary["zero3_prefetch"]
    # ZeRO-3 layer by layer: the held-out evaluation and the end-of-run sample gather layer by layer
    # like training, so the run's most gathered bytes are the training steps' (never the whole model).
    i = next(i for i, c in enumerate(cases) if c.get("run.sample_tokens"))
    summary = json.loads((tmp_path / f"case{i}" / "summary.json").read_text())
    assert summary["layout"]["zero"] == 3 and summary["ranks"][0]["held_bytes"]
    for rank in summary["ranks"]:
        gathered = rank["zero3_gathered_peak_bytes"]
        assert 0 < gathered["run"] <= 1.05 * gathered["training"], gathered
        assert gathered["run"] < 0.5 * 4 * rank["params"]  # well below the whole stage's fp32 weights


def every_schedule_cases(dp: int, pp: int) -> list[dict]:
    """The other schedules (multi-chunk, V-shaped, split backward) with the stages that change the
    most (ZeRO-1 sharded update, ZeRO-2 reduce-scatter per micro-batch, ZeRO-3 gathered per chunk):
    every ZeRO stage composes with every schedule."""
    others = [K.GPIPE, K.INTERLEAVED_1F1B, K.LOOPED_BFS, K.ZB_H2, K.ZB_V, K.DUALPIPE_V]
    settings = [{"parallel.zero": 1}, {"parallel.zero": 2, "parallel.grad_reduce": GradReduce.MICROBATCH.value},
                {"parallel.zero": 3}]
    return [{"pp": pp, "dp": dp, "kind": kind, "m": 2 * pp, **z} for kind in others for z in settings]


def hierarchical_cases() -> list[dict]:
    """--hierarchical, the 4 ranks as 2 nodes of 2: D=4 reduces inside each node, then across (all-reduce
    at ZeRO-0, reduce-scatter at 1-3); pp-inner puts a stage's 2 replicas on different nodes (one a
    node: the exchange across only; dp-inner, both on one node, is refused: nothing would cross)."""
    two = {"parallel.hierarchical": True, "parallel.ranks_per_node": 2}
    cases = [{"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": z, **two} for z in (0, 1, 2, 3)]
    cases += [{"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 2,
               "parallel.grad_reduce": "microbatch", **two}]
    cases += [{"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": 2, "parallel.placement": "pp-inner", **two}]
    return cases


@pytest.mark.distributed
@pytest.mark.slow(62)
def test_zero_four_ranks_dp4_and_pp2_dp2(text_dir, tmp_path):
    cases = zero_cases(4, 1) + zero_cases(2, 2) + every_schedule_cases(2, 2)
    # a pipeline's stages on neighbouring ranks (--placement pp-inner): the same model
    cases += [{"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": z, "parallel.placement": "pp-inner"}
              for z in (1, 3)]
    cases += hierarchical_cases()
    # --placement pp-inner puts replica d's first and last stage on ranks d x P and d x P + P - 1:
    # the tied embedding's gradients are summed between those two, not between two replicas of one
    # stage (which the dp-inner arithmetic would pair: ranks {0, 2} and {1, 3} at P=2, D=2)
    cases += [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 1, "model.tie_embeddings": True,
               "parallel.placement": "pp-inner"}]
    results = run_ranks(train_cases, 4, str(text_dir), str(tmp_path), cases, timeout=900)
    assert_same_training(results, str(text_dir), tmp_path)
    assert_played(cases, results[0])
    for i, case in enumerate(cases):  # the two-level reductions ran, split as the placement puts the nodes
        want = None if not case.get("parallel.hierarchical") else \
            [2, 2] if case["dp"] == 4 else [2, 1]
        summary = json.loads((tmp_path / f"case{i}" / "summary.json").read_text())
        assert [r["two_level"] for r in summary["ranks"]] == [want] * 4, (case, summary["ranks"][0]["two_level"])


@pytest.mark.distributed
@pytest.mark.slow(72)
def test_eight_ranks_pp4_dp2_every_schedule_and_pp2_dp4_every_zero_stage(text_dir, tmp_path):
    """The two 8-rank layouts in one process group (a spawn of 8 ranks costs 2 cores most of a
    minute). The micro-batch counts and the rarer ZeRO combinations are covered at 4 ranks; here
    every schedule meets dp > 1 with P = 4, and every ZeRO stage meets dp = 4 under a pipeline. At
    the tests' lr 1e-3 (training.LR), 8 micro-batch sums in another order leave ~1e-6 of the
    parameters (~1.4e-5 at 1e-2, measured), so 1e-5 still tells a wrong model."""
    pipeline = [c for c in layouts(4, 2) if c["m"] == 8 or (c["kind"] is K.ZB_V and c["m"] == 4)]
    zero = [c for c in zero_cases(4, 2) if c["kind"] is K.ONE_F_ONE_B and not (
        c.get("model.tie_embeddings") and c["parallel.zero"] in (1, 2))]
    zero += [c for c in zero_cases(4, 2) if c["kind"] is K.ZB_H1 and c["parallel.zero"] >= 2]
    cases = pipeline + zero
    assert {c["kind"] for c in pipeline} == set(K) and {c["parallel.zero"] for c in zero} == {0, 1, 2, 3}
    results = run_ranks(train_cases, 8, str(text_dir), str(tmp_path), cases, timeout=900)
    assert_same_training(results, str(text_dir), tmp_path)


def test_memory_note_counts_the_buckets_in_flight_it_was_given():
    """summary.json's `grad_reduce_note` says how many full gradient buckets a microbatch-mode rank
    may hold: the one backward fills and the `--buckets-in-flight` still reduce-scattering."""
    from pipezero.config import DType
    from pipezero.zero.accounting import explain

    assert "up to 2 buckets" in explain(2, 2, DType.FP32, GradReduce.MICROBATCH, 4)["grad_reduce_note"]
    assert "up to 4 buckets" in explain(3, 2, DType.FP32, GradReduce.MICROBATCH, 4, in_flight=3)["grad_reduce_note"]
