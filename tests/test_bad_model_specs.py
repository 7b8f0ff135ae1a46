"""A --model-spec of the user's own that pipezero cannot use is one line, exit 2, before anything is
made: a reference that imports nothing usable, a module that exits or raises, a ModelSpec missing what
the protocol asks, layers that cannot be built, counts that are no counts. Code of the user's that
raises while the run trains is named by file and line; pipezero's own bugs keep their traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
# a module of a spec S: a subclass of examples/own_model.py's GPTSpec, whose body the test appends
HEAD = f"import sys\nsys.path.insert(0, {EXAMPLES!r})\nfrom own_model import GPTSpec\nclass S(GPTSpec):\n"


def test_a_spec_module_that_exits_on_import_is_one_line(tmp_path, capsys, monkeypatch):
    """Its sys.exit must not end pipezero with the module's status (0, nothing trained, nothing said)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(0)\n")
    assert_one_line(*run_main(["train", "--model-spec", "exits_on_import:X", "--max-steps", "1"], capsys),
                    "--model-spec 'exits_on_import:X': importing exits_on_import called sys.exit(0)")


@pytest.mark.parametrize("body, needle", [
    ("    pass\n", "S gives no integer >= 1 as n_layers, dim, vocab_size"),
    ("    n_layers, dim, vocab_size = 2, '64', 256\n", "S gives no integer >= 1 as dim"),
    ("    n_layers, dim, vocab_size = 2, 64, 256\n    def build_layer(self, i):\n        return None\n",
     "S does not define init_layer, layer_param_counts, flops_per_token"),
])
def test_a_spec_subclass_missing_what_modelspec_asks_is_one_line(body, needle, tmp_path, monkeypatch, capsys):
    """`class S(ModelSpec): pass` is named by what it lacks, not met later as an AttributeError
    ('S' object has no attribute 'n_layers')."""
    from one_line import assert_one_line, run_main

    name = f"spec_{abs(hash(body))}"  # a module name of its own: one imported stays in sys.modules
    (tmp_path / f"{name}.py").write_text(f"from pipezero.models import ModelSpec\nclass S(ModelSpec):\n{body}")
    monkeypatch.chdir(tmp_path)
    assert_one_line(*run_main(["train", "--model-spec", f"{name}:S", "--tokenizer", "bytes", "--max-steps", "1"],
                              capsys), f"--model-spec '{name}:S': {needle}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".pyc" and p.name != "__pycache__") == [f"{name}.py"]


@pytest.mark.parametrize("source, ref, needle", [
    ("raise RuntimeError('boom at import')\n", "X", "importing {m} raised RuntimeError: boom at import at {f}:1"),
    ("def f(:\n    pass\n", "X", "importing {m} raised SyntaxError"),
    ("import not_a_package_anywhere_xyz\n", "X", "importing {m} raised ModuleNotFoundError"),
    ("def make():\n    return 1 / 0\n", "make", "calling make() raised ZeroDivisionError: division by zero at {f}:2"),
])
def test_a_spec_module_that_raises_is_one_line_naming_where(source, ref, needle, tmp_path, monkeypatch, capsys):
    """A module that raises at import, will not compile, imports a missing package, or a spec function
    that raises: one line, exit 2, naming the file and line and how to see the whole traceback,
    before anything is made."""
    from one_line import assert_one_line, run_main

    name = f"spec_raises_{abs(hash(source))}"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", "--model-spec", f"{name}:{ref}", "--tokenizer", "bytes", "--max-steps", "1"], capsys)
    assert_one_line(code, err, needle.format(m=name, f=path))
    assert f"python -c 'import {name}'" in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".pyc" and p.name != "__pycache__") == [path.name]


@pytest.mark.parametrize("body, needle", [
    ("    def build_layer(self, i):\n        raise ValueError('no layer %d' % i)\n",
     "raised ValueError: no layer 0 at {f}:6"),
    ("    def build_layer(self, i):\n        return None\n",
     "S.build_layer(0) gives a NoneType, not a torch.nn.Module"),
    ("    def layer_param_counts(self):\n        return [1]\n",
     "S.layer_param_counts() gives 1 counts; it must give one a layer, n_layers + 2 = 6"),
    ("    def layer_param_counts(self):\n        return [1, 2, -3, 4, 5, 6]\n",
     "S.layer_param_counts() gives [1, 2, -3, 4, 5, 6]; it must give one integer >= 0 a layer"),
])
def test_a_spec_whose_layers_cannot_be_built_is_one_line_before_anything_is_made(body, needle, tmp_path, monkeypatch,
                                                                                  capsys):
    name = f"spec_layers_{abs(hash(body))}"
    path = tmp_path / f"{name}.py"
    path.write_text(HEAD + body)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("some words to train on " * 20)
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", "--model-spec", f"{name}:S", "--tokenizer", "bytes", "--packing", "concat",
                          "--data", "docs", "--seq-len", "16", "--max-steps", "1", "--no-progress", "--out", "o"],
                         capsys)
    assert_one_line(code, err, needle.format(f=path))
    assert not (tmp_path / "o").exists()
