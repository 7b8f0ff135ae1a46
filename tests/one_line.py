"""Shared by the bad-input tests: run the CLI in this process and hold its refusal to one line."""

from __future__ import annotations

import pytest

from pipezero.cli import main


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit status, stderr) of `pipezero <argv>` run in this process."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors leave through sys.exit
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


def assert_one_line(code: int, err: str, needle: str) -> None:
    """Exit 2, no traceback, and one line from pipezero naming `needle`."""
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("pipezero") and needle in lines[0], err


def assert_one_line_exit_1(code: int, err: str, needle: str) -> None:
    """Exit 1 (a write refused mid-run), no traceback, and one error line naming `needle` (warnings
    and the resume's own line may come before it)."""
    assert code == 1, (code, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if not line.startswith(("pipezero: warning", "pipezero: resumed"))]
    assert len(lines) == 1 and lines[0].startswith("pipezero: error") and needle in lines[0], err


DEEP = "[" * 100_000 + "]" * 100_000  # nested past what Python's json reader follows: a RecursionError
