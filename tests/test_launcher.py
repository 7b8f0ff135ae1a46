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
from one_line import assert_one_line, run_main
from pipezero.cli import main
from tiny_runs import TRAIN_TINY


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


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not a rank number"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not a rank number"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not a rank number"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1 is not a rank of WORLD_SIZE=1"),
])
def test_torchrun_variables_set_by_hand_are_checked(env, needle):
    from pipezero.errors import ConfigError
    from pipezero.launch import check_rank_variables

    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        check_rank_variables(env)
    check_rank_variables({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    check_rank_variables({"WORLD_SIZE": "abc"})  # without RANK nothing reads them


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR='' MASTER_PORT='' name no rendezvous"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "http"}, "MASTER_PORT='http' name no"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "MASTER_PORT='70000' name no"),
])
def test_rank_variables_by_hand_need_a_rendezvous(env, needle):
    from pipezero.errors import ConfigError
    from pipezero.launch import check_rank_variables

    with pytest.raises(ConfigError, match=needle):
        check_rank_variables(env)
    check_rank_variables({"RANK": "0", "WORLD_SIZE": "1"})  # one rank: no rendezvous to name
    check_rank_variables({**env, "MASTER_ADDR": "h", "MASTER_PORT": "29500"})


def test_a_leftover_torchelastic_restart_count_is_one_line(tmp_path, capsys, monkeypatch):
    """Read as an integer by the claim and the resume: 'x' is named, not taken for a count."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "x")
    assert_one_line(*run_main([*TRAIN_TINY, "--out", str(tmp_path / "o")], capsys),
                    "TORCHELASTIC_RESTART_COUNT='x' is not a count")
    assert not (tmp_path / "o").exists()


def test_a_rendezvous_that_cannot_connect_is_one_line(capsys, monkeypatch):
    """A MASTER_ADDR that resolves nowhere: torch's DistNetworkError after --timeout, said in one line."""
    import torch.distributed as dist

    from pipezero import engine
    from pipezero.cli.train import train_here

    def unreachable(cfg):
        raise dist.DistNetworkError("The client socket has timed out after 5000ms while trying to connect to (x, 1).")

    monkeypatch.setattr(engine, "train", unreachable)
    monkeypatch.setenv("MASTER_ADDR", "no.such.host")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert train_here(None) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "connection to no.such.host:29999 failed (DistNetworkError: The client" in err


def test_torchrun_ending_on_a_failed_rank_is_one_line_not_its_traceback(monkeypatch, capsys):
    """A rank that failed (a collective timed out on a slow `pipezero cluster --link`, a spec's forward
    raised) says why in its own line; torchrun's agent's ChildFailedError (~50 lines a node) would
    only repeat it, so it becomes one line naming the rank and its exit code, exit 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from pipezero import loopback

    def failing(argv):
        raise ChildFailedError("pipezero.cli", {1: ProcessFailure(local_rank=1, pid=4242, exitcode=1, error_file=""),
                                                0: ProcessFailure(local_rank=0, pid=4241, exitcode=-15, error_file="")})

    monkeypatch.setattr(loopback, "torchrun_main", failing)
    with pytest.raises(SystemExit) as e:
        loopback.main(["-m", "pipezero.cli"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "pipezero: rank 0 (exit code -15), 1 (exit code 1) ended the job; each rank's own lines above say why"]


def test_ctrl_c_while_torch_is_still_being_imported_is_the_interrupt_line(monkeypatch, capsys):
    """Ctrl-C a second after `pipezero train` starts (SIGINT at 1 s, under load) can land in the
    import of torch that building the parser does: main's handler must cover that too, so the
    interrupt is its one line, not a KeyboardInterrupt traceback."""
    from pipezero.cli import command_line as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [cli.INTERRUPTED]


def test_a_lone_process_stopped_before_its_first_save_offers_no_resume(tmp_path, capsys):
    """A lone `pipezero train` stopped by Ctrl-C or SIGTERM said --resume continues "from the newest
    complete one" where it had saved none: what its claimed folder holds says which it is."""
    from pipezero.cli import command_line as cli

    run = tmp_path / "run"
    run.mkdir()
    assert cli.interrupted(KeyboardInterrupt(), True, str(run)) == 130
    assert capsys.readouterr().err.strip() == f"pipezero: interrupted; no checkpoint was saved under {run}: run the " \
                                              f"same command again"
    (run / "metrics.jsonl").write_text("{}\n")
    assert cli.interrupted(cli.Terminated(), True, str(run)) == 143
    assert "nothing resumes: train again from step 0 with --force" in capsys.readouterr().err
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    cli.interrupted(KeyboardInterrupt(), True, str(run))
    assert capsys.readouterr().err.strip() == f"pipezero: interrupted; the newest complete checkpoint under {run} is " \
                                              f"intact: continue with --resume"


@pytest.mark.parametrize("command", ["verify", "export", "plan", "probe"])
def test_ctrl_c_of_a_command_that_saves_no_checkpoint_offers_no_resume(command, monkeypatch, capsys):
    """Only train saves checkpoints and takes --resume: verify (which refuses --resume), export, plan
    and probe were told that --resume continues from the newest checkpoint."""
    from pipezero.cli import command_line as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main([command, "--help"]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["pipezero: interrupted"]

    def terminated():
        raise cli.Terminated

    monkeypatch.setattr(cli, "build_parser", terminated)
    assert cli.main([command]) == 143
    assert capsys.readouterr().err.strip().splitlines() == ["pipezero: stopped by SIGTERM"]


def test_the_loopback_store_leaves_no_python_socket_to_be_collected_unclosed():
    """The store owns the listening socket's descriptor: a Python socket object kept beside it would,
    when collected, warn ResourceWarning ('Exception ignored' tracebacks from torchrun's agent under
    PYTHONWARNINGS=error)."""
    import gc
    import warnings
    from datetime import timedelta

    from pipezero.loopback import LoopbackTCPStore

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        store = LoopbackTCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5), wait_for_workers=False)
        store.set("k", "v")
        assert store.get("k") == b"v"
        del store
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], [str(w.message) for w in seen]


@pytest.mark.distributed
def test_a_stopped_job_says_what_its_command_leaves(tmp_path, capsys):
    """verify writes no checkpoint and refuses --resume, so Ctrl-C under `verify --nproc 2` must not
    say train's "the newest complete checkpoint ... continue with --resume". The launcher's stop line
    takes the command's own words; train's stay the default."""
    import signal
    import sys

    from pipezero.job import run_job

    cmd = [sys.executable, "-c", "import os, signal, time; os.kill(os.getppid(), signal.SIGINT); time.sleep(30)"]
    assert run_job(cmd, {}, str(tmp_path), after_stop="verify stopped: run it again") == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().endswith("every rank ended, verify stopped: run it again")
    assert run_job(cmd, {}, str(tmp_path)) == 128 + signal.SIGINT  # stopped before its first save
    assert capsys.readouterr().err.strip().endswith(f"no checkpoint was saved under {tmp_path}: run the same "
                                                    f"command again")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # its first steps ran, none was saved
    assert run_job(cmd, {}, str(tmp_path)) == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().endswith(f"no checkpoint was saved under {tmp_path}, so nothing resumes: "
                                                    f"train again from step 0 with --force there, or into another --out")
    (tmp_path / "checkpoints" / "step-00000002").mkdir(parents=True)
    assert run_job(cmd, {}, str(tmp_path)) == 128 + signal.SIGINT
    assert "continue with --resume" in capsys.readouterr().err


@pytest.mark.distributed
def test_a_job_stopped_mid_trial_leaves_no_trials_folder(tmp_path, capsys):
    """A rank stopped by a signal runs no `finally`: the `--layout auto` trials' folder stayed in --out."""
    import signal
    import sys

    from pipezero.job import run_job

    trial = tmp_path / ".layout-trials" / "0"
    cmd = [sys.executable, "-c", f"import os, signal, time; os.makedirs({str(trial)!r}); "
                                 f"os.kill(os.getppid(), signal.SIGTERM); time.sleep(30)"]
    assert run_job(cmd, {}, str(tmp_path)) == 128 + signal.SIGTERM
    assert not (tmp_path / ".layout-trials").exists()


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


def test_ranks_start_without_the_working_folder_on_their_import_path(monkeypatch, tmp_path):
    """`python -m` puts the working folder first on sys.path: a rich.py or torch.py there (a corpus of
    .py documents) would run in every rank. The launcher starts torchrun's agent with -P and its
    ranks with PYTHONSAFEPATH; only --model-spec imports from the working folder, by its own choice."""
    import pipezero.launch as launch

    seen = {}
    monkeypatch.setattr(launch, "run_job", lambda cmd, env, *a, **k: seen.update(cmd=cmd, env=env) or 0)
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    assert launch.launch_local(2, ["train", "--preset", "tiny"], str(tmp_path / "o")) == 0
    assert seen["cmd"][1:3] == ["-P", "-m"] and seen["env"]["PYTHONSAFEPATH"] == "1"


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_stop_signal_to_a_lone_process_is_the_stop_line_not_a_silent_death(name, capsys):
    """`kill`, `timeout` or a scheduler's SIGTERM, or a closed terminal's SIGHUP, ends a one-process
    run with the stop line, as Ctrl-C says what the run leaves, not an exit 143 or 129 without a word;
    the handler is the command's only (restored after)."""
    import signal

    from pipezero.cli import command_line as cli

    signum = getattr(signal, name)

    def parser_then_signal():
        signal.raise_signal(signum)
        raise AssertionError(f"{name} did not stop the command")

    seen: list[int] = []
    before = signal.signal(signum, lambda *_: seen.append(1))  # keeps pytest alive without the fix
    try:
        original, cli.build_parser = cli.build_parser, parser_then_signal
        try:
            code = cli.main(["train"])
        except AssertionError:
            code = None
        finally:
            cli.build_parser = original
        assert code == 128 + signum and not seen, (code, seen)
        assert capsys.readouterr().err.strip().splitlines() == [cli.TERMINATED.replace("SIGTERM", name)]
        assert signal.getsignal(signum) is not cli.terminate  # restored: the caller's own again
    finally:
        signal.signal(signum, before)


def test_the_launcher_stops_its_job_on_sighup_unless_told_to_ignore_it():
    """SIGHUP ended the `--nproc` launcher without a word (its ranks died with it, silently); nohup's
    SIG_IGN is kept, so a job started under nohup trains on."""
    import signal

    from pipezero.job import stop_signals

    before = signal.getsignal(signal.SIGHUP)
    try:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        assert set(stop_signals()) == {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        assert signal.SIGHUP not in stop_signals()
    finally:
        signal.signal(signal.SIGHUP, before)
