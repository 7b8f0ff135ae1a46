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
