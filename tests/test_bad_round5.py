"""A fifth review of bad inputs (issue 33): the cases it found that lose a user's file, each one
line naming the input, exit 2, nothing of the user's touched. One process each, nothing trained
(the fast lane)."""

from __future__ import annotations

from pathlib import Path

import pytest

from one_line import assert_one_line, run_main

TRAIN = ["train", "--preset", "tiny", "--max-steps", "1", "--no-progress", "--seq-len", "16", "--tokenizer", "bytes"]


def test_a_lock_that_is_a_symlink_is_refused_not_written_through(tmp_path, capsys):
    """`OUT/.lock -> ../mine.txt`: the claim opened the lock through the link and truncated the
    user's file to write its pid there."""
    mine = tmp_path / "mine.txt"
    mine.write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(mine)
    assert_one_line(*run_main([*TRAIN, "--out", str(out)], capsys), ".lock is a symlink")
    assert mine.read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_an_empty_checkpoints_folder_is_no_run_to_resume(tmp_path, capsys):
    """`--resume` in a folder of the user's that holds metrics.jsonl, summary.json and an empty
    `checkpoints` folder (no .run-id) took it for a run and replaced both files at step 0."""
    mine = tmp_path / "mine"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "metrics.jsonl").write_text("my notes")
    (mine / "summary.json").write_text('{"mine": 1}')
    assert_one_line(*run_main([*TRAIN, "--out", str(mine), "--resume"], capsys),
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


def test_the_launchers_variable_set_by_hand_claims_nothing(tmp_path, capsys, monkeypatch):
    """PIPEZERO_RUN_CLAIMED=1 in a lone process (not a rank our launcher started) skipped the claim,
    and the run wrote over the run already in --out without --force."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("the other run's")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIPEZERO_RUN_CLAIMED", "1")
    assert_one_line(*run_main([*TRAIN, "--out", str(out)], capsys), "already holds a run (metrics.jsonl)")
    assert (out / "metrics.jsonl").read_text() == "the other run's"


@pytest.mark.parametrize("edit, needle", [
    ({"data": {"samples": "x"}}, "data.samples 'x' is not a count"),  # was a TypeError traceback on resume
    ({"data": {"samples": -3}}, "data.samples -3 is not a count"),
    ({"data": [1]}, "data is not a dict"),
    ({"adam_steps": -5}, "adam_steps -5 is not a count"),  # was NaN weights after the resumed step
    ({"bad_in_a_row": -1}, "bad_in_a_row -1 is not a count"),
    ({"world": True}, "world True is not a count"),
])
def test_a_manifest_edited_by_hand_is_a_bad_checkpoint(edit, needle, tmp_path):
    from pipezero.checkpoint.store import FORMAT, MANIFEST, CheckpointError, read_manifest

    import json

    step = tmp_path / "step-00000001"
    step.mkdir()
    manifest = {"format": FORMAT, "step": 1, "files": {"a": {"bytes": 1, "sha256": "0" * 64}}, "config": {},
                "world": 1, "adam_steps": 1, "bad_in_a_row": 0, "data": {"samples": 1}}
    (step / MANIFEST).write_text(json.dumps(manifest))
    read_manifest(step)  # as saved: fine
    (step / MANIFEST).write_text(json.dumps({**manifest, **edit}))
    with pytest.raises(CheckpointError, match="bad manifest.json: " + needle):
        read_manifest(step)


def test_pruning_keeps_a_checkpoint_folder_that_holds_a_users_file(tmp_path):
    """A notes.txt put into an old `step-N` folder was deleted with it by --keep-checkpoints: a
    folder holding a file its manifest does not list (or a link to elsewhere) is kept."""
    import json

    from pipezero.checkpoint.store import FORMAT, MANIFEST, prunable

    def checkpoint(step: int) -> Path:
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        (folder / "a").write_text("x")
        (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "step": step, "run": "r",
                                                   "files": {"a": {"bytes": 1, "sha256": "0" * 64}}}))
        return folder

    first, second, third = checkpoint(1), checkpoint(2), checkpoint(3)
    assert prunable(tmp_path, "r", 3) == [first, second, third]
    (first / "notes.txt").write_text("mine")
    third.rename(tmp_path / "real-3")
    third.symlink_to(tmp_path / "real-3")
    assert prunable(tmp_path, "r", 3) == [second]


@pytest.mark.parametrize("text, needle", [
    ("model = 1\n", "model = 1 is a value, not a table: write [model] on a line of its own, its keys under it"),
    ("[[model]]\ndim = 3\n", "[[model]] is an array of tables: write [model], once"),
    ("foo = 1\n", "unknown table [foo]; use one of model"),
])
def test_a_section_that_is_not_a_table_is_named_as_what_it_is(text, needle, tmp_path, capsys):
    """`model = 1` was refused as "unknown table [model]; use one of model, ...": a contradiction."""
    (tmp_path / "c.toml").write_text(text)
    assert_one_line(*run_main([*TRAIN, "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o")], capsys),
                    needle)


def test_doctor_does_not_wait_on_a_pipe_named_summary_json(tmp_path, capsys):
    """`doctor RUN` where RUN/summary.json is a named pipe waited for a writer for ever."""
    import os

    from pipezero.doctor import cmd_doctor

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "summary.json")
    assert cmd_doctor(type("Args", (), {"run": str(run)})()) == 1  # no records: the usual answer, at once
    assert "no flight records" in capsys.readouterr().err


def test_a_cache_entry_edited_to_hold_an_id_past_the_vocabulary_is_rebuilt(tmp_path, capsys, monkeypatch):
    """Token files are only sized at each open (they are the bulk): bytes edited in place to an id
    past the tokenizer's vocabulary passed, and the embedding's IndexError ended the run in a traceback."""
    import numpy as np

    from test_bad_data import _arrays, _documents

    from pipezero.data import load_corpus
    from pipezero.util import cache_dir

    monkeypatch.setenv("PIPEZERO_CACHE", str(tmp_path / "cache"))
    cfg = _documents(tmp_path)
    before = _arrays(load_corpus(cfg))
    [entry] = cache_dir().glob("docs-*")
    capsys.readouterr()
    tokens = entry / "train.tokens"
    tokens.write_bytes(b"\xff\xff" + tokens.read_bytes()[2:])
    after = _arrays(load_corpus(cfg))
    assert all(np.array_equal(a, b) for a, b in zip(before, after))
    err = capsys.readouterr().err
    assert f"the token cache entry {entry} is damaged (train.tokens holds id 65535" in err, err
    assert err.count("\n") == 1
