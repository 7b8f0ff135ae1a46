"""A run's folder (--out) holds the user's files as safely as the run's own: what pipezero would write
over, follow, or fail to write there is one line naming the path and the fix, exit 2 before anything
starts (exit 1 for a write refused mid-run), and nothing of the user's is touched. The claim of a
folder (.lock, .run-id) and --force are here; what --resume refuses is tests/test_bad_resume.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from one_line import assert_one_line, assert_one_line_exit_1, run_main
from pipezero.errors import ConfigError
from pipezero.rundir import claim
from pipezero.files import atomic_write_bytes
from tiny_runs import (TRAIN_TINY, TRAIN_TINY_BYTES, TRAIN_TINY_SMALLEST, VERIFY_TINY, copy_trained_folder,
                       copy_trained_run, data_of, write_docs)
from user_files import files, read_only, within, writable


@pytest.mark.parametrize("name, make, needle", [
    ("summary.json", Path.mkdir, "summary.json is a folder, where the run writes a file"),
    ("trace.json", Path.mkdir, "trace.json is a folder, where the run writes a file"),
    ("metrics.jsonl", os.mkfifo, "metrics.jsonl is not a regular file"),
    ("checkpoints", lambda p: p.write_text("x"), "checkpoints is a file, where the run writes a folder"),
    ("tensorboard", lambda p: p.write_text("x"), "tensorboard is a file, where the run writes a folder"),
    (".run-id", Path.mkdir, ".run-id is a folder, where the run writes a file"),  # not an IsADirectoryError later
])
def test_a_run_name_of_the_other_kind_is_refused_before_training(name, make, needle, tmp_path, capsys):
    """Each would fail (or hang, for a pipe) only after the training, when first written: checked first."""
    out = tmp_path / "o"
    out.mkdir()
    make(out / name)
    data = tmp_path / "a.txt"
    data.write_text("hello there " * 50)
    assert_one_line(*run_main([*TRAIN_TINY, "--data", str(data), "--out", str(out), "--force"], capsys), needle)
    assert sorted(p.name for p in out.iterdir()) == [name]  # no lock, no run id left behind


def test_a_run_id_that_is_not_text_claims_nothing(tmp_path):
    """A .run-id that is not text is no id pipezero wrote: read as a missing one."""
    from pipezero.rundir import RUN_ID, run_id

    (tmp_path / RUN_ID).write_bytes(b"\xff\xfe")
    assert run_id(tmp_path) is None


def test_a_lock_that_is_a_symlink_is_refused_not_written_through(tmp_path, capsys):
    """`OUT/.lock -> ../mine.txt`: opening the lock through the link would truncate the user's file
    to write the pid there."""
    mine = tmp_path / "mine.txt"
    mine.write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(mine)
    assert_one_line(*run_main([*TRAIN_TINY_BYTES, "--out", str(out)], capsys), ".lock is a symlink")
    assert mine.read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_the_launchers_variable_set_by_hand_claims_nothing(tmp_path, capsys, monkeypatch):
    """PIPEZERO_RUN_CLAIMED=1 tells a rank our launcher started that the folder is claimed; in a lone
    process it claims nothing, so the run already in --out is refused without --force."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("the other run's")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIPEZERO_RUN_CLAIMED", "1")
    assert_one_line(*run_main([*TRAIN_TINY_BYTES, "--out", str(out)], capsys), "holds metrics.jsonl but no run pipezero started")
    assert (out / "metrics.jsonl").read_text() == "the other run's"


def test_force_never_replaces_a_users_files_in_a_folder_no_run_claimed(tmp_path, capsys):
    """`train --force` over a folder holding the user's metrics.jsonl (no .run-id, no checkpoints):
    --force trains beside a run pipezero started, never over files it did not write."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text("my notes")
    (mine / "trace.png").write_bytes(b"my picture")
    before = files(mine)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, "--out", str(mine), "--force"], capsys),
                    "holds metrics.jsonl, trace.png but no run pipezero started (no .run-id, no checkpoints), "
                    "and --force would write over them")
    assert files(mine) == before and sorted(p.name for p in mine.iterdir()) == ["metrics.jsonl", "trace.png"]


def test_force_beside_a_run_pipezero_started_still_trains(trained_run, tmp_path):
    """What --force is for stays: a folder a run claimed (its .run-id) takes a new run beside it."""
    from pipezero.rundir import claim

    run = copy_trained_run(trained_run, tmp_path / "run")
    with claim(str(run), resume=False, force=True) as held:
        assert held.id != (trained_run / ".run-id").read_text().strip()


@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/step-00000001", "checkpoints/step-00000001/deeper"])
def test_out_inside_a_runs_checkpoints_is_refused(inside, trained_run, tmp_path, capsys):
    """`--out RUN/checkpoints/step-N --force` would write a whole run (metrics, its own checkpoints)
    into another run's checkpoint, beside the shards that run's saves and pruning manage."""
    run = copy_trained_run(trained_run, tmp_path / "run")
    before = files(run)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, *data_of(trained_run), "--out", str(run / inside), "--force"], capsys),
                    "a run's checkpoints folder, which that run's saves, pruning and resume manage")
    assert files(run) == before and not (run / "checkpoints" / "step-00000001" / "deeper").exists()


def test_a_folder_named_checkpoints_of_no_run_is_a_run_folder(tmp_path):
    from pipezero.rundir import claim

    with claim(str(tmp_path / "checkpoints"), resume=False, force=False):
        pass


def test_force_into_a_hugging_face_model_folder_keeps_the_model(tmp_path, capsys):
    """`train --force --out MODEL` would replace the model's config.json with the run's."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"weights")
    before = files(model)
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, "--out", str(model), "--force"], capsys),
                    "holds config.json but no run pipezero started")
    assert files(model) == before


def test_an_empty_out_beside_the_data_is_named_empty(tmp_path, monkeypatch, capsys):
    """--out '' in the folder holding --data is named empty: the working directory is not the empty
    name, so '--out holds --data docs: put --out outside the data' would be a fix that does not apply."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello " * 200)
    monkeypatch.chdir(tmp_path)
    code, err = run_main([*TRAIN_TINY_SMALLEST, "--data", "docs", "--out", ""], capsys)
    assert_one_line(code, err, "--out is empty")


@pytest.mark.parametrize("how", ["flag", "toml", "export"])
def test_a_tilde_no_shell_expanded_is_refused_not_made_a_folder(how, tmp_path, monkeypatch, capsys):
    """A quoted '~/runs/a', --out=~/x or a TOML value reach pipezero unexpanded: the run (or export)
    would go to a new folder named '~' in the working directory, which `rm -r ~` later takes for home."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text('[run]\nout = "~/pz-runs/a"\n')
    argv = {"flag": [*TRAIN_TINY_SMALLEST, "--out", "~/pz-runs/a"],
            "toml": ["train", "--config", "c.toml", *TRAIN_TINY_SMALLEST[1:]],
            "export": ["export", "nowhere", "--out", "~/pz-runs/e"]}[how]
    code, err = run_main(argv, capsys)
    assert_one_line(code, err, "starts with '~', which only a shell expands")
    assert str(Path.home() / "pz-runs") in err
    assert not (tmp_path / "~").exists()


def test_a_real_folder_named_tilde_is_the_users_choice(tmp_path, monkeypatch):
    from pipezero.files import unexpanded_home

    monkeypatch.chdir(tmp_path)
    assert unexpanded_home("--out", "~/x") is not None
    (tmp_path / "~").mkdir()
    assert unexpanded_home("--out", "~/x") is None
    assert unexpanded_home("--out", "runs/~x") is None


def test_an_out_through_a_symlink_loop_is_one_line(tmp_path, monkeypatch, capsys):
    """A link on --out's path that loops: Path.resolve raises RuntimeError in each command's checks
    (train, verify: the data-overlap check; export: the inside-a-run check), said in one line."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for argv in ([*TRAIN_TINY_SMALLEST, "--out", "loop/x"], ["export", "nowhere", "--out", "loop/e"],
                 [*VERIFY_TINY, "--out", "loop/v"]):
        code, err = run_main(argv, capsys)
        assert_one_line(code, err, "cannot be followed")


@pytest.mark.parametrize("how", ["png", "cache"])
def test_a_tilde_in_png_or_cache_is_refused(how, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if how == "png":
        argv = ["simulate", "--png", "~/pz-r7.png"]
    else:
        monkeypatch.setenv("PIPEZERO_CACHE", "~/pz-cache")
        (tmp_path / "docs").mkdir()
        (tmp_path / "docs" / "a.txt").write_text("hello " * 200)
        argv = [*TRAIN_TINY_SMALLEST, "--data", "docs", "--out", "o"]
    code, err = run_main(argv, capsys)
    assert_one_line(code, err, "starts with '~', which only a shell expands")
    assert not (tmp_path / "~").exists()


def test_run_id_of_a_pipe_is_none_at_once(tmp_path):
    from pipezero.rundir import run_id

    os.mkfifo(tmp_path / ".run-id")
    assert within(5, lambda: run_id(tmp_path)) is None


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json"])
def test_a_run_file_that_refuses_a_write_is_one_line(name, tmp_path, monkeypatch, capsys, trained_folder):
    """An immutable OUT/metrics.jsonl or OUT/summary.json on --resume: files.atomic_write_bytes's
    OSError is one line naming the file and the fix, exit 1; the file as it was."""
    monkeypatch.chdir(tmp_path)
    write_docs(tmp_path)
    base = [*TRAIN_TINY_SMALLEST, "--data", "docs", "--out", "run"]
    copy_trained_folder(trained_folder, tmp_path)
    mine = (tmp_path / "run" / name).read_bytes()
    read_only(tmp_path / "run" / name)
    try:
        code, err = run_main([*base, "--max-steps", "2", "--resume"], capsys)
    finally:
        writable(tmp_path / "run" / name)
    assert_one_line_exit_1(code, err, f"{name} cannot be written")
    assert (tmp_path / "run" / name).read_bytes() == mine


def test_a_tensorboard_folder_that_refuses_files_is_one_line(tmp_path, monkeypatch, capsys, trained_folder):
    """--tensorboard with an immutable OUT/tensorboard: checked before torch's event writer thread,
    whose PermissionError would print beside pipezero's line."""
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    write_docs(tmp_path)
    copy_trained_folder(trained_folder, tmp_path)
    (tmp_path / "run" / "tensorboard").mkdir()
    read_only(tmp_path / "run" / "tensorboard")
    try:
        code, err = run_main([*TRAIN_TINY_SMALLEST, "--data", "docs", "--out", "run", "--resume", "--max-steps", "2",
                              "--tensorboard"], capsys)
    finally:
        writable(tmp_path / "run" / "tensorboard")
    assert_one_line_exit_1(code, err, "run/tensorboard cannot be written (")


def link_then_up(root: Path) -> str:
    """root/lnk -> deep/x, so 'lnk/../o' is deep/o to the filesystem but ./o to os.path.abspath."""
    (root / "deep" / "x").mkdir(parents=True)
    (root / "lnk").symlink_to("deep/x")
    return "lnk/../o"


def test_a_file_written_through_a_link_then_dotdot_lands_where_the_filesystem_puts_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = link_then_up(tmp_path)
    atomic_write_bytes(Path(out) / "f.json", b"{}")  # its temporary file beside f.json, not in ./o
    assert (tmp_path / "deep" / "o" / "f.json").read_bytes() == b"{}"
    assert not (tmp_path / "o").exists()
    assert [p.name for p in (tmp_path / "deep" / "o").iterdir()] == ["f.json"]  # no temporary file left


def test_a_run_folder_through_a_link_then_dotdot_is_claimed(tmp_path, monkeypatch):
    """`train --out lnk/../o` makes and locks deep/o, as the filesystem reads the path: its .run-id
    must go there too."""
    monkeypatch.chdir(tmp_path)
    held = claim(link_then_up(tmp_path), False, False)
    try:
        assert len((tmp_path / "deep" / "o" / ".run-id").read_text().strip()) == 16
    finally:
        held.release()


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


def test_files_a_run_writes_take_the_umask_or_the_mode_they_replace(tmp_path):
    """Written through a temporary file, renamed into place: mkstemp makes it the owner's alone
    (0600), so a run's summary, metrics and manifests were unreadable to a teammate beside shards
    that were 0644."""
    import stat

    from pipezero.files import atomic_write_bytes

    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "new.json", b"{}")
        assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644
        (tmp_path / "kept.json").write_bytes(b"x")
        os.chmod(tmp_path / "kept.json", 0o640)
        atomic_write_bytes(tmp_path / "kept.json", b"{}")
        assert stat.S_IMODE((tmp_path / "kept.json").stat().st_mode) == 0o640
        os.umask(0o077)
        atomic_write_bytes(tmp_path / "private.json", b"{}")
        assert stat.S_IMODE((tmp_path / "private.json").stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_a_folder_of_notes_offers_force_and_force_trains_beside_them(tmp_path, capsys):
    """A folder holding only the user's notes was said to "already hold a run"; one holding a
    metrics.jsonl of theirs was offered --force, which then refused it. Each refusal offers only
    what would be taken, and --force trains beside notes, leaving them as they were."""
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "readme.txt").write_text("my notes")
    assert_one_line(*run_main([*TRAIN_TINY_SMALLEST, "--out", str(notes)], capsys),
                    f"--out '{notes}' holds files of no run (readme.txt): pass --force to train there beside them")
    with claim(str(notes), resume=False, force=True):  # what --force's run takes: the folder, beside the notes
        pass
    assert (notes / "readme.txt").read_text() == "my notes"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "metrics.jsonl").write_text("mine")
    code, err = run_main([*TRAIN_TINY_SMALLEST, "--out", str(theirs)], capsys)
    assert_one_line(code, err, "holds metrics.jsonl but no run pipezero started")
    assert "--force" not in err


def test_trials_a_stopped_run_left_are_removed_by_the_next_claim_and_a_link_or_file_there_refused(tmp_path, monkeypatch):
    """Ranks stopped by a signal (or killed) mid `--layout auto` trial run no `finally`: their
    `.layout-trials` stayed, and the next run into the folder was refused as "already holds a run"."""
    monkeypatch.delenv("RANK", raising=False)
    out = tmp_path / "run"
    (out / ".layout-trials" / "0").mkdir(parents=True)
    (out / ".run-id").write_text("0123456789abcdef\n")
    claim(str(out), resume=False, force=False).release()
    assert not (out / ".layout-trials").exists()
    kept = tmp_path / "kept"
    (kept / "0").mkdir(parents=True)
    (out / ".layout-trials").symlink_to(kept)  # the trials wrote through it, and every rank failed on it
    with pytest.raises(ConfigError, match=r"holds .layout-trials, a link, under the name --layout auto's trials take"):
        claim(str(out), resume=True, force=False)
    assert (kept / "0").is_dir() and (out / ".layout-trials").is_symlink()
    (out / ".layout-trials").unlink()
    (out / ".layout-trials").write_text("a user's file")
    with pytest.raises(ConfigError, match=r"holds .layout-trials, a file, .* move it away"):
        claim(str(out), resume=True, force=False)
    assert (out / ".layout-trials").read_text() == "a user's file"
    (out / ".layout-trials").unlink()
    claim(str(out), resume=True, force=False).release()  # the refusals held no lock
