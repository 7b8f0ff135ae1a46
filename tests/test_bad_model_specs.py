"""A --model-spec of the user's own that pipezero cannot use is one line, exit 2, before anything is
made: a reference that imports nothing usable, a module that exits or raises, a ModelSpec missing what
the protocol asks, layers that cannot be built, counts that are no counts. Code of the user's that
raises while the run trains is named by file and line; pipezero's own bugs keep their traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main
from tiny_runs import write_docs

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
# a module of a spec S: a subclass of examples/own_model.py's GPTSpec, whose body the test appends
HEAD = f"import sys\nsys.path.insert(0, {EXAMPLES!r})\nfrom own_model import GPTSpec\nclass S(GPTSpec):\n"
# what follows `train --model-spec M:S`: one step of one sequence on docs/, into o/
SPEC_RUN = ["--tokenizer", "bytes", "--packing", "concat", "--data", "docs", "--seq-len", "16",
            "--max-steps", "1", "--no-progress", "--sample-tokens", "0", "--microbatches", "1",
            "--micro-batch-size", "1", "--out", "o"]


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


@pytest.mark.parametrize("tied, needle", [
    ("('layers.0.tok.weight', 'layers.5.nope.weight')",
     "S.tied_names() names layers.5.nope.weight, which is no parameter of layer 5 (Head: ln.weight, ln.bias, "
     "lm.weight)"),
    ("('layers.0.tok.weight', 'layers.1.q.weight')",
     "S.tied_names() gives ('layers.0.tok.weight', 'layers.1.q.weight'); it must name a parameter of layer 0 "
     "(the embedding), then one of layer 5 (the head)"),
    ("('layers.0.pos.weight', 'layers.5.lm.weight')",
     "S.tied_names() ties layers.0.pos.weight (128, 64) to layers.5.lm.weight (256, 64): a tied pair must have "
     "one shape"),
    ("'layers.0.tok.weight'", "S.tied_names() gives 'layers.0.tok.weight'; it must name a parameter of layer 0"),
])
def test_a_spec_whose_tied_names_name_no_tied_pair_is_one_line_before_anything_is_made(tied, needle, tmp_path,
                                                                                         monkeypatch, capsys):
    """tied_names() is read by pipezero's own set-up (StageChunk.tie): a name of no parameter was an
    AttributeError traceback there, and two shapes an error blamed on the user's forward."""
    name = f"spec_tied_{abs(hash(tied)):x}"
    (tmp_path / f"{name}.py").write_text(HEAD + f"    def tied_names(self):\n        return {tied}\n")
    write_docs(tmp_path, 12, "some words to train on, {i} ", 20)
    monkeypatch.chdir(tmp_path)
    assert_one_line(*run_main(["train", "--model-spec", f"{name}:S", *SPEC_RUN], capsys), needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("body, needle", [
    ("    def __init__(self):\n        super().__init__()\n        self.dim = 32\n",
     "S says dim = 32, but layer 0 (Embed) gives activations of shape (1, 8, 64): dim is the width of what "
     "layers 0 to 4 give (what crosses between pipeline ranks); make them agree"),
    ("    def build_layer(self, i):\n        import torch\n        return torch.nn.Linear(64, 128) if i == 2 "
     "else super().build_layer(i)\n",
     "S says dim = 64, but layer 2 (Linear) gives activations of shape (1, 8, 128)"),
    # a forward that cannot run on meta (`.item()`): the width was left unchecked, and the run aborted in gloo
    ("    def build_layer(self, i):\n        import torch\n        if i != 2:\n            return super().build_layer(i)\n"
     "        class Wide(torch.nn.Linear):\n            def forward(self, x):\n"
     "                return super().forward(x) * (1.0 + 0.0 * x.sum().item())\n"
     "        return Wide(64, 128)\n",
     "S says dim = 64, but layer 2 (Wide) gives activations of shape (1, 8, 128)"),
])
def test_a_spec_whose_layers_give_another_width_than_its_dim_is_one_line_before_any_rank(body, needle, tmp_path,
                                                                                          monkeypatch, capsys):
    """spec.dim sizes the buffers activations cross pipeline ranks in: a lie was a C++ abort of gloo
    ('Received data size doesn't match expected size') on every rank, after they started."""
    name = f"spec_dim_{abs(hash(body)):x}"
    (tmp_path / f"{name}.py").write_text(HEAD + body)
    write_docs(tmp_path, 12, "some words to train on, {i} ", 20)
    monkeypatch.chdir(tmp_path)
    assert_one_line(*run_main(["train", "--model-spec", f"{name}:S", *SPEC_RUN], capsys), needle)
    assert not (tmp_path / "o").exists()


def spec_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> tuple[str, Path]:
    """A module of a GPTSpec subclass S with `body` in a fresh working folder beside docs/: its
    name (unique: every test imports its own) and path."""
    name = f"spec_own_{abs(hash(body)):x}"
    path = tmp_path / f"{name}.py"
    path.write_text(HEAD + body)
    write_docs(tmp_path, 12, "some words to train on, {i} ", 20)
    monkeypatch.chdir(tmp_path)
    return name, path


def test_an_init_layer_that_raises_is_one_line_before_anything_is_made(tmp_path, monkeypatch, capsys):
    """Probed at load time on the meta device (and once for real, small layers, where meta fails):
    named by method, layer, file:line and what it said."""
    name, path = spec_module(tmp_path, monkeypatch, "    def init_layer(self, layer, i, seed):\n"
                                                    "        raise KeyError('init ' + str(i))\n")
    code, err = run_main(["train", "--model-spec", f"{name}:S", *SPEC_RUN], capsys)
    assert_one_line(code, err, f"S.init_layer(layer 0) raised KeyError: 'init 0' at {path}:6")
    assert not (tmp_path / "o").exists()


def test_an_init_layer_that_fails_only_on_the_meta_device_is_no_refusal(tmp_path, monkeypatch):
    """The probe runs on meta tensors; `.item()` has no value there, but works for real: not the spec's fault."""
    from pipezero.models.user_spec import load_spec

    name, _ = spec_module(tmp_path, monkeypatch, "    def init_layer(self, layer, i, seed):\n"
                                                 "        super().init_layer(layer, i, seed)\n"
                                                 "        assert float(next(layer.parameters()).sum().item()) == "
                                                 "float(next(layer.parameters()).sum().item())\n")
    assert type(load_spec(f"{name}:S")).__name__ == "S"


def test_a_forward_that_raises_in_training_is_one_line_and_the_folder_is_put_back(tmp_path, monkeypatch, capsys):
    """The layer's forward runs only in the first step, after --out was claimed and config.json
    written: one line naming the function, file:line and message, exit 2; the folder made for the
    run is gone again (no .lock, .run-id, config.json or empty metrics.jsonl left), as a refusal's."""
    name, path = spec_module(tmp_path, monkeypatch, "    def build_layer(self, i):\n"
                                                    "        m = super().build_layer(i)\n"
                                                    "        if i == 1:\n"
                                                    "            def bad(*a, **k):\n"
                                                    "                raise RuntimeError('forward boom')\n"
                                                    "            m.forward = bad\n"
                                                    "        return m\n")
    code, err = run_main(["train", "--model-spec", f"{name}:S", *SPEC_RUN], capsys)
    assert_one_line(code, err, f"S.build_layer.<locals>.bad raised RuntimeError: forward boom at {path}:9")
    assert not (tmp_path / "o").exists(), sorted(p.name for p in (tmp_path / "o").iterdir())


def test_pipezeros_own_bug_in_a_spec_run_keeps_its_traceback(tmp_path, monkeypatch):
    """Only what the user's code raised is the user's line: an exception raised inside pipezero while
    it trains a --model-spec is pipezero's bug, and its traceback stays the report."""
    import pipezero.engine
    from pipezero.cli import main

    name, _ = spec_module(tmp_path, monkeypatch, "    pass\n")
    monkeypatch.setattr(pipezero.engine, "lr_at", pipezero.engine.check_corpus)  # raises inside pipezero
    with pytest.raises(AttributeError, match="check_batch"):
        main(["train", "--model-spec", f"{name}:S", *SPEC_RUN])


def _raise_in(tmp_path: Path, source: str):
    """The exception `go()` of a user module holding `source` raises, with its traceback."""
    mod = tmp_path / f"user_code_{abs(hash(source)):x}.py"
    mod.write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        ns = __import__(mod.stem)
        with pytest.raises(Exception) as caught:
            ns.go()
    finally:
        sys.path.remove(str(tmp_path))
    return caught.value, mod


def test_only_an_exception_the_users_code_raised_is_the_users(tmp_path):
    """Raised in the user's file, or inside torch called from it: the user's line, naming where. Raised
    inside pipezero (even under the user's call): pipezero's own, its traceback kept (None)."""
    from pipezero.models.user_spec import users_fault

    e, mod = _raise_in(tmp_path, "def go():\n    raise ValueError('mine')\n")
    assert f"raised ValueError: mine at {mod}:2; fix it there" in str(users_fault("m:S", e))
    e, mod = _raise_in(tmp_path, "import torch\ndef go():\n    return torch.zeros(2, 3) @ torch.zeros(2, 3)\n")
    assert f"raised RuntimeError: mat1 and mat2 shapes cannot be multiplied" in str(users_fault("m:S", e))
    assert f" at {mod}:3;" in str(users_fault("m:S", e))
    e, _ = _raise_in(tmp_path, "from pipezero.models.user_spec import load_spec\ndef go():\n    load_spec('no colon')\n")
    assert users_fault("m:S", e) is None
    e, _ = _raise_in(tmp_path, "def go():\n    raise MemoryError()\n")  # out of memory: no bug of the spec's
    assert users_fault("m:S", e) is None


@pytest.mark.parametrize("value", ["-5.0", "float('nan')", "float('inf')", "'many'"])
def test_a_spec_whose_flops_per_token_is_no_count_is_refused(value, tmp_path, monkeypatch, capsys):
    """It sets --zero3-prefetch auto's depth and the metrics' MFU: nan or negative would be used as is."""
    name, _ = spec_module(tmp_path, monkeypatch, f"    def flops_per_token(self, n):\n        return {value}\n")
    code, err = run_main(["train", "--model-spec", f"{name}:S", *SPEC_RUN], capsys)
    assert_one_line(code, err, f"S.flops_per_token(")
    assert f"gives {eval(value)!r}" in err and "a number >= 0" in err
    assert not (tmp_path / "o").exists()


def test_a_spec_reference_to_pipezeros_own_main_is_one_line_never_run(tmp_path, monkeypatch, capsys):
    """pipezero.cli:main, if called, would read sys.argv again and run pipezero inside itself ~195
    deep: its declared return type says it makes no spec, so it is never called."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("some words " * 20)
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", "--model-spec", "pipezero.cli:main", *SPEC_RUN], capsys)
    assert_one_line(code, err, "--model-spec 'pipezero.cli:main' gives a int (main's declared return type), "
                               "not a pipezero.models.ModelSpec")
    assert not (tmp_path / "o").exists()


def test_a_spec_factory_that_loads_its_own_reference_again_does_not_recurse(tmp_path, monkeypatch, capsys):
    name = "spec_loop"
    (tmp_path / f"{name}.py").write_text("from pipezero.models.user_spec import load_spec\n"
                                         f"def make():\n    return load_spec('{name}:make')\n")
    monkeypatch.chdir(tmp_path)
    from pipezero.errors import ConfigError
    from pipezero.models.user_spec import load_spec

    with pytest.raises(ConfigError, match=rf"calling make\(\) raised ConfigError: --model-spec '{name}:make' is "
                                          r"loaded again while it is being loaded"):
        load_spec(f"{name}:make")
