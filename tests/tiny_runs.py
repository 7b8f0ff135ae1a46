"""One-step runs of the tiny preset, as the bad-input tests start them in this process: their argv,
a folder of documents to train on, a run folder as a run leaves it, and two trained runs (one a
session) for the tests that work on copies of a real one."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path

import pytest

TRAIN_TINY = ["train", "--preset", "tiny", "--max-steps", "1", "--no-progress", "--seq-len", "16"]
TRAIN_TINY_BYTES = [*TRAIN_TINY, "--tokenizer", "bytes"]
# one sequence a step, no sample at the end: the least a step can do
TRAIN_TINY_SMALLEST = [*TRAIN_TINY_BYTES, "--sample-tokens", "0", "--microbatches", "1", "--micro-batch-size", "1"]
VERIFY_TINY = ["verify", "--preset", "tiny", "--steps", "1", "--seq-len", "16", "--tokenizer", "bytes"]
# the model and the step of the smallest runs, for commands of any name
TINY_FLAGS = ["--preset", "tiny", "--tokenizer", "bytes", "--seq-len", "16", "--microbatches", "1",
              "--micro-batch-size", "1"]


def write_docs(folder: Path, count: int = 12, line: str = "document {i}: hello there, general kenobi ",
               times: int = 8) -> Path:
    """folder/docs holding `count` text files, file i `line` (with its number) `times` over."""
    docs = folder / "docs"
    docs.mkdir()
    for i in range(count):
        (docs / f"{i}.txt").write_text(line.format(i=i) * times)
    return docs


def no_launch(*args, **kwargs):
    """Stands in for pipezero.launch.launch_local where a command must be refused before any rank starts."""
    raise AssertionError("a rank was started")


def fake_run(folder: Path) -> Path:
    """A run folder as a run leaves it (its id, a lock, metrics), without training one."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / ".run-id").write_text("0123456789abcdef\n")
    (folder / ".lock").write_text("")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    return folder


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder of one step of the tiny preset, checkpointed (RUN/checkpoints/step-00000001),
    trained on the documents in RUN/../docs (`data_of`). Tests work on copies (`copy_trained_run`)."""
    from pipezero.cli import main

    root = tmp_path_factory.mktemp("trained-run")
    docs = root / "docs"
    docs.mkdir()
    words = "the quick brown fox jumps over a lazy dog".split()
    for i in range(40):
        (docs / f"{i}.txt").write_text(" ".join(words[i % 9:] + words[:i % 9]) * 4)
    run = root / "run"
    assert main([*TRAIN_TINY_SMALLEST, "--out", str(run), "--data", str(docs)]) == 0
    assert (run / "checkpoints" / "step-00000001" / "manifest.json").is_file()
    return run


def data_of(trained_run: Path) -> list[str]:
    """The --data flag the trained run was trained with."""
    return ["--data", str(trained_run.parent / "docs")]


def copy_trained_run(trained_run: Path, dest: Path) -> Path:
    """A copy of the trained run at `dest`, without its lock."""
    shutil.copytree(trained_run, dest)
    (dest / ".lock").unlink(missing_ok=True)
    return dest


@pytest.fixture(scope="session")
def trained_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding docs/ (`write_docs`) and run/, one tiny run of one step trained there with
    relative paths, for the tests that need a real run beside its data (`copy_trained_folder`)."""
    from pipezero.cli import main

    where = tmp_path_factory.mktemp("trained-folder")
    write_docs(where)
    cwd = os.getcwd()
    os.chdir(where)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            assert main([*TRAIN_TINY_SMALLEST, "--data", "docs", "--out", "run"]) == 0
    finally:
        os.chdir(cwd)
    return where


def copy_trained_folder(trained_folder: Path, to: Path) -> None:
    """The trained run beside docs/ in `to` (docs made by the test), as if trained there."""
    shutil.copytree(trained_folder / "run", to / "run")
