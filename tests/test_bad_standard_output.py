"""Standard output as the shell gives it: full (/dev/full), a closed pipe (`| head`), closed (`>&-`).
Where a command's result goes there, a write it refuses is one line, exit 2 (a closed pipe ends
quietly, as SIGPIPE would); where nothing needed is printed, a closed one is no error at all; and an
OSError of a command's own files keeps its own report. All in this process (the fast lane)."""

from __future__ import annotations

import errno
import io
import os
import sys

import pytest

from one_line import assert_one_line, run_main
from pipezero.cli import command_line, train


class FailingStream(io.StringIO):
    """A standard output that refuses every write, as /dev/full (ENOSPC) or a closed pipe (EPIPE)."""

    def __init__(self, code: int) -> None:
        super().__init__()
        self.code = code

    def write(self, text: str) -> int:
        raise OSError(self.code, os.strerror(self.code))

    def flush(self) -> None:
        raise OSError(self.code, os.strerror(self.code))


@pytest.mark.parametrize("argv", [["simulate", "--json"], ["simulate"], ["plan", "--preset", "tiny", "--gpus", "1", "--global-batch", "1",
                                                                        "--gpu-memory", "80", "--json"]])
def test_a_full_standard_output_is_one_line(argv, capsys, monkeypatch):
    """`plan --json > /dev/full`: the write of the result is what fails, said in one line."""
    monkeypatch.setattr("sys.stdout", FailingStream(errno.ENOSPC))
    assert_one_line(*run_main(argv, capsys), "cannot write to standard output (No space left on device)")


def test_a_closed_pipe_ends_quietly_as_sigpipe_would(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdout", FailingStream(errno.EPIPE))
    code, err = run_main(["simulate", "--json"], capsys)
    assert (code, err) == (141, "")


def test_a_closed_standard_output_is_refused_where_it_is_the_result(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdout", None)
    assert_one_line(*run_main(["simulate"], capsys), "standard output is closed")


def test_a_full_disk_under_a_commands_own_files_is_not_taken_for_standard_output(tmp_path, capsys, monkeypatch):
    """Only the stream's own failures are output failures: an OSError from a file a command writes
    (here simulate --png's) keeps its own report."""
    from pipezero.telemetry import plot

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plot, "draw_timeline", full)
    assert_one_line(*run_main(["simulate", "--png", str(tmp_path / "t.png")], capsys),
                    "t.png cannot be written: No space left on device")


def test_a_closed_stdout_is_no_traceback_after_a_command_that_prints_nothing_it_needs(monkeypatch, capsys):
    """`pipezero train ... >&-`: sys.stdout is None, and main's flush of it must not turn a finished
    run into an error."""
    monkeypatch.setattr(train, "cmd_train", lambda args: 0)  # looked up when the command runs
    monkeypatch.setattr(sys, "stdout", None)
    assert command_line.main(["train"]) == 0
    assert sys.stdout is None  # put back as it was
    assert "Traceback" not in capsys.readouterr().err


def test_a_rank_ends_without_a_traceback_under_a_closed_stdout(monkeypatch):
    """`train --nproc 2 ... >&-`: exit_rank's flush of sys.stdout (None) must not fail each rank that
    trained, nor make torchrun report a failed job."""
    from pipezero import launch

    def ended(code):
        raise SystemExit(code)

    monkeypatch.setattr(launch.os, "_exit", ended)
    monkeypatch.setattr(sys, "stdout", None)
    with pytest.raises(SystemExit) as e:
        launch.exit_rank(0)
    assert e.value.code == 0
