"""An eighth review of bad inputs (issue 33), as a careless or hostile user: pipes where pipezero
reads a file, folders and disks that refuse a write (read-only, immutable, full), signals during a
save. Each case found is one line naming the input and the fix (exit 2 before anything starts,
exit 1 for a write refused mid-run), no traceback, no hang, and nothing of the user's touched."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main

TRAIN = ["train", "--preset", "tiny", "--max-steps", "1", "--no-progress", "--seq-len", "16", "--tokenizer", "bytes",
         "--sample-tokens", "0", "--microbatches", "1", "--micro-batch-size", "1"]


class Hung(Exception):
    pass


def within(seconds: int, fn):
    """fn() or Hung after `seconds`: a case that waits on a pipe for ever must fail, not hang the suite."""
    def alarm(*_):
        raise Hung(f"still waiting after {seconds} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def fake_run(folder: Path) -> Path:
    """A run folder as a run leaves it (its id, a lock, metrics), without training one."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / ".run-id").write_text("0123456789abcdef\n")
    (folder / ".lock").write_text("")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    return folder


@pytest.mark.parametrize("name", [".run-id", ".lock"])
def test_a_pipe_at_the_runs_id_or_lock_is_named_not_waited_on(name, tmp_path, monkeypatch, capsys):
    """A pipe (FIFO) at OUT/.run-id or OUT/.lock: --resume opened it to read and waited for a
    writer for ever (no message, no exit)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello there " * 100)
    run = fake_run(tmp_path / "run")
    (run / name).unlink()
    os.mkfifo(run / name)
    code, err = within(20, lambda: run_main([*TRAIN, "--data", "docs", "--out", "run", "--resume"], capsys))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if name == ".run-id":
        assert ".run-id is not a regular file" in err, err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_run_id_of_a_pipe_is_none_at_once(tmp_path):
    from pipezero.rundir import run_id

    os.mkfifo(tmp_path / ".run-id")
    assert within(5, lambda: run_id(tmp_path)) is None
