"""The `--nproc` launcher as a user meets it: one job, listening on loopback only, holding its run
folder, stopped as a whole by SIGTERM, and ended as a whole by `kill -9` of the launcher, its ranks
holding the folder until they are gone."""

from __future__ import annotations

import pytest

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipezero.checkpoint.store import Team, latest
from pipezero.cli import main


def pids_with(marker: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found if int(p) != os.getpid()]


def listeners(pids: list[int]) -> list[str]:
    """Local addresses these processes listen on (TCP), from `ss`."""
    table = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    return [line.split()[3] for line in table if any(f"pid={p}," in line for p in pids)]


@pytest.mark.distributed
def test_sigterm_stops_every_rank_listening_on_loopback_and_holding_the_folder(text_dir, tmp_path, capsys):
    out = tmp_path / "sigterm-run-marker"
    cmd = [sys.executable, "-m", "pipezero.cli", "train", "--nproc", "2", "--pp", "2", "--microbatches", "2",
           "--data", str(text_dir), "--tokenizer", "bytes", "--seq-len", "32", "--max-steps", "2000",
           "--checkpoint-every", "2", "--sample-tokens", "0", "--no-progress", "--out", str(out)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not list((out / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        job = pids_with(str(out))
        assert len(job) >= 4, job  # launcher, torchrun, two ranks
        if shutil.which("ss"):
            addresses = listeners(job)
            assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses
        code = main(["train", "--out", str(out), "--resume", "--max-steps", "1"])  # a second run in the folder
        err = capsys.readouterr().err
        assert code == 2 and "is in use by another run" in err, err
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = proc.stderr.read()
    assert code == 128 + signal.SIGTERM and took < 10, (code, took, stderr[-2000:])
    assert stderr.strip().splitlines()[-1].startswith("pipezero: stopped by SIGTERM"), stderr[-2000:]
    assert "Traceback" not in stderr and "torch.distributed.elastic" not in stderr, stderr[-2000:]
    time.sleep(0.5)
    assert pids_with(str(out)) == []  # no orphaned rank
    assert latest(Path(out) / "checkpoints", Team()) is not None  # the newest complete checkpoint loads


@pytest.mark.distributed
def test_a_launcher_killed_by_a_signal_exits_128_plus_that_signal(tmp_path):
    """torchrun itself ended by a signal (the OOM killer's SIGKILL): the job's exit status is the
    shell's 137, not Python's -9 (which sys.exit turns into 247)."""
    from pipezero.job import run_job

    cmd = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    assert run_job(cmd, dict(os.environ), str(tmp_path)) == 128 + signal.SIGKILL
    assert run_job([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), str(tmp_path)) == 3


def holds_file(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open (Linux /proc)."""
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            if Path(os.readlink(fd)) == path:
                return True
        except OSError:
            continue
    return False


@pytest.mark.distributed
def test_ranks_die_with_a_killed_launcher_and_hold_the_folder_until_then(text_dir, tmp_path, capsys):
    """`kill -9` of the launcher runs none of its code: its torchrun agent and every rank must still
    end within seconds, and hold the run folder's lock while they live, so a `--resume` is refused
    until they are gone and then continues the run without two jobs writing one folder."""
    out = tmp_path / "sigkill-run-marker"
    cmd = [sys.executable, "-m", "pipezero.cli", "train", "--nproc", "2", "--pp", "2", "--microbatches", "2",
           "--data", str(text_dir), "--tokenizer", "bytes", "--seq-len", "32", "--max-steps", "2000",
           "--checkpoint-every", "2", "--sample-tokens", "0", "--no-progress", "--out", str(out)]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not list((out / "checkpoints").glob("step-*")) and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.2)
        job = [p for p in pids_with(str(out)) if p != proc.pid]
        assert len(job) >= 3, job  # torchrun's agent, two ranks
        assert all(holds_file(p, out / ".lock") for p in job), job  # the lock lives while any of them does
        proc.kill()
        proc.wait()
        t0 = time.monotonic()
        while pids_with(str(out)) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert pids_with(str(out)) == [] and took < 5, took  # no orphan trains on
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    lines = (out / "metrics.jsonl").read_text()
    time.sleep(1.0)
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == saved
    assert (out / "metrics.jsonl").read_text() == lines  # nothing writes there any more
    newest = latest(out / "checkpoints", Team())
    assert newest is not None
    step = int(newest.path.name.split("-")[1])
    resume = cmd[3:]  # in this process, one rank: the checkpoint reshards, and no job starts again
    resume[resume.index("--max-steps") + 1] = str(step + 1)
    del resume[resume.index("--nproc"):resume.index("--nproc") + 4]  # --nproc 2 --pp 2
    capsys.readouterr()
    assert main([*resume, "--resume"]) == 0, capsys.readouterr().err[-2000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, step + 2)), steps  # one run's steps, each once


def test_a_folder_held_by_the_ranks_of_a_gone_launcher_names_them(tmp_path):
    """The launcher's pid is in `.lock`, but its ranks hold the lock too: while they outlive it (the
    moment after `kill -9`), a second run is refused naming them, not a pid that no longer exists."""
    from pipezero.errors import ConfigError
    from pipezero.rundir import claim, in_use

    gone = next(p for p in range(4_000_000, 3_000_000, -1) if not Path(f"/proc/{p}").exists())
    with claim(str(tmp_path), resume=False, force=False) as held:
        os.pwrite(held.fd, f"{gone}\n".encode(), 0)
        with pytest.raises(ConfigError, match=f"in use by another run \\(the ranks of pid {gone}, which is gone"):
            in_use(str(tmp_path))
