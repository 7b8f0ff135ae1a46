"""A --model-spec of the user's own that pipezero cannot use is one line, exit 2, before anything is
made: a reference that imports nothing usable, a module that exits or raises, a ModelSpec missing what
the protocol asks, layers that cannot be built, counts that are no counts. Code of the user's that
raises while the run trains is named by file and line; pipezero's own bugs keep their traceback."""

from __future__ import annotations

import sys

import pytest

from one_line import assert_one_line, run_main


def test_a_spec_module_that_exits_on_import_is_one_line(tmp_path, capsys, monkeypatch):
    """Its sys.exit must not end pipezero with the module's status (0, nothing trained, nothing said)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    assert_one_line(*run_main(["train", "--model-spec", "exits_on_import:X", "--max-steps", "1"], capsys),
                    "--model-spec 'exits_on_import:X': importing exits_on_import called sys.exit(0)")
