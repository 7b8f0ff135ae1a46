"""An eighth review of bad inputs (issue 33), as a careless or hostile user: pipes where pipezero
reads a file, folders and disks that refuse a write (read-only, immutable, full), signals during a
save. Each case found is one line naming the input and the fix (exit 2 before anything starts,
exit 1 for a write refused mid-run), no traceback, no hang, and nothing of the user's touched."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from one_line import assert_one_line, run_main

TRAIN = ["train", "--preset", "tiny", "--max-steps", "1", "--no-progress", "--seq-len", "16", "--tokenizer", "bytes",
         "--sample-tokens", "0", "--microbatches", "1", "--micro-batch-size", "1"]


class Hung(Exception):
    pass


def within(seconds: int, fn):
    """fn() or Hung after `seconds`: a case that waits on a pipe for ever must fail, not hang the suite."""
    def alarm(*_):
        raise Hung(f"still waiting after {seconds} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def docs(folder: Path) -> None:
    (folder / "docs").mkdir()
    for i in range(12):
        (folder / "docs" / f"{i}.txt").write_text(f"document {i}: hello there, general kenobi " * 8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One tiny run of one step (docs/ and run/), trained once for the tests that need a real one."""
    import contextlib
    import io

    from pipezero.cli import main

    where = tmp_path_factory.mktemp("trained")
    docs(where)
    cwd = os.getcwd()
    os.chdir(where)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            assert main([*TRAIN, "--data", "docs", "--out", "run"]) == 0
    finally:
        os.chdir(cwd)
    return where


def copy_run(trained: Path, to: Path) -> None:
    """The trained run beside docs/ in `to` (docs made by the test), as if trained there."""
    shutil.copytree(trained / "run", to / "run")


def fake_run(folder: Path) -> Path:
    """A run folder as a run leaves it (its id, a lock, metrics), without training one."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / ".run-id").write_text("0123456789abcdef\n")
    (folder / ".lock").write_text("")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    return folder


@pytest.mark.parametrize("name", [".run-id", ".lock"])
def test_a_pipe_at_the_runs_id_or_lock_is_named_not_waited_on(name, tmp_path, monkeypatch, capsys):
    """A pipe (FIFO) at OUT/.run-id or OUT/.lock: --resume opened it to read and waited for a
    writer for ever (no message, no exit)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello there " * 100)
    run = fake_run(tmp_path / "run")
    (run / name).unlink()
    os.mkfifo(run / name)
    code, err = within(20, lambda: run_main([*TRAIN, "--data", "docs", "--out", "run", "--resume"], capsys))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if name == ".run-id":
        assert ".run-id is not a regular file" in err, err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_run_id_of_a_pipe_is_none_at_once(tmp_path):
    from pipezero.rundir import run_id

    os.mkfifo(tmp_path / ".run-id")
    assert within(5, lambda: run_id(tmp_path)) is None


FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10  # linux/fs.h, as chattr +i


def _immutable(path: Path, on: bool) -> bool:
    import array
    import fcntl

    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        flags[0] = flags[0] | FS_IMMUTABLE_FL if on else flags[0] & ~FS_IMMUTABLE_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def read_only(path: Path) -> None:
    """Make `path` refuse writes: immutable (chattr +i) as root, who ignores modes; else chmod."""
    if os.geteuid() != 0:
        path.chmod(0o555 if path.is_dir() else 0o444)
    elif not _immutable(path, True):
        pytest.skip("this filesystem has no immutable flag (chattr +i)")


def writable(path: Path) -> None:
    if os.geteuid() != 0:
        path.chmod(0o755 if path.is_dir() else 0o644)
    else:
        _immutable(path, False)


def one_line_exit_1(code: int, err: str, needle: str) -> None:
    assert code == 1, (code, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if not line.startswith(("pipezero: warning", "pipezero: resumed"))]
    assert len(lines) == 1 and lines[0].startswith("pipezero: error") and needle in lines[0], err


def test_a_checkpoints_folder_that_refuses_the_save_is_one_line_and_keeps_the_last(tmp_path):
    """An immutable (or read-only) OUT/checkpoints: the save's mkdir ended the run in a
    PermissionError traceback. Now a CheckpointError naming the folder and the fix, every rank
    alike; the checkpoint already there is untouched."""
    import torch

    from pipezero.checkpoint.store import CheckpointError, Team, committed, write

    root = tmp_path / "checkpoints"
    write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    before = {p.name: p.read_bytes() for p in (root / "step-00000001").iterdir()}
    read_only(root)
    try:
        with pytest.raises(CheckpointError, match=r"step 2: checkpoint .*\.tmp-step-00000002 cannot be made: .*"
                                                  r"writable.*--resume"):
            write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=5, team=Team())
    finally:
        writable(root)
    assert [p.name for _, p in committed(root)] == ["step-00000001"]
    assert {p.name: p.read_bytes() for p in (root / "step-00000001").iterdir()} == before


def test_an_old_checkpoint_that_cannot_be_pruned_is_kept_with_a_warning(tmp_path, capsys):
    """--keep-checkpoints 1 with an immutable old step: the prune's rename ended the run in a
    traceback after the new checkpoint was committed. The old one stays, said in a warning."""
    import torch

    from pipezero.checkpoint.store import Team, committed, write

    root = tmp_path / "checkpoints"
    write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    read_only(root / "step-00000001")
    try:
        write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=1, team=Team())
    finally:
        writable(root / "step-00000001")
    assert [p.name for _, p in committed(root)] == ["step-00000001", "step-00000002"]
    err = capsys.readouterr().err
    assert "step-00000001 was kept, past --keep-checkpoints 1" in err, err


@pytest.mark.parametrize("name", ["metrics.jsonl", "summary.json"])
def test_a_run_file_that_refuses_a_write_is_one_line(name, tmp_path, monkeypatch, capsys, trained):
    """An immutable OUT/metrics.jsonl or OUT/summary.json on --resume: an OSError traceback from
    util.atomic_write_bytes. Now one line naming the file and the fix, exit 1; the file as it was."""
    monkeypatch.chdir(tmp_path)
    docs(tmp_path)
    base = [*TRAIN, "--data", "docs", "--out", "run"]
    copy_run(trained, tmp_path)
    mine = (tmp_path / "run" / name).read_bytes()
    read_only(tmp_path / "run" / name)
    try:
        code, err = run_main([*base, "--max-steps", "2", "--resume"], capsys)
    finally:
        writable(tmp_path / "run" / name)
    one_line_exit_1(code, err, f"{name} cannot be written")
    assert (tmp_path / "run" / name).read_bytes() == mine


def test_a_writer_that_reports_an_os_error_in_its_own_words_names_the_file(tmp_path):
    """safetensors' save_file raises SafetensorError('... No space left on device (os error 28)'):
    export to a full disk ended in that traceback. atomic_write_with gives it as the OSError it is,
    naming the file, and leaves no half-written file."""
    import errno

    from pipezero.util import atomic_write_with, refused_write

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


def test_an_export_to_a_full_disk_is_one_line(tmp_path, monkeypatch, capsys, trained):
    """export (either format) to a disk that takes no more: a SafetensorError traceback. Now one
    line naming the file, exit 1, and nothing half-written left. The full disk is a file-size limit
    (RLIMIT_FSIZE: writes past 60 KiB fail, EFBIG), in this process and no mount."""
    import resource

    monkeypatch.chdir(tmp_path)
    docs(tmp_path)
    copy_run(trained, tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    try:
        for fmt in ("pipezero", "hf"):
            resource.setrlimit(resource.RLIMIT_FSIZE, (60 << 10, hard))
            try:
                code, err = run_main(["export", "run", "--format", fmt, "--out", f"e-{fmt}"], capsys)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            one_line_exit_1(code, err, f"e-{fmt}/model.safetensors cannot be written (File too large)")
            assert not any(p.is_file() for p in (tmp_path / f"e-{fmt}").rglob("*"))
    finally:
        signal.signal(signal.SIGXFSZ, old)


@pytest.mark.parametrize("scratch", [".tmp-step-00000002", ".deleting-step-00000001"])
def test_a_users_folder_at_a_scratch_name_is_kept(scratch, tmp_path):
    """A folder of the user's at checkpoints/.tmp-step-N (a save's scratch) or .deleting-step-N
    (a prune's): the save or prune cleared it as a crash's debris, the user's notes with it. Now it
    stays, and the save stops with a CheckpointError naming it (the prune warns and keeps the step)."""
    import torch

    from pipezero.checkpoint.store import CheckpointError, Team, committed, users_scratch, write

    root = tmp_path / "checkpoints"
    write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    (root / scratch).mkdir()
    (root / scratch / "notes.txt").write_text("mine")
    assert users_scratch(root) == [root / scratch]
    if scratch.startswith(".tmp"):
        with pytest.raises(CheckpointError, match=f"{scratch} holds notes.txt, which no checkpoint save writes"):
            write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=1, team=Team())
        assert [p.name for _, p in committed(root)] == ["step-00000001"]
    else:
        write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=1, team=Team())  # saves 2, keeps 1
        assert [p.name for _, p in committed(root)] == ["step-00000001", "step-00000002"]
    assert (root / scratch / "notes.txt").read_text() == "mine"


def test_a_crashs_debris_at_a_scratch_name_is_still_cleared(tmp_path):
    import torch

    from pipezero.checkpoint.store import Team, committed, users_scratch, write

    root = tmp_path / "checkpoints"
    write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=Team())
    shutil.copytree(root / "step-00000001", root / ".tmp-step-00000002")  # a save killed before its rename
    (root / ".tmp-step-00000002" / ".manifest.json.a1b2.tmp").write_text("{")
    assert users_scratch(root) == []
    write(root, 2, {"x": torch.ones(4)}, {"run": "this"}, keep=5, team=Team())
    assert [p.name for _, p in committed(root)] == ["step-00000001", "step-00000002"]
    assert not (root / ".tmp-step-00000002").exists()


def test_a_resume_over_a_users_scratch_folder_is_refused_before_training(tmp_path, monkeypatch, capsys, trained):
    monkeypatch.chdir(tmp_path)
    docs(tmp_path)
    copy_run(trained, tmp_path)
    mine = tmp_path / "run" / "checkpoints" / ".tmp-step-00000002" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("mine")
    code, err = run_main([*TRAIN, "--data", "docs", "--out", "run", "--resume", "--max-steps", "2"], capsys)
    assert_one_line(code, err, ".tmp-step-00000002 holds files no checkpoint save writes")
    assert mine.read_text() == "mine"


def test_a_tensorboard_folder_that_refuses_files_is_one_line(tmp_path, monkeypatch, capsys, trained):
    """--tensorboard with an immutable OUT/tensorboard: torch's event writer thread printed its
    PermissionError traceback beside pipezero's line."""
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    docs(tmp_path)
    copy_run(trained, tmp_path)
    (tmp_path / "run" / "tensorboard").mkdir()
    read_only(tmp_path / "run" / "tensorboard")
    try:
        code, err = run_main([*TRAIN, "--data", "docs", "--out", "run", "--resume", "--max-steps", "2",
                              "--tensorboard"], capsys)
    finally:
        writable(tmp_path / "run" / "tensorboard")
    one_line_exit_1(code, err, "run/tensorboard cannot be written (")


@pytest.fixture
def cluster_never_built(monkeypatch):
    """`pipezero cluster` on any host, whose cluster must not be built: each case is refused before."""
    import pipezero.cluster

    def built(*a, **kw):  # noqa: ANN002, ANN003
        raise AssertionError("a cluster was built for a refused command")

    monkeypatch.setattr(pipezero.cluster, "require_root", lambda: None)
    monkeypatch.setattr(pipezero.cluster, "run_on_cluster", built)
    monkeypatch.setattr(pipezero.cluster.EmulatedCluster, "__enter__", built)


@pytest.mark.parametrize("out, needle", [("pipe", "--out 'pipe' is a file, not a folder"),
                                         ("run", "--out 'run' already holds a run (checkpoints, metrics.jsonl)"),
                                         ("run/checkpoints/x", "is inside")])
def test_a_cluster_run_folder_is_checked_before_the_cluster_is_built(out, needle, cluster_never_built, tmp_path,
                                                                      monkeypatch, capsys):
    """`pipezero cluster ... train --out P` with P a pipe, or a run without --resume: node 0's rank 0
    refused it, after the cluster was built, in 60 lines of every node's torchrun report."""
    monkeypatch.chdir(tmp_path)
    docs(tmp_path)
    os.mkfifo(tmp_path / "pipe")
    fake_run(tmp_path / "run")
    code, err = run_main(["cluster", "--nodes", "2", *TRAIN, "--dp", "2", "--data", "docs", "--out", out], capsys)
    assert_one_line(code, err, needle)


@pytest.mark.parametrize("link", [f"{2**70}gbit", "20tbit", "1e3gbit"])
def test_a_cluster_link_past_any_real_one_is_refused_before_building(link, cluster_never_built, capsys):
    """--link 1180591620717411303424gbit passed the check, and tc failed 40 s later, mid-build."""
    code, err = run_main(["cluster", "--nodes", "2", "--link", link, *TRAIN, "--dp", "2"], capsys)
    assert_one_line(code, err, f"--link {link!r}: a tc rate such as 200mbit")


def test_cluster_rates_read_as_tc_reads_them():
    from pipezero.cluster import rate_bits

    assert rate_bits("200mbit") == 200e6
    assert rate_bits("1gibit") == 2**30
    assert rate_bits("10mbps") == 80e6
    assert rate_bits("10tbit") == 10e12
    assert rate_bits("fast") is None


def test_a_second_verify_at_the_same_out_is_refused(tmp_path, monkeypatch, capsys):
    """Two `pipezero verify` at one --out (say --pp 2 and --dp 2): each deleted and read the other's
    ranks/rankR.pt, and one printed 'the layout trains another model', exit 1, for a layout that is
    right. verify now holds OUT/.lock while it runs; a second one is refused in one line."""
    from pipezero.rundir import held

    monkeypatch.chdir(tmp_path)
    docs(tmp_path)
    with held(tmp_path / "v"):  # the first verify, running
        code, err = run_main(["verify", "--preset", "tiny", "--steps", "1", "--seq-len", "16", "--tokenizer", "bytes",
                              "--data", "docs", "--out", "v"], capsys)
    assert_one_line(code, err, "--out 'v' is in use by another run (pid")
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == [".lock"]


def test_verify_takes_a_folder_an_earlier_verify_left(tmp_path):
    """Its own .lock, left by the earlier verify, is verify's: no refusal."""
    from pipezero.rundir import held
    from pipezero.verify import check_out

    with held(tmp_path):
        pass
    assert (tmp_path / ".lock").is_file()
    check_out(tmp_path)


def test_a_checkpoint_write_that_fails_on_a_full_disk_says_how_much_room_is_left(tmp_path, monkeypatch):
    """DCP's write to a full disk fails in torch's words ('unexpected pos 704 vs 598'): the one line
    now adds the free space of the checkpoints folder when it is short, so the fix is named."""
    import torch

    import pipezero.checkpoint.store as store

    class Full:
        f_bavail, f_frsize = 25, 4096  # 100 KiB

    monkeypatch.setattr(store.os, "statvfs", lambda path: Full())

    def torn(*a, **kw):  # noqa: ANN002, ANN003
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr("torch.distributed.checkpoint.save", torn)
    root = tmp_path / "checkpoints"
    with pytest.raises(store.CheckpointError, match=r"the disk under .*checkpoints is full \(0\.1 MiB free\) \(.*unexpected "
                                                    r"pos .*\); this run has no earlier checkpoint to --resume from"):
        store.write(root, 1, {"x": torch.zeros(4)}, {"run": "this"}, keep=5, team=store.Team())
    assert list(root.iterdir()) == []  # the failed save left nothing


@pytest.mark.parametrize("steps", [str(2**63), "100000000000000000000"])
def test_a_step_count_past_any_run_is_refused(steps, tmp_path, monkeypatch, capsys):
    """Round eight's leftover (and round six's 10^20 in a TOML): such a run trained on as if the count
    were reachable; the counter a checkpoint keeps is int64."""
    monkeypatch.chdir(tmp_path)
    docs(tmp_path)
    code, err = run_main([*TRAIN[:3], *TRAIN[5:], "--max-steps", steps, "--data", "docs", "--out", "run"], capsys)
    assert_one_line(code, err, "--max-steps")
    assert not (tmp_path / "run").exists()
