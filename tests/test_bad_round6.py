"""A sixth review of bad inputs (issue 33): round five's leftovers, and what a fresh review as a
careless or hostile user found. Each case is one line naming the input and the fix, exit 2,
nothing of the user's touched. One tiny run is trained in this process for the module (one step,
checkpointed); the tests work on copies of it (the fast lane)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main

TRAIN = ["train", "--preset", "tiny", "--max-steps", "1", "--no-progress", "--seq-len", "16", "--tokenizer", "bytes",
         "--sample-tokens", "0", "--microbatches", "1", "--micro-batch-size", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder of one step of the tiny preset, checkpointed (RUN/checkpoints/step-00000001)."""
    from pipezero.cli import main

    root = tmp_path_factory.mktemp("round6")
    docs = root / "docs"
    docs.mkdir()
    words = "the quick brown fox jumps over a lazy dog".split()
    for i in range(40):
        (docs / f"{i}.txt").write_text(" ".join(words[i % 9:] + words[:i % 9]) * 4)
    run = root / "run"
    assert main([*TRAIN, "--out", str(run), "--data", str(docs)]) == 0
    assert (run / "checkpoints" / "step-00000001" / "manifest.json").is_file()
    return run


def data_of(trained: Path) -> list[str]:
    return ["--data", str(trained.parent / "docs")]


def copy_run(trained: Path, dest: Path) -> Path:
    shutil.copytree(trained, dest)
    (dest / ".lock").unlink(missing_ok=True)
    return dest


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes: to prove nothing was written there."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- Part A: round five's leftovers ---------------------------------------------------------------

def test_force_never_replaces_a_users_files_in_a_folder_no_run_claimed(tmp_path, capsys):
    """`train --force` over a folder holding the user's metrics.jsonl (no .run-id, no checkpoints)
    replaced it: --force trains beside a run pipezero started, never over files it did not write."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text("my notes")
    (mine / "trace.png").write_bytes(b"my picture")
    before = files(mine)
    assert_one_line(*run_main([*TRAIN, "--out", str(mine), "--force"], capsys),
                    "holds metrics.jsonl, trace.png but no run pipezero started (no .run-id, no checkpoints), "
                    "and --force would write over them")
    assert files(mine) == before and sorted(p.name for p in mine.iterdir()) == ["metrics.jsonl", "trace.png"]


def test_force_beside_a_run_pipezero_started_still_trains(trained, tmp_path):
    """What --force is for stays: a folder a run claimed (its .run-id) takes a new run beside it."""
    from pipezero.rundir import claim

    run = copy_run(trained, tmp_path / "run")
    with claim(str(run), resume=False, force=True) as held:
        assert held.id != (trained / ".run-id").read_text().strip()


def test_resume_with_a_forged_run_id_and_no_checkpoint_keeps_the_records(tmp_path, capsys):
    """A hand-written .run-id beside the user's metrics.jsonl and trace.json let --resume start at
    step 0 and replace both."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".run-id").write_text("0123456789abcdef\n")
    (mine / "metrics.jsonl").write_text('{"step": 7, "mine": true}\n')
    (mine / "trace.json").write_text("{}")
    before = files(mine)
    assert_one_line(*run_main([*TRAIN, "--out", str(mine), "--resume"], capsys),
                    "holds no checkpoint of this run to continue from, but it holds metrics.jsonl, trace.json")
    assert files(mine) == before


def test_resume_of_a_run_that_saved_nothing_keeps_its_records(trained, tmp_path, capsys):
    """The same for a real run that saved no checkpoint (or only another run's): its metrics would be
    replaced by a fresh step 0."""
    run = copy_run(trained, tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    before = files(run)
    assert_one_line(*run_main([*TRAIN, *data_of(trained), "--out", str(run), "--resume"], capsys), "holds no checkpoint of this run")
    assert files(run) == before


def cut_short(step: Path) -> str:
    """Truncate the step's shard to half and edit the manifest's size and sha256 to match."""
    shard = next(p for p in sorted(step.iterdir()) if p.suffix == ".distcp")
    data = shard.read_bytes()[: shard.stat().st_size // 2]
    shard.write_bytes(data)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"][shard.name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(json.dumps(manifest))
    return shard.name


def test_a_shard_cut_short_with_its_manifest_edited_is_named_before_any_rank(trained, tmp_path, capsys):
    """It passed the checksums, and the read ended in `EOFError` in every rank, exit 1."""
    run = copy_run(trained, tmp_path / "run")
    step = run / "checkpoints" / "step-00000001"
    name = cut_short(step)
    before = files(run)
    assert_one_line(*run_main([*TRAIN, *data_of(trained), "--max-steps", "2", "--out", str(run), "--resume"], capsys),
                    f"its newest checkpoint {step} is damaged: shard {name} is cut short")
    assert files(run) == before
    for source in (step, run):
        assert_one_line(*run_main(["export", str(source), "--out", str(tmp_path / "e")], capsys),
                        f"shard {name} is cut short")
    assert not (tmp_path / "e").exists()


def test_the_ranks_skip_a_shard_cut_short_as_a_bad_checksum(trained, tmp_path):
    """Under an outside torchrun (no preflight) the ranks take it for a damaged checkpoint."""
    from pipezero.checkpoint.store import Team, problems

    run = copy_run(trained, tmp_path / "run")
    step = run / "checkpoints" / "step-00000001"
    assert problems(step, Team()) is None
    name = cut_short(step)
    assert f"shard {name} is cut short" in problems(step, Team())


def test_a_cached_tokenizer_swapped_for_another_is_rebuilt(tmp_path, capsys, monkeypatch):
    """A valid tokenizer put in place of a cached bpe-*.json was used silently."""
    import numpy as np

    from test_bad_data import _documents

    from pipezero.data import load_corpus
    from pipezero.util import cache_dir

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


@pytest.mark.parametrize("cost", ["-1,1,1", "-1:1:1", "-0.5:1:1"])
def test_a_negative_cost_reaches_its_own_check(cost, capsys):
    """argparse read `--cost -1,1,1` as an option and said only "expected one argument"."""
    code, err = run_main(["simulate", "--cost", cost], capsys)
    assert_one_line(code, err, f"--cost")
    assert "expected one argument" not in err and cost in err


def test_a_negative_number_still_reaches_a_numeric_flag(capsys):
    assert_one_line(*run_main(["simulate", "--comm", "-1"], capsys), "--comm = -1.0: expected a number >= 0")


# --- Part B: a fresh review (round six) -------------------------------------------------------------

@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/step-00000001", "checkpoints/step-00000001/deeper"])
def test_out_inside_a_runs_checkpoints_is_refused(inside, trained, tmp_path, capsys):
    """`--out RUN/checkpoints/step-N --force` wrote a whole run (metrics, its own checkpoints) into
    another run's checkpoint, beside the shards that run's saves and pruning manage."""
    run = copy_run(trained, tmp_path / "run")
    before = files(run)
    assert_one_line(*run_main([*TRAIN, *data_of(trained), "--out", str(run / inside), "--force"], capsys),
                    "a run's checkpoints folder, which that run's saves, pruning and resume manage")
    assert files(run) == before and not (run / "checkpoints" / "step-00000001" / "deeper").exists()


def test_a_folder_named_checkpoints_of_no_run_is_a_run_folder(tmp_path):
    from pipezero.rundir import claim

    with claim(str(tmp_path / "checkpoints"), resume=False, force=False):
        pass


def test_resume_past_max_steps_is_refused_not_a_silent_no_op(trained, tmp_path, capsys):
    """`--resume --max-steps 1` over a checkpoint of step 1 is fine (nothing left: exit 0); over step 2
    it said "resumed" and exited 0 having trained nothing."""
    run = copy_run(trained, tmp_path / "run")
    step = run / "checkpoints" / "step-00000001"
    step.rename(run / "checkpoints" / "step-00000002")
    manifest = json.loads((run / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    (run / "checkpoints" / "step-00000002" / "manifest.json").write_text(json.dumps({**manifest, "step": 2}))
    before = files(run)
    assert_one_line(*run_main([*TRAIN, *data_of(trained), "--out", str(run), "--resume"], capsys),
                    "its newest checkpoint is of step 2, past --max-steps 1, so nothing would train")
    assert files(run) == before


def test_resume_with_every_checkpoint_cut_short_keeps_the_records(trained, tmp_path, capsys):
    """Every checkpoint of the run of the wrong size: the ranks skipped them all, started at step 0
    and replaced metrics.jsonl and summary.json."""
    run = copy_run(trained, tmp_path / "run")
    shard = next((run / "checkpoints" / "step-00000001").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    before = files(run)
    assert_one_line(*run_main([*TRAIN, *data_of(trained), "--max-steps", "2", "--out", str(run), "--resume"], capsys),
                    "every checkpoint of this run is damaged (newest step-00000001: files of the wrong size")
    assert files(run) == before


def test_resume_with_every_checkpoint_failing_its_checksum_keeps_the_records(trained, tmp_path, capsys):
    """Bytes changed in place (sizes right) show only to the ranks' checksums: they skipped every
    checkpoint and started at step 0 over the run's records. Now the rank stops in one line, exit 1."""
    run = copy_run(trained, tmp_path / "run")
    shard = next((run / "checkpoints" / "step-00000001").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    records = {n: (run / n).read_bytes() for n in ("metrics.jsonl", "summary.json")}
    code, err = run_main([*TRAIN, *data_of(trained), "--max-steps", "2", "--out", str(run), "--resume"], capsys)
    assert code == 1 and "Traceback" not in err, err
    assert "every checkpoint of this run under" in err and "would replace metrics.jsonl, summary.json" in err, err
    assert {n: (run / n).read_bytes() for n in records} == records


@pytest.mark.parametrize("argv, needle", [
    (["train", "--config", "", "--out", "{tmp}/o"], "--config is empty: name a .toml file"),  # trained the defaults
    (["simulate", "--png", ""], "--png is empty"),  # simulated, drew nothing, exit 0
    (["simulate", "--from-trace", ""], "--from-trace is empty"),  # simulated the defaults instead
    (["simulate", "--memory", "--config", " "], "--config is empty"),
    (["export", "{run}", "--out", "{tmp}/e", "--model-spec", ""], "--model-spec is empty"),  # exported anyway
    (["doctor", ""], "the run folder is empty"),  # read the working directory, exit 1
])
def test_an_empty_value_is_refused_not_read_as_absent(argv, needle, trained, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{run}", str(trained)) for a in argv]
    assert_one_line(*run_main(argv, capsys), needle)
    assert not (tmp_path / "o").exists() and not (tmp_path / "e").exists()


def test_a_toml_file_with_a_byte_order_mark_is_read(tmp_path):
    """Saved by an editor that writes a BOM: "not valid TOML: Invalid statement (at line 1, column 1)"."""
    from pipezero.settings import build_config

    (tmp_path / "c.toml").write_text("\ufeff[run]\nseed = 7\n", encoding="utf-8")
    assert build_config(str(tmp_path / "c.toml")).run.seed == 7


def test_plan_refuses_memory_no_layout_can_fit_before_simulating_any(capsys, monkeypatch):
    """`plan --preset 7b --gpus 8 --gpu-memory 0.001` simulated every layout (minutes on a busy host)
    to say none fits: the weights' share of one GPU says it at once."""
    def never(*args, **kwargs):
        raise AssertionError("the planner ran")

    monkeypatch.setattr("pipezero.sim.planner.plan_within", never)
    assert_one_line(*run_main(["plan", "--preset", "7b", "--gpus", "8", "--gpu-memory", "0.001"], capsys),
                    "no layout fits 6.7B parameters in 8 x 0.001 GiB: their fp32 weights alone")


def test_a_folder_in_use_is_said_before_what_a_resume_would_find_there(trained, tmp_path, capsys):
    """The resume's checks read the other run's checkpoints as they change (a step past --max-steps,
    one being pruned): "in use by another run" is the one answer."""
    from pipezero.rundir import claim

    run = copy_run(trained, tmp_path / "run")
    with claim(str(run), resume=True, force=False):
        assert_one_line(*run_main([*TRAIN, *data_of(trained), "--out", str(run), "--resume", "--max-steps", "1",
                                   "--preset", "small"], capsys), "is in use by another run")


def test_force_into_a_hugging_face_model_folder_keeps_the_model(tmp_path, capsys):
    """`train --force --out MODEL` replaced the model's config.json with the run's (found in review)."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"weights")
    before = files(model)
    assert_one_line(*run_main([*TRAIN, "--out", str(model), "--force"], capsys),
                    "holds config.json but no run pipezero started")
    assert files(model) == before


def test_resume_under_another_runs_id_keeps_the_records(trained, tmp_path, capsys):
    """A .run-id that is not the checkpoints' (edited, or copied from another run) took none of them
    and started at step 0 over metrics.jsonl (found in review)."""
    run = copy_run(trained, tmp_path / "run")
    (run / ".run-id").write_text("ffffffffffffffff\n")
    before = files(run)
    assert_one_line(*run_main([*TRAIN, *data_of(trained), "--max-steps", "2", "--out", str(run), "--resume"], capsys),
                    "holds no checkpoint of this run to continue from, but it holds metrics.jsonl, summary.json")
    assert files(run) == before
