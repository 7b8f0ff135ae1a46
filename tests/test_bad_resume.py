"""--resume continues a run pipezero started from its newest sound checkpoint, or refuses in one line
naming the folder and the fix, exit 2, before anything is written: a folder no run claimed, a run
with no checkpoint of its own to continue from, damaged checkpoints, a step past --max-steps, a
folder in use. The run's records (metrics.jsonl, summary.json, trace.json) are never replaced by a
fresh step 0. Most tests work on copies of one tiny trained run (tests/tiny_runs.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main
from tiny_runs import (TRAIN_TINY_BYTES, TRAIN_TINY_SMALLEST, copy_trained_folder, copy_trained_run, data_of, fake_run,
                       write_docs)
from user_files import files, within


def test_an_empty_checkpoints_folder_is_no_run_to_resume(tmp_path, capsys):
    """A folder of the user's holding metrics.jsonl, summary.json and an empty `checkpoints` folder
    (no .run-id) is no run: a --resume there would replace both files at step 0."""
    mine = tmp_path / "mine"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "metrics.jsonl").write_text("my notes")
    (mine / "summary.json").write_text('{"mine": 1}')
    assert_one_line(*run_main([*TRAIN_TINY_BYTES, "--out", str(mine), "--resume"], capsys),
                    "holds metrics.jsonl, summary.json but no run pipezero started")
    assert (mine / "metrics.jsonl").read_text() == "my notes"
    assert sorted(p.name for p in mine.iterdir()) == ["checkpoints", "metrics.jsonl", "summary.json"]


def test_a_checkpoints_folder_with_a_step_still_resumes(tmp_path):
    """A run folder that lost its .run-id but holds a checkpoint is still a run: --resume claims it."""
    from pipezero.rundir import claim

    out = tmp_path / "run"
    (out / "checkpoints" / "step-00000001").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("")
    with claim(str(out), resume=True, force=False):
        pass


def test_resume_with_a_forged_run_id_and_no_checkpoint_keeps_the_records(tmp_path, capsys):
    """A hand-written .run-id beside the user's metrics.jsonl and trace.json: with no checkpoint of
    that run, --resume would start at step 0 and replace both."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / ".run-id").write_text("0123456789abcdef\n")
    (mine / "metrics.jsonl").write_text('{"step": 7, "mine": true}\n')
    (mine / "trace.json").write_text("{}")
    before = files(mine)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, "--out", str(mine), "--resume"], capsys),
                    "holds no checkpoint of this run to continue from, but it holds metrics.jsonl, trace.json")
    assert files(mine) == before


def test_resume_of_a_run_that_saved_nothing_keeps_its_records(trained_run, tmp_path, capsys):
    """The same for a real run that saved no checkpoint (or only another run's): its metrics would be
    replaced by a fresh step 0."""
    run = copy_trained_run(trained_run, tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    before = files(run)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--out", str(run), "--resume"], capsys),
                    "holds no checkpoint of this run")
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


def test_a_shard_cut_short_with_its_manifest_edited_is_named_before_any_rank(trained_run, tmp_path, capsys):
    """It passes the checksums, so only the sizes say it: named before any rank, whose read would
    end in `EOFError`; export refuses it alike."""
    run = copy_trained_run(trained_run, tmp_path / "run")
    step = run / "checkpoints" / "step-00000001"
    name = cut_short(step)
    before = files(run)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--max-steps", "2", "--out", str(run), "--resume"],
                              capsys),
                    f"its newest checkpoint {step} is damaged: shard {name} is cut short")
    assert files(run) == before
    for source in (step, run):
        assert_one_line(*run_main(["export", str(source), "--out", str(tmp_path / "e")], capsys),
                        f"shard {name} is cut short")
    assert not (tmp_path / "e").exists()


def test_the_ranks_skip_a_shard_cut_short_as_a_bad_checksum(trained_run, tmp_path):
    """Under an outside torchrun (no preflight) the ranks take it for a damaged checkpoint."""
    from pipezero.checkpoint.store import Team, problems

    run = copy_trained_run(trained_run, tmp_path / "run")
    step = run / "checkpoints" / "step-00000001"
    assert problems(step, Team()) is None
    name = cut_short(step)
    assert f"shard {name} is cut short" in problems(step, Team())


def test_resume_past_max_steps_is_refused_not_a_silent_no_op(trained_run, tmp_path, capsys):
    """`--resume --max-steps 1` over a checkpoint of step 1 is fine (nothing left: exit 0); over step 2
    it would say "resumed" and train nothing."""
    run = copy_trained_run(trained_run, tmp_path / "run")
    step = run / "checkpoints" / "step-00000001"
    step.rename(run / "checkpoints" / "step-00000002")
    manifest = json.loads((run / "checkpoints" / "step-00000002" / "manifest.json").read_text())
    (run / "checkpoints" / "step-00000002" / "manifest.json").write_text(json.dumps({**manifest, "step": 2}))
    before = files(run)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--out", str(run), "--resume"], capsys),
                    "its newest checkpoint is of step 2, past --max-steps 1, so nothing would train")
    assert files(run) == before


def test_resume_with_every_checkpoint_cut_short_keeps_the_records(trained_run, tmp_path, capsys):
    """Every checkpoint of the run of the wrong size: the ranks would skip them all, start at step 0
    and replace metrics.jsonl and summary.json."""
    run = copy_trained_run(trained_run, tmp_path / "run")
    shard = next((run / "checkpoints" / "step-00000001").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    before = files(run)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--max-steps", "2", "--out", str(run), "--resume"],
                              capsys),
                    "every checkpoint of this run is damaged (newest step-00000001: files of the wrong size")
    assert files(run) == before


def test_resume_with_every_checkpoint_failing_its_checksum_keeps_the_records(trained_run, tmp_path, capsys):
    """Bytes changed in place (sizes right) show only to the ranks' checksums: with every checkpoint
    skipped, a start at step 0 would replace the run's records, so the rank stops in one line, exit 1."""
    run = copy_trained_run(trained_run, tmp_path / "run")
    shard = next((run / "checkpoints" / "step-00000001").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    records = {n: (run / n).read_bytes() for n in ("metrics.jsonl", "summary.json")}
    code, err = run_main([*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--max-steps", "2", "--out", str(run), "--resume"],
                         capsys)
    assert code == 1 and "Traceback" not in err, err
    assert "every checkpoint of this run under" in err and "would replace metrics.jsonl, summary.json" in err, err
    assert {n: (run / n).read_bytes() for n in records} == records


def test_a_folder_in_use_is_said_before_what_a_resume_would_find_there(trained_run, tmp_path, capsys):
    """The resume's checks read the other run's checkpoints as they change (a step past --max-steps,
    one being pruned): "in use by another run" is the one answer."""
    from pipezero.rundir import claim

    run = copy_trained_run(trained_run, tmp_path / "run")
    with claim(str(run), resume=True, force=False):
        assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--out", str(run), "--resume",
                                   "--max-steps", "1", "--preset", "small"], capsys), "is in use by another run")


def test_resume_under_another_runs_id_keeps_the_records(trained_run, tmp_path, capsys):
    """A .run-id that is not the checkpoints' (edited, or copied from another run) takes none of them:
    a start at step 0 would replace metrics.jsonl."""
    run = copy_trained_run(trained_run, tmp_path / "run")
    (run / ".run-id").write_text("ffffffffffffffff\n")
    before = files(run)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--max-steps", "2", "--out", str(run), "--resume"],
                              capsys),
                    "holds no checkpoint of this run to continue from, but it holds metrics.jsonl, summary.json")
    assert files(run) == before


@pytest.mark.parametrize("name", [".run-id", ".lock"])
def test_a_pipe_at_the_runs_id_or_lock_is_named_not_waited_on(name, tmp_path, monkeypatch, capsys):
    """A pipe (FIFO) at OUT/.run-id or OUT/.lock: opened to read, it would wait for a writer for
    ever (no message, no exit); it is named instead."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello there " * 100)
    run = fake_run(tmp_path / "run")
    (run / name).unlink()
    os.mkfifo(run / name)
    code, err = within(20, lambda: run_main([*TRAIN_TINY_SMALLEST, "--data", "docs", "--out", "run", "--resume"], capsys))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if name == ".run-id":
        assert ".run-id is not a regular file" in err, err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_a_resume_over_a_users_scratch_folder_is_refused_before_training(tmp_path, monkeypatch, capsys, trained_folder):
    monkeypatch.chdir(tmp_path)
    write_docs(tmp_path)
    copy_trained_folder(trained_folder, tmp_path)
    mine = tmp_path / "run" / "checkpoints" / ".tmp-step-00000002" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("mine")
    code, err = run_main([*TRAIN_TINY_SMALLEST, "--data", "docs", "--out", "run", "--resume", "--max-steps", "2"], capsys)
    assert_one_line(code, err, ".tmp-step-00000002 holds files no checkpoint save writes")
    assert mine.read_text() == "mine"


def test_resume_of_a_finished_run_at_its_last_step_is_refused_and_writes_nothing(trained_run, tmp_path, capsys):
    """A run whose summary.json came after its last step's checkpoint is complete: a --resume with the
    same --max-steps trained nothing and rewrote its summary (final loss null, zero steps). One that
    saved its last step but died before its summary is not finished: resuming writes the summary."""
    import time

    from pipezero.checkpoint.state import finished

    run = copy_trained_run(trained_run, tmp_path / "run")
    before = files(run)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--out", str(run), "--resume"], capsys),
                    "the run is complete: its newest checkpoint is of its last step, 1, and its summary.json is "
                    "written")
    assert files(run) == before
    step = run / "checkpoints" / "step-00000001"
    assert finished(run, step)
    later = time.time() + 60  # the summary of an earlier run (--force), older than the newest save
    os.utime(step, (later, later))
    assert not finished(run, step)
    (run / "summary.json").unlink()
    assert not finished(run, step)


def test_force_with_resume_is_refused(trained_run, tmp_path, capsys):
    """--resume continues the run in --out, --force starts a new one beside it: given both, one was
    read by nothing."""
    run = copy_trained_run(trained_run, tmp_path / "run")
    before = files(run)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--out", str(run), "--resume", "--force"],
                              capsys), "--force and --resume ask for opposite things")
    assert files(run) == before


def test_resume_onto_another_tokenizer_is_refused_before_any_text_is_read(trained_run, tmp_path, capsys,
                                                                           monkeypatch):
    """The tokenizer a checkpoint trained with is in its manifest, and a tokenizer.json's content
    name is known as the file is read: on the built-in corpus the refusal came only after the whole
    standard library was tokenized with the new one (past two minutes, not a word)."""
    import pipezero.data
    import pipezero.engine
    from pipezero.data.tokenizer import BPETokenizer

    def no_text(*_: object, **__: object) -> None:
        raise AssertionError("the corpus was read before the tokenizer was compared")

    run = copy_trained_run(trained_run, tmp_path / "run")
    before = files(run)
    BPETokenizer.train(["the quick brown fox"] * 4, 300).hf.save(str(tmp_path / "tok.json"))
    for module in (pipezero.data, pipezero.engine):
        monkeypatch.setattr(module, "load_corpus", no_text)
    again = [*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--max-steps", "2", "--out", str(run), "--resume",
             "--tokenizer", str(tmp_path / "tok.json")]
    assert_one_line(*run_main(again, capsys),
                    f"the tokenizer changed (it trained with bytes; now {tmp_path / 'tok.json'}, content bpe-")
    assert files(run) == before


def test_resume_onto_changed_data_under_the_same_names_is_refused(trained_run, tmp_path, capsys):
    """The settings name the data by path, and a path keeps its name while its contents change: a
    resume onto edited documents, or onto another tokenizer, would go on training on other tokens
    (the tokenizer was only warned of, the corpus not at all). Refused naming what changed."""
    from pipezero.data.tokenizer import BPETokenizer

    run = copy_trained_run(trained_run, tmp_path / "run")
    docs = Path(shutil.copytree(trained_run.parent / "docs", tmp_path / "docs"))
    before = (run / "metrics.jsonl").read_bytes()
    again = [*TRAIN_TINY_SMALLEST, "--max-steps", "2", "--out", str(run), "--resume", "--data", str(docs)]
    with (docs / "3.txt").open("a") as f:
        f.write(" and one more sentence")
    assert_one_line(*run_main(again, capsys), f"the corpus under --data {docs} changed since it was trained on")
    shutil.rmtree(docs)
    shutil.copytree(trained_run.parent / "docs", docs)
    BPETokenizer.train(["the quick brown fox"] * 4, 300).hf.save(str(tmp_path / "tok.json"))
    assert_one_line(*run_main([*again, "--tokenizer", str(tmp_path / "tok.json")], capsys),
                    f"the tokenizer changed (it trained with bytes; now {tmp_path / 'tok.json'}, content bpe-")
    assert (run / "metrics.jsonl").read_bytes() == before
