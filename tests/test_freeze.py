"""Frozen parameters (--freeze): names from the configuration alone, then one process group of four
ranks that trains frozen layouts against one process, checks frozen tensors never move, the memory
summary, and resume (across layouts, and refused when a frozen tensor would start training)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pipezero.config import ModelConfig
from pipezero.settings import build_config
from pipezero.config import ScheduleKind as K
from pipezero.freeze import frozen_names, param_names, saved_bytes
from pipezero.models import build_chunk, layer_param_counts
from pipezero.parallel.partition import partition
from ranks import run_ranks
from training import assert_same_training, reference_key, tiny_overrides, train_cases

FIRST = r"layers\.0\.|layers\.[1-2]\."  # the embedding and the first two blocks (of tests' six)
LAST = r"layers\.[4-7]\."  # pp=2: rank 1's whole stage; gradients go back through it to rank 0
# pp=2, V=2 holds layers 0-1, 2-3, 4-5, 6-7 in chunks 0-3 on ranks 0, 1, 0, 1: rank 0 has nothing to
# train, its first chunk has no backward, and chunk 1's gradients go back through frozen chunk 2
ALTERNATE = r"layers\.[0145]\."
THAWED = r"layers\.0\."  # freezes less than FIRST: resuming FIRST's checkpoint with it must fail
MORE = r"layers\.[0-3]\."  # freezes more than FIRST: block 3 keeps its step-2 values, its AdamW state unread


def test_names_come_from_the_shape_and_tied_weights_freeze_together():
    model = ModelConfig(n_layers=2, dim=64, n_heads=4, vocab_size=256)
    names = param_names(model)
    assert names == [n for n, _ in build_chunk(model, 0, 4, 0).named_parameters()]
    assert frozen_names(model, FIRST) == {n for n in names if n.startswith(("layers.0.", "layers.1.", "layers.2."))}
    assert frozen_names(model, None) == set()
    tied = ModelConfig(n_layers=2, dim=64, n_heads=4, vocab_size=256, tie_embeddings=True)
    both = {"layers.0.weight", "layers.3.proj.weight"}
    assert frozen_names(tied, r"^layers\.0\.") == both and both <= frozen_names(tied, r"proj")
    huge = param_names(ModelConfig(preset="70b", vocab_size=32000, dim=8192, n_layers=80, n_heads=64))
    assert len(huge) == 2 + 80 * 9 + 1  # built on the meta device: no 70B of memory


def test_saved_bytes_follow_the_zero_stage():
    assert saved_bytes(0, 2, 100) == {"frozen_params": 100, "param_bytes": 400, "grad_bytes_saved": 400,
                                      "optimizer_bytes_saved": 800, "zero3_param_bytes_extra": 0}
    assert saved_bytes(1, 2, 100)["optimizer_bytes_saved"] == 400 and saved_bytes(1, 2, 100)["grad_bytes_saved"] == 400
    assert saved_bytes(2, 2, 100)["grad_bytes_saved"] == 200
    assert saved_bytes(3, 4, 100)["zero3_param_bytes_extra"] == 300


CASES = [
    {"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": 1, "optim.freeze": FIRST,
     "run.checkpoint_every": 2},
    {"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": 2, "optim.freeze": FIRST},
    # the tied weight frozen through the embedding's name: the last rank's head copy is frozen too
    {"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": 3, "model.tie_embeddings": True,
     "optim.freeze": FIRST},
    {"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": 2, "parallel.grad_reduce": "microbatch",
     "optim.freeze": LAST},
    {"pp": 2, "dp": 2, "kind": K.INTERLEAVED_1F1B, "m": 4, "parallel.zero": 3, "optim.freeze": ALTERNATE},
    # recomputation: the frozen first chunk's checkpointed forward has no graph to rerun
    {"pp": 2, "dp": 2, "kind": K.INTERLEAVED_1F1B, "m": 4, "parallel.zero": 1, "parallel.recompute": True,
     "optim.freeze": ALTERNATE},
]


def copy_step(src: str, dst: str, step: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        name = f"checkpoints/step-{step:08d}"
        shutil.copytree(Path(src) / name, Path(dst) / name)
    dist.barrier()


def freeze_scenarios(rank: int, world: int, data: str, out: str) -> dict:
    from pipezero.checkpoint import CheckpointError
    from pipezero.engine import train

    res = {"cases": train_cases(rank, world, data, out, CASES)}
    # case 0's step-2 checkpoint, resumed on another layout: ZeRO-3 layer by layer on one stage
    copy_step(f"{out}/case0", f"{out}/resumed", 2)
    again = {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 3, "optim.freeze": FIRST,
             "run.resume": True}
    r = train(build_config(None, tiny_overrides(data, f"{out}/resumed", **again)), snapshot=True)
    res["resumed"] = {"from": r.resumed_from, "losses": r.losses, "params": r.params}
    copy_step(f"{out}/case0", f"{out}/more", 2)
    r = train(build_config(None, tiny_overrides(data, f"{out}/more", **{**again, "optim.freeze": MORE})))
    res["more"] = {"from": r.resumed_from, "losses": r.losses}
    copy_step(f"{out}/case0", f"{out}/thawed", 2)
    try:
        train(build_config(None, tiny_overrides(data, f"{out}/thawed", **{**again, "optim.freeze": THAWED})))
        res["thawed"] = "resumed?"
    except CheckpointError as e:
        res["thawed"] = str(e)
    return res


def one_thread_refs(cases: list[dict], data: str, tmp_path: Path) -> dict:
    """training.reference's one-process runs, keyed as assert_same_training keys them, on one
    thread like each rank: two threads on two busy cores spin against each other (measured at load
    average 6: 10-40 s a run against 1.5-1.9 s on one thread)."""
    from pipezero.engine import train

    refs: dict = {}
    threads = torch.get_num_threads()
    for case in cases:
        key = reference_key(data, case)
        if key not in refs:
            overrides = tiny_overrides(data, str(tmp_path / f"ref{len(refs)}"), 1, 1, K.ONE_F_ONE_B, key[1],
                                       **dict(key[2]))
            res = train(build_config(None, {**overrides, "run.threads": 1}), snapshot=True)
            refs[key] = (res.losses, res.params, res.grad_norms)
    torch.set_num_threads(threads)  # train() set one thread for this whole process
    return refs


def initial_params(case: dict, data: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    cfg = build_config(None, tiny_overrides(data, str(tmp_path / "unused"), **case))
    out = dict(build_chunk(cfg.model, 0, cfg.model.n_layers + 2, cfg.run.seed).named_parameters())
    if cfg.model.tie_embeddings:
        out[f"layers.{cfg.model.n_layers + 1}.proj.weight"] = out["layers.0.weight"]
    return out


def check_summary(case: dict, folder: Path, data: str) -> None:
    """Frozen tensors are in no ZeRO bucket, and summary.json says what their absence saved."""
    cfg = build_config(None, tiny_overrides(data, str(folder), **case))
    summary = json.loads((folder / "summary.json").read_text())
    counts = layer_param_counts(cfg.model)
    idle = set()
    bounds = partition(cfg.model, cfg.parallel.pp * cfg.parallel.virtual_stages, cfg.parallel.partition,
                       cfg.data.seq_len, None)
    for r, rank in enumerate(summary["ranks"]):
        pp_rank = r // cfg.parallel.dp
        chunks = [c for c in range(len(bounds)) if c % cfg.parallel.pp == pp_rank]
        held = sum(sum(counts[a:b]) for a, b in (bounds[c] for c in chunks))
        if cfg.model.tie_embeddings and pp_rank == cfg.parallel.pp - 1:
            held += counts[0]  # the head's own copy of the tied weight
        frozen = rank["frozen"]
        assert rank["params"] + frozen["frozen_params"] == held, (r, rank["params"], frozen)
        assert frozen == saved_bytes(cfg.parallel.zero, cfg.parallel.dp, frozen["frozen_params"])
        if held == frozen["frozen_params"]:  # a rank with nothing to train: no gradient, no AdamW state
            assert rank["params"] == rank["held_bytes"]["grads"] == rank["held_bytes"]["optimizer"] == 0
            idle.add(pp_rank)
    if case["optim.freeze"] in (LAST, ALTERNATE):
        assert idle == {1 if case["optim.freeze"] == LAST else 0}, idle
    total = summary["frozen"]
    assert total["pattern"] == case["optim.freeze"] and total["bytes_saved"] > 0
    frozen = frozen_names(cfg.model, case["optim.freeze"])
    model = dict(build_chunk(cfg.model, 0, cfg.model.n_layers + 2, 0).named_parameters())
    tied_head = f"layers.{cfg.model.n_layers + 1}.proj.weight"  # the pipeline's second copy of a tied weight
    assert total["frozen_params"] == sum(q.numel() for n, q in model.items() if n in frozen) + \
        (counts[0] if cfg.model.tie_embeddings and tied_head in frozen else 0)
    assert total["bytes_saved"] == sum(x["frozen"]["grad_bytes_saved"] + x["frozen"]["optimizer_bytes_saved"]
                                       for x in summary["ranks"])


@pytest.mark.distributed
@pytest.mark.slow(25)
def test_frozen_layouts_train_like_one_process_and_resume(text_dir, tmp_path):
    results = run_ranks(freeze_scenarios, 4, str(text_dir), str(tmp_path), timeout=600)
    refs = one_thread_refs(CASES, str(text_dir), tmp_path)
    assert_same_training([r["cases"] for r in results], str(text_dir), tmp_path, refs)
    assert len(refs) == 4  # every case found its one-thread reference (FIRST, tied FIRST, LAST, ALTERNATE)
    for i, case in enumerate(CASES):
        frozen = frozen_names(build_config(None, tiny_overrides(str(text_dir), "x", **case)).model,
                              case["optim.freeze"])
        init = initial_params(case, str(text_dir), tmp_path)
        seen = set()
        for per_rank in results:  # bit for bit the initial values, on every rank that holds them
            for name, value in per_rank["cases"][i]["params"].items():
                if name in frozen:
                    assert torch.equal(value, init[name]), (case, name)
                    seen.add(name)
        assert seen == frozen, (case, frozen - seen)
        check_summary(case, tmp_path / f"case{i}", str(text_dir))
    # resumed at step 2 on (pp 1, dp 4, ZeRO-3): the uninterrupted run's later steps, its final tensors
    first = results[0]["cases"][0]
    for per_rank in results:
        resumed = per_rank["resumed"]
        assert resumed["from"] == 2 and resumed["losses"] == pytest.approx(first["losses"][2:], rel=1e-5)
    for name, value in results[0]["resumed"]["params"].items():
        ref = next(r["cases"][0]["params"][name] for r in results if name in r["cases"][0]["params"])
        torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-6)
    for r in results:  # freezing more resumes: step 3 runs on the same step-2 weights
        assert r["more"]["from"] == 2 and r["more"]["losses"][0] == pytest.approx(first["losses"][2], rel=1e-5)
    for r in results:  # every rank refuses alike, before any collective of the load
        assert "was trained with --freeze" in r["thawed"] and "resume with --freeze" in r["thawed"], r["thawed"]


@pytest.mark.distributed
def test_zero3_layer_by_layer_tied_head_with_its_norm_frozen(text_dir, tmp_path):
    """At pp=1 the tied head's projection is the embedding, bucketed under layer 0: with the head's
    norm frozen the head layer owns no bucket, yet it computes with the embedding's, which ZeRO-3
    layer by layer must gather for it (it read released, zero-byte storage)."""
    cases = [{"pp": 1, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 3, "model.tie_embeddings": True,
              "optim.freeze": r"layers\.7\.norm"},
             {"pp": 1, "dp": 2, "kind": K.ZB_H1, "m": 2, "parallel.zero": 3, "model.tie_embeddings": True,
              "optim.freeze": r"layers\.7\.norm"}]
    results = run_ranks(train_cases, 2, str(text_dir), str(tmp_path), cases, timeout=600)
    assert_same_training(results, str(text_dir), tmp_path)


@pytest.mark.distributed  # full lane: seconds of one-process training
def test_resuming_without_the_checkpoints_freeze_is_refused_before_any_rank_starts(text_dir, tmp_path, capsys):
    """A checkpoint of `--freeze 'layers\\.0\\.'` resumed without --freeze (the embedding would train
    with no AdamW state): one line from the launcher (no rank starts: --nproc 2 here), naming the
    pattern as a shell takes it back (it was the Python repr, each backslash doubled, matching nothing)."""
    import shlex

    from one_line import assert_one_line, run_main

    small = ["--preset", "tiny", "--tokenizer", "bytes", "--data", str(text_dir), "--seq-len", "16",
             "--microbatches", "1", "--sample-tokens", "0", "--eval-every", "0", "--out", str(tmp_path / "run")]
    code, err = run_main(["train", *small, "--freeze", THAWED, "--max-steps", "1", "--checkpoint-every", "1"], capsys)
    assert code == 0, err
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    code, err = run_main(["train", *small, "--resume", "--max-steps", "2", "--nproc", "2", "--dp", "2"], capsys)
    assert_one_line(code, err, f"resume with --freeze {shlex.quote(THAWED)} (or one freezing more)")
    assert err.startswith("pipezero: error: --resume in "), err  # the launcher's check, before torchrun
    assert shlex.split(err.split("resume with --freeze ")[1].split(" (or")[0]) == [THAWED]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize("pattern, needle", [
    (r"layers\.(", "is not a valid regular expression"),
    (r"nothing\.here", "matches no parameter"),
    (r".*", "matches every parameter"),
])
def test_a_refused_pattern_is_named_as_a_shell_takes_it(pattern, needle):
    """The pattern in a refusal is the one the user typed, quoted for a shell (not Python's repr,
    which doubles each backslash)."""
    import shlex

    from pipezero.errors import ConfigError
    from pipezero.freeze import check_pattern

    with pytest.raises(ConfigError, match=needle) as e:
        check_pattern(ModelConfig(preset="tiny"), pattern)
    assert f"--freeze {shlex.quote(pattern)} " in str(e.value), str(e.value)
