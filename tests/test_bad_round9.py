"""A ninth review of bad inputs (issue 33), as a careless or hostile user: what it found. An --out
(or any folder pipezero writes a file into) spelled through a symlink and then '..' was a traceback,
and a closed standard output ended a finished training run in one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pipezero import cli
from pipezero.rundir import claim
from pipezero.util import atomic_write_bytes


def link_then_up(root: Path) -> str:
    """root/lnk -> deep/x, so 'lnk/../o' is deep/o to the filesystem but ./o to os.path.abspath."""
    (root / "deep" / "x").mkdir(parents=True)
    (root / "lnk").symlink_to("deep/x")
    return "lnk/../o"


def test_a_file_written_through_a_link_then_dotdot_lands_where_the_filesystem_puts_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = link_then_up(tmp_path)
    atomic_write_bytes(Path(out) / "f.json", b"{}")  # was FileNotFoundError: ./o/.f.json.XXXX.tmp
    assert (tmp_path / "deep" / "o" / "f.json").read_bytes() == b"{}"
    assert not (tmp_path / "o").exists()
    assert [p.name for p in (tmp_path / "deep" / "o").iterdir()] == ["f.json"]  # no temporary file left


def test_a_run_folder_through_a_link_then_dotdot_is_claimed(tmp_path, monkeypatch):
    """`train --out lnk/../o` made deep/o, locked it, then failed writing its .run-id (a traceback)."""
    monkeypatch.chdir(tmp_path)
    held = claim(link_then_up(tmp_path), False, False)
    try:
        assert len((tmp_path / "deep" / "o" / ".run-id").read_text().strip()) == 16
    finally:
        held.release()


def test_a_closed_stdout_is_no_traceback_after_a_command_that_prints_nothing_it_needs(monkeypatch, capsys):
    """`pipezero train ... >&-` trained, then main's flush of sys.stdout (None) was an AttributeError, exit 1."""
    monkeypatch.setattr(cli, "cmd_train", lambda args: 0)  # the parser binds it when main builds it
    monkeypatch.setattr(sys, "stdout", None)
    assert cli.main(["train"]) == 0
    assert sys.stdout is None  # put back as it was
    assert "Traceback" not in capsys.readouterr().err


def test_ctrl_c_inside_a_checkpoint_write_stays_an_interrupt():
    """Ctrl-C while DCP wrote a checkpoint said 'checkpoint write of ... failed: rank 0:
    KeyboardInterrupt', exit 1, not the interrupt's line ('--resume continues ...') and 130."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from pipezero.checkpoint.store import CheckpointError, Team

    def interrupted():
        raise CheckpointException("save", {0: (KeyboardInterrupt(), traceback.StackSummary())})

    def refused():
        raise CheckpointException("save", {0: (OSError(28, "No space left on device"), traceback.StackSummary())})

    with pytest.raises(KeyboardInterrupt):
        Team().run("write of x", interrupted)
    with pytest.raises(CheckpointError, match="rank 0, step 0: checkpoint write of x failed: rank 0: OSError"):
        Team().run("write of x", refused)


@pytest.mark.parametrize("body, needle", [
    ("    pass\n", "S gives no integer >= 1 as n_layers, dim, vocab_size"),
    ("    n_layers, dim, vocab_size = 2, '64', 256\n", "S gives no integer >= 1 as dim"),
    ("    n_layers, dim, vocab_size = 2, 64, 256\n    def build_layer(self, i):\n        return None\n",
     "S does not define init_layer, layer_param_counts, flops_per_token"),
])
def test_a_spec_subclass_missing_what_modelspec_asks_is_one_line(body, needle, tmp_path, monkeypatch, capsys):
    """`class S(ModelSpec): pass` was an AttributeError traceback ('S' object has no attribute 'n_layers')."""
    from one_line import assert_one_line, run_main

    name = f"spec_{abs(hash(body))}"  # a module name of its own: one imported stays in sys.modules
    (tmp_path / f"{name}.py").write_text(f"from pipezero.models import ModelSpec\nclass S(ModelSpec):\n{body}")
    monkeypatch.chdir(tmp_path)
    assert_one_line(*run_main(["train", "--model-spec", f"{name}:S", "--tokenizer", "bytes", "--max-steps", "1"],
                              capsys), f"--model-spec '{name}:S': {needle}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".pyc" and p.name != "__pycache__") == [f"{name}.py"]


def test_a_rank_ends_without_a_traceback_under_a_closed_stdout(monkeypatch):
    """`train --nproc 2 ... >&-`: every rank trained, then exit_rank's sys.stdout.flush() was an
    AttributeError traceback on each, and torchrun's report of the failed job, exit 1."""
    from pipezero import launch

    def ended(code):
        raise SystemExit(code)

    monkeypatch.setattr(launch.os, "_exit", ended)
    monkeypatch.setattr(sys, "stdout", None)
    with pytest.raises(SystemExit) as e:
        launch.exit_rank(0)
    assert e.value.code == 0


@pytest.mark.parametrize("source, ref, needle", [
    ("raise RuntimeError('boom at import')\n", "X", "importing {m} raised RuntimeError: boom at import at {f}:1"),
    ("def f(:\n    pass\n", "X", "importing {m} raised SyntaxError"),
    ("import not_a_package_anywhere_xyz\n", "X", "importing {m} raised ModuleNotFoundError"),
    ("def make():\n    return 1 / 0\n", "make", "calling make() raised ZeroDivisionError: division by zero at {f}:2"),
])
def test_a_spec_module_that_raises_is_one_line_naming_where(source, ref, needle, tmp_path, monkeypatch, capsys):
    """Round nine left these as the user's own traceback (a module that raises at import, will not
    compile, imports a missing package, or a spec function that raises): now one line, exit 2, naming
    the file and line and how to see the whole traceback, before anything is made."""
    from one_line import assert_one_line, run_main

    name = f"spec_raises_{abs(hash(source))}"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", "--model-spec", f"{name}:{ref}", "--tokenizer", "bytes", "--max-steps", "1"], capsys)
    assert_one_line(code, err, needle.format(m=name, f=path))
    assert f"python -c 'import {name}'" in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".pyc" and p.name != "__pycache__") == [path.name]
