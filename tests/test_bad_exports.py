"""Nothing a user owns is lost around export, checkpoint saves and run folders.

An export writes only into a folder it creates or that is empty (written whole beside it, then
renamed into place), never through a symlink, never into a run's own checkpoints; a checkpoint
save never removes a folder it did not write; a refused run leaves its --out as it found it; and
each refusal is one line naming the input and the fix, exit 2. One run is trained in this process
for the whole module (a 2-block random Llama, one step); each test works on copies of it.

Every refusal of `pipezero export` is here but for rules held across every command, each tested
where the rule is, with export among its cases: an empty value (test_bad_inputs.py
`test_bad_simulate_and_plan_input_is_one_line`, `test_an_empty_value_is_refused_not_read_as_absent`),
a name too long for the filesystem (test_bad_inputs.py), `~` a shell did not expand and an --out
through a symlink loop (test_bad_run_folders.py), a shard cut short (test_bad_resume.py, beside
--resume), Ctrl-C while torch is imported (test_launcher.py), a Hugging Face folder moved after the
run (test_hf.py) and a --model-spec of one's own (test_own_model.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from hf_models import make_model
from one_line import assert_one_line_exit_1
from pipezero.cli import main
from test_bad_inputs import assert_one_line, run_main
from tiny_runs import copy_trained_folder, write_docs
from user_files import tree

pytest.importorskip("transformers")

SMALL = ["--seq-len", "16", "--no-progress", "--sample-tokens", "0", "--microbatches", "1",
         "--micro-batch-size", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`model` (a random 2-block Llama folder), `docs` (a few text files) and `run`: one step of
    fine-tuning `model` on `docs`, checkpointed (RUN/checkpoints/step-00000001, RUN/hf)."""
    import inspect

    root = tmp_path_factory.mktemp("exports")
    model = make_model(root / "model", "llama", num_hidden_layers=2)
    docs = root / "docs"
    docs.mkdir()
    text = inspect.getsource(inspect)
    for i in range(6):
        (docs / f"{i}.txt").write_text(text[i * 4000:(i + 1) * 4000])
    run = root / "run"
    assert main(["train", "--model", str(model), "--data", str(docs), "--max-steps", "1", "--checkpoint-every", "1",
                 "--out", str(run), *SMALL]) == 0
    assert (run / "checkpoints" / "step-00000001" / "manifest.json").is_file() and (run / "hf").is_dir()
    return {"model": model, "docs": docs, "run": run}


def copy_run(trained: dict[str, Path], dest: Path, checkpoints: bool = True) -> Path:
    """A copy of the module's run (without its checkpoints: as a run without --checkpoint-every
    leaves its folder), for a test to change."""
    skip = shutil.ignore_patterns("checkpoints") if not checkpoints else None
    shutil.copytree(trained["run"], dest, ignore=skip)
    return dest


def no_debris(folder: Path) -> None:
    """No half-written export (`.NAME.*.tmp`) is left in `folder`."""
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")], sorted(p.name for p in folder.iterdir())


# 1. the default export never writes over a folder that holds files


def test_the_default_export_never_writes_over_the_model_folder(trained, tmp_path, capsys):
    """`pipezero export RUN --out MODEL` replaced the model's config.json and model.safetensors (so
    `train --model MODEL` failed after); over an earlier --format hf export it mixed both formats.
    Both are refused like --format hf's, the folder untouched."""
    model = tmp_path / "m"
    shutil.copytree(trained["model"], model)
    before = tree(model)
    assert_one_line(*run_main(["export", str(trained["run"]), "--out", str(model)], capsys), "already holds files")
    assert tree(model) == before
    hf = tmp_path / "hf-export"
    assert main(["export", str(trained["run"]), "--format", "hf", "--out", str(hf)]) == 0
    before = tree(hf)
    assert_one_line(*run_main(["export", str(trained["run"]), "--out", str(hf)], capsys), "already holds files")
    assert tree(hf) == before
    no_debris(tmp_path)


def test_the_default_export_writes_a_new_or_empty_folder_whole(trained, tmp_path, capsys):
    """Into a new folder or an empty one, written beside it and renamed into place (no debris), with
    the permissions a folder made by the user has (a temporary folder is private, 0700)."""
    from pipezero.checkpoint.export import load_exported

    empty = tmp_path / "empty"
    empty.mkdir()
    umask = os.umask(0)
    os.umask(umask)
    for out in (tmp_path / "new" / "deeper", empty):
        assert main(["export", str(trained["run"]), "--out", str(out)]) == 0
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
        load_exported(out)
        no_debris(out.parent)
    assert (tmp_path / "new" / "deeper").stat().st_mode & 0o777 == 0o777 & ~umask
    hf = tmp_path / "hf"
    assert main(["export", str(trained["run"]), "--format", "hf", "--out", str(hf)]) == 0
    assert hf.stat().st_mode & 0o777 == 0o777 & ~umask


def test_an_export_that_fails_midway_leaves_nothing_behind(trained, tmp_path, capsys, monkeypatch):
    """A disk that fills up mid-export: one line (exit 1), no half folder, not even the parents made
    for --out, and no temporary file in --out."""
    import pipezero.checkpoint.export as export

    def full_disk(model, path):
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "save_model", full_disk)
    code, err = run_main(["export", str(trained["run"]), "--out", str(tmp_path / "a" / "b")], capsys)
    assert code == 1 and err.count("\n") == 1 and "No space left on device" in err, err
    assert list(tmp_path.iterdir()) == []


# 2. a checkpoint save never removes a folder it did not write; export never writes into a run's own folders


@pytest.mark.parametrize("fmt", ["pipezero", "hf"])
def test_export_never_writes_into_a_runs_own_folders(trained, tmp_path, capsys, fmt):
    """An export inside RUN/checkpoints (where a later save of that step, or the debris cleaning,
    deletes it), into RUN/hf (the run rewrites it at every start), the run folder itself, or inside
    the very checkpoint exported: refused in one line, nothing written."""
    run = copy_run(trained, tmp_path / "run")
    ckpt = run / "checkpoints" / "step-00000001"
    moved = tmp_path / "moved"  # a checkpoint outside any run: exported into another run's checkpoints
    shutil.copytree(ckpt, moved)
    (tmp_path / "link").symlink_to(run / "checkpoints")
    before = tree(run)
    cases = [(run, run / "checkpoints" / "step-00000002", "inside the checkpoints folder of run"),
             (ckpt, tmp_path / "link" / "step-00000002", "inside the checkpoints folder of run"),
             (moved, run / "checkpoints" / ".tmp-step-00000002", "inside the checkpoints folder of run"),
             (run, run / "checkpoints" / "exports" / "mine", "inside the checkpoints folder of run"),
             (ckpt, run / "hf", "already holds files"),
             (run, run, "already holds files"),
             (ckpt, ckpt / "export", "is inside the checkpoint"),
             (run, moved / "export", "is inside the checkpoint")]
    for source, out, needle in cases:
        assert_one_line(*run_main(["export", str(source), "--format", fmt, "--out", str(out)], capsys), needle)
        assert tree(run) == before, (source, out)
    assert not (moved / "export").exists()
    shutil.rmtree(run / "hf")  # RUN/hf missing (it is only read back): still the run's own
    before = tree(run)
    assert_one_line(*run_main(["export", str(run), "--format", fmt, "--out", str(run / "hf")], capsys),
                    "the run's own hf folder")
    assert tree(run) == before


def test_a_save_never_removes_what_it_did_not_write(tmp_path):
    """store.write replaced whatever sat at checkpoints/step-N: an export, a user's file, another
    run's checkpoint. It refuses instead, naming the path and the fix, and leaves nothing behind; its
    own checkpoint of that step (one that failed its checksum) it still replaces."""
    from pipezero.checkpoint.store import CheckpointError, Team, committed, write

    root = tmp_path / "checkpoints"
    export = root / "step-00000002"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"mine")
    (root / "step-00000003").write_text("a file of mine")
    write(root, 4, {"x": torch.zeros(4)}, {"run": "other"}, keep=5, team=Team())
    before = tree(root)
    for step in (2, 3, 4):
        with pytest.raises(CheckpointError, match=rf"{root}/step-0000000{step} .*not a checkpoint this run wrote"):
            write(root, step, {"x": torch.ones(4)}, {"run": "this"}, keep=5, team=Team())
        assert tree(root) == before
    own = write(root, 5, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    (own / "__0_0.distcp").write_bytes(b"bit rot")
    again = write(root, 5, {"x": torch.ones(4)}, {"run": "this"}, keep=5, team=Team())
    assert again == own and (own / "__0_0.distcp").read_bytes() != b"bit rot"
    assert [s for s, _ in committed(root)] == [4, 5]


def test_a_run_that_would_save_over_a_folder_it_did_not_write_is_refused_before_training(trained, tmp_path, capsys):
    """`export --format hf --out RUN/checkpoints/step-00000002` was accepted, and a later `--resume
    --max-steps 2` deleted it without a word at its save. The run is refused before it trains, one
    line naming the folder and the fix; likewise a --force run beside it."""
    run = copy_run(trained, tmp_path / "run")
    export = run / "checkpoints" / "step-00000002"
    assert main(["export", str(trained["run"]), "--format", "hf", "--out", str(tmp_path / "e")]) == 0
    shutil.copytree(tmp_path / "e", export)  # as the export there was accepted
    before = tree(run)
    base = ["train", "--model", str(trained["model"]), "--data", str(trained["docs"]), "--max-steps", "2",
            "--out", str(run), *SMALL]
    for flags in (["--resume", "--checkpoint-every", "1"], ["--force", "--checkpoint-every", "2"]):
        assert_one_line(*run_main([*base, *flags], capsys), f"{export} is not a checkpoint this run wrote")
        after = tree(run)
        assert after.pop(".lock") and after == {k: v for k, v in before.items() if k != ".lock"}, flags  # the
        # lock file, which was there, holds the pid of the last process that locked it


# 3. an export's config must describe the checkpoint's weights


def test_hf_export_refuses_a_config_that_does_not_match_the_weights(trained, tmp_path, capsys):
    """A moved checkpoint exports with the --model folder's config.json, a run's with RUN/hf's:
    when that file no longer describes the weights (the folder was changed after training), the
    export wrote a folder transformers cannot load, exit 0. The manifest holds the model's shape:
    the mismatch is refused in one line naming the file."""
    run = copy_run(trained, tmp_path / "run")
    config = json.loads((run / "hf" / "config.json").read_text())
    (run / "hf" / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "num_hidden_layers": 3}))
    assert_one_line(*run_main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "e1")], capsys),
                    f"{run / 'hf' / 'config.json'} does not describe the weights of")
    assert not (tmp_path / "e1").exists()
    moved = tmp_path / "moved"
    shutil.copytree(trained["run"] / "checkpoints" / "step-00000001", moved)
    model_config = trained["model"] / "config.json"
    kept = model_config.read_bytes()
    try:
        model_config.write_text(json.dumps({**json.loads(kept), "intermediate_size": 96}))
        code, err = run_main(["export", str(moved), "--format", "hf", "--out", str(tmp_path / "e2")], capsys)
    finally:
        model_config.write_bytes(kept)
    assert_one_line(code, err, f"{model_config} does not describe the weights of")
    assert "ffn_dim" in err and not (tmp_path / "e2").exists()
    no_debris(tmp_path)


# 4. --out that is a symlink, or where no folder can be made


@pytest.mark.parametrize("fmt", ["pipezero", "hf"])
def test_export_out_that_is_a_symlink_or_cannot_be_made_is_one_line(trained, tmp_path, capsys, fmt):
    model = tmp_path / "m"
    shutil.copytree(trained["model"], model)
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for name, target in (("to-model", model), ("to-empty", empty), ("dangling", tmp_path / "nowhere")):
        (tmp_path / name).symlink_to(target)
    before = tree(tmp_path)
    cases = [(tmp_path / "to-model", "is a symlink"), (tmp_path / "to-empty", "is a symlink"),
             (tmp_path / "dangling", "is a symlink"), (a_file, "is a file, not a folder"),
             (a_file / "sub", "cannot be made"), (Path("/proc/pipezero-no-such-export"), "cannot be made"),
             ("", "--out is empty")]
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        (tmp_path / "ro").mkdir(mode=0o500)
        cases.append((tmp_path / "ro" / "export", "cannot be made"))
        before = tree(tmp_path)
    for out, needle in cases:
        assert_one_line(*run_main(["export", str(trained["run"]), "--format", fmt, "--out", str(out)], capsys),
                        needle)
        assert tree(tmp_path) == before, out


# 5. a refused run leaves its --out as it found it


def test_a_refused_run_leaves_its_folder_as_it_found_it(trained, tmp_path, capsys):
    """A run refused after it claimed --out (here: too few documents for the global batch, found when
    the corpus is read) left --out/.lock and .run-id behind, and the folders it made; a refusal of
    the claim itself (a folder holding a run) left a .lock there. Now nothing is left or changed."""
    base = ["train", "--model", str(trained["model"]), "--data", str(trained["docs"]), "--max-steps", "1",
            "--seq-len", "16", "--no-progress"]
    too_big = ["--microbatches", "64", "--micro-batch-size", "64"]
    assert_one_line(*run_main([*base, *too_big, "--out", str(tmp_path / "a" / "b" / "run")], capsys),
                    "give more documents")
    assert not (tmp_path / "a").exists()
    run = copy_run(trained, tmp_path / "run")
    (run / ".lock").unlink()
    before = tree(run)
    assert_one_line(*run_main([*base, "--out", str(run)], capsys), "already holds a run")
    assert tree(run) == before
    assert_one_line(*run_main([*base, *too_big, "--resume", "--max-steps", "2", "--out", str(run)], capsys),
                    "give more documents")
    assert tree(run) == before


# 6. a run that saved no checkpoint


@pytest.mark.parametrize("fmt", ["pipezero", "hf"])
def test_export_of_a_run_that_saved_no_checkpoint_is_one_line(trained, tmp_path, capsys, fmt):
    """`pipezero export RUN` after a run without --checkpoint-every failed with `unreadable
    manifest.json`; a folder that is no run nor checkpoint (the documents, the model) likewise."""
    run = copy_run(trained, tmp_path / "run", checkpoints=False)
    assert_one_line(*run_main(["export", str(run), "--format", fmt, "--out", str(tmp_path / "e")], capsys),
                    f"{run} saved no checkpoint: its checkpoints are gone (removed, or it stopped before its first "
                    f"save)")
    for folder in (trained["docs"], trained["model"]):
        assert_one_line(*run_main(["export", str(folder), "--format", fmt, "--out", str(tmp_path / "e")], capsys),
                        f"{folder} is neither a run folder nor a checkpoint")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("flags, needle", [
    (["--model-spec", "nosuch:x"], "is not a run of a --model-spec (its model is "),
    (["--format", "hf", "--model-spec", "nosuch:x"], "--format hf writes the Hugging Face families"),
    (["--shard-size", "1MB"], "--shard-size 1MB applies with --format hf"),
    (["--shard-size", "5GB"], "--shard-size 5GB applies with --format hf"),  # its --format hf default, given
])
def test_an_export_flag_that_would_be_ignored_is_one_line(trained, tmp_path, capsys, flags, needle):
    """Each flag would change nothing in an export: refused, so no export claims to have applied it."""
    assert_one_line(*run_main(["export", str(trained["run"]), "--out", str(tmp_path / "e"), *flags], capsys), needle)
    assert not (tmp_path / "e").exists()


# 7. what the run kept of its model, and a damaged checkpoint


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "config.json"])
def test_hf_export_refuses_a_kept_model_file_that_is_not_a_file(trained, tmp_path, capsys, name):
    """RUN/hf/tokenizer.json made a folder: the export succeeded without a tokenizer, exit 0."""
    run = copy_run(trained, tmp_path / "run")
    kept = run / "hf" / name
    kept.unlink(missing_ok=True)
    kept.mkdir()
    assert_one_line(*run_main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "e")], capsys),
                    f"{kept} is a folder")
    assert not (tmp_path / "e").exists()
    no_debris(tmp_path)


@pytest.mark.parametrize("fmt", ["pipezero", "hf"])
def test_export_of_a_damaged_checkpoint_is_one_line_exit_2(trained, tmp_path, capsys, fmt):
    """A truncated or edited checkpoint file: one line, exit 1 before (it is the user's input)."""
    run = copy_run(trained, tmp_path / "run")
    step = run / "checkpoints" / "step-00000001"
    victim = next(p for p in sorted(step.iterdir()) if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:100])
    for source in (step, run):
        assert_one_line(*run_main(["export", str(source), "--format", fmt, "--out", str(tmp_path / "e")], capsys),
                        "step-00000001")
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize("damage", ["garbage", "link"])
def test_export_of_a_run_names_a_newer_checkpoint_whose_manifest_cannot_be_read(trained, tmp_path, capsys, damage):
    """A newer step-N whose manifest.json is not JSON, or a link to a file elsewhere: the export
    took the older checkpoint without a word, where --resume warns that it skips it."""
    run = copy_run(trained, tmp_path / "run")
    newer = run / "checkpoints" / "step-00000002"
    shutil.copytree(run / "checkpoints" / "step-00000001", newer)
    (newer / "manifest.json").unlink()
    if damage == "garbage":
        (newer / "manifest.json").write_text("{not json")
    else:
        (tmp_path / "elsewhere.txt").write_text("root:x:0:0\n")
        (newer / "manifest.json").symlink_to(tmp_path / "elsewhere.txt")
    code, err = run_main(["export", str(run), "--out", str(tmp_path / "e")], capsys)
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.startswith("pipezero: warning")]
    assert len(warning) == 1 and "step-00000002" in warning[0] and "manifest.json" in warning[0], err
    assert "exporting step-00000001" in warning[0], err


@pytest.mark.parametrize("link", ["folder", "shard"])
def test_export_of_a_run_names_a_newer_checkpoint_that_is_a_link(trained, tmp_path, capsys, link):
    """A newer step-N that is a link to another run's step folder was passed over without a word;
    one whose shard is a link to a file elsewhere was called truncated."""
    run = copy_run(trained, tmp_path / "run")
    newer, older = run / "checkpoints" / "step-00000002", run / "checkpoints" / "step-00000001"
    if link == "folder":
        other = tmp_path / "other" / "step-00000002"
        shutil.copytree(older, other)
        edit_manifest(other, lambda m: m.update(step=2))
        newer.symlink_to(other)
    else:
        shutil.copytree(older, newer)
        edit_manifest(newer, lambda m: m.update(step=2))
        shard = next(p for p in sorted(newer.iterdir()) if p.suffix == ".distcp")
        shard.unlink()
        (tmp_path / "passwd").write_text("root:x:0:0\n")
        shard.symlink_to(tmp_path / "passwd")
    code, err = run_main(["export", str(run), "--out", str(tmp_path / "e")], capsys)
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.startswith("pipezero: warning")]
    assert len(warning) == 1 and "step-00000002" in warning[0] and "is a link (to " in warning[0], err
    assert "truncated" not in warning[0] and "exporting step-00000001" in warning[0], err


def edit_manifest(step: Path, change) -> None:
    manifest = json.loads((step / "manifest.json").read_text())
    change(manifest)
    (step / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("fmt", ["pipezero", "hf"])
@pytest.mark.parametrize("change, needle", [
    (lambda m: m["config"]["model"].update(bogus=1), "('bogus' is no model setting)"),
    (lambda m: m["config"]["model"].update(dim="64"), '(model.dim = "64": expected an integer >= 1)'),
    (lambda m: m["config"]["model"].update(n_layers=None), "(model.n_layers = null: expected an integer >= 1 and <= 4096)"),
    (lambda m: m["config"].update(model=[1]), "('(not a table)' is no model setting)"),
])
def test_export_of_an_edited_manifest_model_is_one_line(trained, tmp_path, capsys, fmt, change, needle):
    """The manifest's [model] is read before the model is built from it: one line, not a TypeError."""
    run = copy_run(trained, tmp_path / "run")
    edit_manifest(run / "checkpoints" / "step-00000001", change)
    assert_one_line(*run_main(["export", str(run), "--format", fmt, "--out", str(tmp_path / "e")], capsys),
                    f"manifest.json's [model] is not as pipezero writes it {needle}")
    assert not (tmp_path / "e").exists()


def resume_argv(trained: dict[str, Path], run: Path) -> list[str]:
    return ["train", "--model", str(trained["model"]), "--data", str(trained["docs"]), "--max-steps", "2",
            "--resume", "--out", str(run), *SMALL]


def test_a_resume_that_would_not_continue_its_checkpoints_is_refused_before_any_rank(trained, tmp_path, capsys):
    """A damaged .run-id would make --resume take none of the run's checkpoints and train from
    step 0; a checkpoint of another model would be found only by the ranks as they load it."""
    run = copy_run(trained, tmp_path / "run")
    theirs = (run / ".run-id").read_text().strip()
    (run / ".run-id").write_bytes(b"\xff\xfe\x00")
    before = tree(run)
    assert_one_line(*run_main(resume_argv(trained, run), capsys),
                    f"its .run-id is missing or damaged, so --resume would take none of its checkpoints (run "
                    f"{theirs!r} wrote them) and train from step 0: write that id back, printf '{theirs}\\n' >")
    assert tree(run) == before
    (run / ".run-id").write_text(f"{theirs}\n")
    edit_manifest(run / "checkpoints" / "step-00000001", lambda m: m["config"]["model"].update(n_layers=3))
    before = tree(run)
    assert_one_line(*run_main(resume_argv(trained, run), capsys),
                    "step-00000001 holds a different model (saved vs now: {'n_layers': (3, 2)})")
    assert tree(run) == before


def test_the_model_folders_path_is_no_model_setting_on_resume():
    """The same folder named from another working directory ('model', '/data/model') refused a
    resume as 'a different model'."""
    from pipezero.checkpoint.state import model_diff

    assert model_diff({"dim": 32, "pretrained": "model"}, {"dim": 32, "pretrained": "/data/model"}) == {}
    assert model_diff({"dim": 32}, {"dim": 64, "n_layers": 2}) == {"dim": (32, 64), "n_layers": (None, 2)}


def test_a_run_whose_hf_folder_is_a_symlink_is_refused_before_it_writes_through_it(trained, tmp_path, capsys):
    """RUN/hf linked to a folder of the user's: a resume rewrote that folder's config.json."""
    run = copy_run(trained, tmp_path / "run")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}')
    shutil.rmtree(run / "hf")
    (run / "hf").symlink_to(mine)
    before = tree(tmp_path)
    assert_one_line(*run_main(resume_argv(trained, run), capsys), f"hf is a symlink (to {mine})")
    assert tree(tmp_path) == before


def test_a_writer_that_reports_an_os_error_in_its_own_words_names_the_file(tmp_path):
    """safetensors' save_file raises SafetensorError('... No space left on device (os error 28)') on
    a full disk: atomic_write_with gives it as the OSError it is, naming the file, and leaves no
    half-written file."""
    import errno

    from pipezero.files import atomic_write_with, refused_write

    def full(tmp: str) -> None:
        Path(tmp).write_bytes(b"half")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError) as caught:
        atomic_write_with(tmp_path / "model.safetensors", full)
    assert caught.value.errno == errno.ENOSPC
    assert refused_write(caught.value) == (f"{tmp_path / 'model.safetensors'} cannot be written (No space left on "
                                           f"device): free space there, or choose a folder on another disk")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="a bug"):  # an error that is no OSError stays itself
        atomic_write_with(tmp_path / "x", lambda tmp: (_ for _ in ()).throw(ValueError("a bug")))


def test_an_export_to_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys, trained_folder):
    """export (either format) to a disk that takes no more: one line naming the file, exit 1, and
    nothing half-written left. The full disk is a file-size limit (RLIMIT_FSIZE: writes past 60 KiB
    fail, EFBIG), in this process and no mount."""
    import resource

    monkeypatch.chdir(tmp_path)
    write_docs(tmp_path)
    copy_trained_folder(trained_folder, tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    try:
        for fmt in ("pipezero", "hf"):
            resource.setrlimit(resource.RLIMIT_FSIZE, (60 << 10, hard))
            try:
                code, err = run_main(["export", "run", "--format", fmt, "--out", f"e-{fmt}"], capsys)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            assert_one_line_exit_1(code, err, f"e-{fmt}/model.safetensors cannot be written (File too large)")
            assert not any(p.is_file() for p in (tmp_path / f"e-{fmt}").rglob("*"))
    finally:
        signal.signal(signal.SIGXFSZ, old)


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


@pytest.mark.parametrize("tokenizer", ["bytes", "own"])
def test_hf_export_of_a_run_that_trained_another_tokenizer_holds_the_runs(trained, tmp_path, capsys, tokenizer):
    """`train --model M --tokenizer bytes` (or a tokenizer.json of one's own) trains the model's rows
    on other ids: its export carried M's tokenizer.json, which the weights were not trained with."""
    from hf_models import tokenizer_json
    from pipezero.data.tokenizer import BPETokenizer

    run = copy_run(trained, tmp_path / "run")
    own = tmp_path / "own.json"
    tokenizer_json(own, vocab=280)
    saved = ({"tokenizer": "bytes", "tokenizer_file": None} if tokenizer == "bytes" else
             {"tokenizer": BPETokenizer.from_file(own).name, "tokenizer_file": str(own)})
    edit_manifest(run / "checkpoints" / "step-00000001", lambda m: m["data"].update(saved))
    code, err = run_main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "e")], capsys)
    assert code == 0, err
    if tokenizer == "bytes":
        assert not (tmp_path / "e" / "tokenizer.json").exists()
    else:
        assert (tmp_path / "e" / "tokenizer.json").read_bytes() == own.read_bytes()


def test_export_of_a_run_folder_takes_only_the_current_runs_checkpoints(text_dir, tmp_path, capsys):
    """After a `--force` run B beside run A, `export RUN` exported A's highest step while `.run-id`,
    metrics and summary were B's: it takes B's newest, and refuses (naming A's, and what is true of B)
    when B saved none."""
    from pipezero.checkpoint.export import checkpoint_to_export

    run = tmp_path / "run"
    common = ["train", "--preset", "tiny", "--data", str(text_dir), "--tokenizer", "bytes", "--seq-len", "16",
              "--microbatches", "1", "--micro-batch-size", "1", "--sample-tokens", "0", "--eval-every", "0",
              "--no-progress", "--out", str(run)]
    assert main([*common, "--max-steps", "3"]) == 0  # A: step 3
    assert main([*common, "--max-steps", "2", "--force"]) == 0  # B, beside it: step 2
    assert checkpoint_to_export(run).name == "step-00000002"
    assert main([*common, "--max-steps", "1", "--force", "--no-save-final"]) == 0  # C: no checkpoint
    capsys.readouterr()
    assert_one_line(*run_main(["export", str(run), "--out", str(tmp_path / "e")], capsys),
                    "the run there now saved no checkpoint: it trained with --no-save-final and no "
                    "--checkpoint-every")
    assert_one_line(*run_main(["export", str(run), "--out", str(tmp_path / "e")], capsys),
                    "step-00000003 and step-00000002 are of earlier runs")
    assert not (tmp_path / "e").exists()
    assert main(["export", str(run / "checkpoints" / "step-00000003"), "--out", str(tmp_path / "e")]) == 0


def test_export_never_imports_a_model_spec_the_checkpoint_names(tmp_path, monkeypatch, capsys):
    """A checkpoint is data: one whose manifest names `--model-spec MODULE:NAME` is exported only
    when the user names that spec too, or `pipezero export` would import and call whatever code a
    downloaded checkpoint chose."""
    from pipezero.checkpoint.store import Team, write
    from pipezero.settings import build_config

    (tmp_path / "payload.py").write_text("from pathlib import Path\n"
                                         "def boom():\n    Path(__file__).with_name('ran').touch()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = build_config(None, {}).to_dict()
    config["model"]["spec"] = "payload:boom"
    path = write(tmp_path / "run" / "checkpoints", 1, {"model.x": torch.zeros(3)}, {"config": config}, 3, Team(step=1))
    for source in (path, tmp_path / "run"):
        assert main(["export", str(source), "--out", str(tmp_path / "export")]) == 2  # a flag missing: bad input
        assert "--model-spec payload:boom, if you trust it" in capsys.readouterr().err
        assert main(["export", str(source), "--out", str(tmp_path / "export"), "--model-spec", "other:spec"]) == 2
        assert "you named 'other:spec'" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()
