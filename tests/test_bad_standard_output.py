"""Standard output as the shell gives it: full (/dev/full), a closed pipe (`| head`), closed (`>&-`).
Where a command's result goes there, a write it refuses is one line, exit 2 (a closed pipe ends
quietly, as SIGPIPE would); where nothing needed is printed, a closed one is no error at all; and an
OSError of a command's own files keeps its own report. All in this process (the fast lane)."""

from __future__ import annotations

import errno
import io
import os

import pytest

from one_line import assert_one_line, run_main


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
