"""A run's folder (--out) holds the user's files as safely as the run's own: what pipezero would write
over, follow, or fail to write there is one line naming the path and the fix, exit 2 before anything
starts (exit 1 for a write refused mid-run), and nothing of the user's is touched. The claim of a
folder (.lock, .run-id) and --force are here; what --resume refuses is tests/test_bad_resume.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main
from tiny_runs import TRAIN_TINY


@pytest.mark.parametrize("name, make, needle", [
    ("summary.json", Path.mkdir, "summary.json is a folder, where the run writes a file"),
    ("trace.json", Path.mkdir, "trace.json is a folder, where the run writes a file"),
    ("metrics.jsonl", os.mkfifo, "metrics.jsonl is not a regular file"),
    ("checkpoints", lambda p: p.write_text("x"), "checkpoints is a file, where the run writes a folder"),
    ("tensorboard", lambda p: p.write_text("x"), "tensorboard is a file, where the run writes a folder"),
    (".run-id", Path.mkdir, ".run-id is a folder, where the run writes a file"),  # not an IsADirectoryError later
])
def test_a_run_name_of_the_other_kind_is_refused_before_training(name, make, needle, tmp_path, capsys):
    """Each would fail (or hang, for a pipe) only after the training, when first written: checked first."""
    out = tmp_path / "o"
    out.mkdir()
    make(out / name)
    data = tmp_path / "a.txt"
    data.write_text("hello there " * 50)
    assert_one_line(*run_main([*TRAIN_TINY, "--data", str(data), "--out", str(out), "--force"], capsys), needle)
    assert sorted(p.name for p in out.iterdir()) == [name]  # no lock, no run id left behind


def test_a_run_id_that_is_not_text_claims_nothing(tmp_path):
    """A .run-id that is not text is no id pipezero wrote: read as a missing one."""
    from pipezero.rundir import RUN_ID, run_id

    (tmp_path / RUN_ID).write_bytes(b"\xff\xfe")
    assert run_id(tmp_path) is None
