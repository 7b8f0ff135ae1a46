"""--resume continues a run pipezero started from its newest sound checkpoint, or refuses in one line
naming the folder and the fix, exit 2, before anything is written: a folder no run claimed, a run
with no checkpoint of its own to continue from, damaged checkpoints, a step past --max-steps, a
folder in use. The run's records (metrics.jsonl, summary.json, trace.json) are never replaced by a
fresh step 0. Most tests work on copies of one tiny trained run (tests/tiny_runs.py)."""

from __future__ import annotations

import pytest

from one_line import assert_one_line, run_main
from tiny_runs import TRAIN_TINY_BYTES


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
