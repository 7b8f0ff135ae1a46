"""The cases round ten's review of bad inputs (issue 33) left undecided, decided: a --model-spec whose
own code raises while the run trains (init_layer, a layer's forward) was that code's traceback inside
pipezero's, exit 1, after --out was made; a spec's flops_per_token negative or nan was taken as it
was; `--model-spec pipezero.cli:main` ran pipezero inside itself ~195 times deep; a jsonl whose every
record was bad said "give more text"; `export --out .` in an empty folder said "Device or resource
busy". Each is one line, exit 2, now."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main

EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples")
HEAD = f"import sys\nsys.path.insert(0, {EXAMPLES!r})\nfrom own_model import GPTSpec\nclass S(GPTSpec):\n"
TRAIN = ["--tokenizer", "bytes", "--packing", "concat", "--data", "docs", "--seq-len", "16",
         "--max-steps", "1", "--no-progress", "--sample-tokens", "0", "--microbatches", "1",
         "--micro-batch-size", "1", "--out", "o"]


def spec_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> tuple[str, Path]:
    """A module of a GPTSpec subclass S with `body` in a fresh working folder beside docs/: its
    name (unique: every test imports its own) and path."""
    name = f"spec10x_{abs(hash(body)):x}"
    path = tmp_path / f"{name}.py"
    path.write_text(HEAD + body)
    (tmp_path / "docs").mkdir()
    for i in range(12):
        (tmp_path / "docs" / f"{i}.txt").write_text(f"some words to train on, {i} " * 20)
    monkeypatch.chdir(tmp_path)
    return name, path


def test_an_init_layer_that_raises_is_one_line_before_anything_is_made(tmp_path, monkeypatch, capsys):
    """Probed at load time on the meta device (and once for real, small layers, where meta fails):
    named by method, layer, file:line and what it said."""
    name, path = spec_module(tmp_path, monkeypatch, "    def init_layer(self, layer, i, seed):\n"
                                                    "        raise KeyError('init ' + str(i))\n")
    code, err = run_main(["train", "--model-spec", f"{name}:S", *TRAIN], capsys)
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
    code, err = run_main(["train", "--model-spec", f"{name}:S", *TRAIN], capsys)
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
        main(["train", "--model-spec", f"{name}:S", *TRAIN])


def _raise_in(tmp_path: Path, source: str):
    """The exception `go()` of a user module holding `source` raises, with its traceback."""
    mod = tmp_path / f"user10x_{abs(hash(source)):x}.py"
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
    """It sets --zero3-prefetch auto's depth and the metrics' MFU: nan or negative was used as it was."""
    name, _ = spec_module(tmp_path, monkeypatch, f"    def flops_per_token(self, n):\n        return {value}\n")
    code, err = run_main(["train", "--model-spec", f"{name}:S", *TRAIN], capsys)
    assert_one_line(code, err, f"S.flops_per_token(")
    assert f"gives {eval(value)!r}" in err and "a number >= 0" in err
    assert not (tmp_path / "o").exists()


def test_a_spec_reference_to_pipezeros_own_main_is_one_line_never_run(tmp_path, monkeypatch, capsys):
    """pipezero.cli:main, called, read sys.argv again: pipezero inside itself ~195 deep, a line each."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("some words " * 20)
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", "--model-spec", "pipezero.cli:main", *TRAIN], capsys)
    assert_one_line(code, err, "--model-spec 'pipezero.cli:main' gives a int (main's declared return type), "
                               "not a pipezero.models.ModelSpec")
    assert not (tmp_path / "o").exists()


def test_a_spec_factory_that_loads_its_own_reference_again_does_not_recurse(tmp_path, monkeypatch, capsys):
    name = "spec10x_loop"
    (tmp_path / f"{name}.py").write_text("from pipezero.models.user_spec import load_spec\n"
                                         f"def make():\n    return load_spec('{name}:make')\n")
    monkeypatch.chdir(tmp_path)
    from pipezero.errors import ConfigError
    from pipezero.models.user_spec import load_spec

    with pytest.raises(ConfigError, match=rf"calling make\(\) raised ConfigError: --model-spec '{name}:make' is "
                                          r"loaded again while it is being loaded"):
        load_spec(f"{name}:make")


def test_a_jsonl_whose_every_record_is_bad_says_so(tmp_path, monkeypatch, capsys):
    """With --on-bad-record skip, every record skipped left no document: "give more text" sent the user
    the wrong way. The same line again when the token cache already holds the (empty) result."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"x": 1}\n' * 20)
    argv = ["train", "--preset", "tiny", "--tokenizer", "bytes", "--data", "d.jsonl", "--on-bad-record", "skip",
            "--seq-len", "16", "--max-steps", "1", "--no-progress", "--out", "o"]
    needle = ("--data holds no document: all 20 records were skipped as bad (first: d.jsonl:1: no field 'text' "
              "(pass --text-field NAME))")
    for _ in range(2):
        code, err = run_main(argv, capsys)
        err = "\n".join(line for line in err.splitlines() if not line.startswith("pipezero: skipped"))
        assert_one_line(code, err, needle)
        assert not (tmp_path / "o").exists()


def test_export_out_the_empty_working_folder_is_one_line(tmp_path, monkeypatch):
    """An export is made beside --out and renamed onto it; the working folder cannot be renamed onto
    (Device or resource busy), and its shell would sit in a removed folder if it could."""
    from pipezero.checkpoint.export_folder import check_out
    from pipezero.errors import ConfigError

    here = tmp_path / "ex"
    here.mkdir()
    monkeypatch.chdir(here)
    for out in (".", str(here), "./"):
        with pytest.raises(ConfigError, match=r"is the working folder, which an export cannot replace .*: give a "
                                              r"new folder inside it, e\.g\. --out "):
            check_out(Path(out), tmp_path / "run")
    check_out(Path("sub"), tmp_path / "run")  # a new folder inside it: fine


def test_a_refused_first_step_drops_only_the_opening_files_the_run_made(tmp_path):
    """drop_opening removes config.json and an empty metrics.jsonl that this run made, so the claim
    puts the folder back; a metrics line (a step trained), or files found there, are kept."""
    from pipezero.rundir import LOCK, RUN_ID, claim

    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    held = claim(str(out), resume=False, force=True)
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text("")
    held.drop_opening()
    held.release()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]

    held = claim(str(out), resume=False, force=True)
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    held.drop_opening()
    held.release()
    assert sorted(p.name for p in out.iterdir()) == sorted([LOCK, RUN_ID, "config.json", "metrics.jsonl", "notes.txt"])
