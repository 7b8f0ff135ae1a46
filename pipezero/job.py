"""A local torchrun job, run to its end or stopped as a whole when the launcher is told to stop.

torchrun starts each worker in a session of its own, so a signal to the launcher's process group
never reaches them, and torchrun answers SIGTERM with a report of many lines per rank. So on
SIGINT or SIGTERM the launcher stops the job itself: it notes torchrun's workers, ends torchrun
(SIGKILL: it holds nothing that must be saved, and so prints nothing), sends every worker SIGTERM,
kills any still alive after a grace period, and says in one line what happened. Checkpoints are
committed by an atomic rename, so the newest complete one is intact whenever a worker dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

GRACE_S = 5.0  # how long stopped workers may take to exit before they are killed
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, kill/timeout/a scheduler, a closed terminal


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a command with its stop line: SIGHUP only where it is not ignored (a
    job started under nohup keeps training when its terminal closes)."""
    return tuple(s for s in STOP_SIGNALS if s != signal.SIGHUP or signal.getsignal(s) is not signal.SIG_IGN)


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc; empty where it is not available)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(x) for x in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End torchrun `proc` and every worker it started; return when none is left."""
    workers = children(proc.pid)
    if not workers:  # nothing to see (not Linux, or between restarts): let torchrun stop them
        proc.terminate()
    else:
        proc.kill()
        _signal(workers, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and (proc.poll() is None or any(alive(w) for w in workers)):
        time.sleep(0.05)
    _signal([w for w in workers if alive(w)], signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def stop_advice(out: str) -> str:
    """What a stopped training job leaves: its checkpoints and --resume, or, where it saved none (stopped
    in its probe or trials, say), nothing to resume from."""
    from pipezero.rundir import LOCK, RUN_ID, holds_steps

    if holds_steps(Path(out) / "checkpoints"):
        return f"the newest complete checkpoint under {out} is intact: continue with --resume"
    try:
        wrote = [p.name for p in Path(out).iterdir() if p.name not in (LOCK, RUN_ID)]
    except OSError:
        wrote = []
    if wrote:  # its first steps' files: the same command is refused as "already holds a run"
        return (f"no checkpoint was saved under {out}, so nothing resumes: train again from step 0 with --force "
                f"there, or into another --out")
    return f"no checkpoint was saved under {out}: run the same command again"


def run_job(cmd: Sequence[str], env: dict[str, str], out: str, world: int = 1, after_stop: str | None = None,
            lock_fd: int | None = None) -> int:
    """Run torchrun command `cmd` of `world` ranks; its exit status, or 128 + the signal that
    stopped it, said with `after_stop` (what the command leaves: by default a training run's
    checkpoints and --resume). torchrun and its ranks die with this process, and keep the run
    folder's lock `lock_fd` open while they live (lifeline.py), so a launcher killed outright
    leaves neither orphans nor a folder open to a second run. SIGUSR1 asks every rank for its flight record; the hang doctor's
    report (doctor.py) is printed whenever the ranks wrote theirs (a request, a stalled or failed wait)."""
    from pipezero.lifeline import bind_child
    from pipezero.rundir import remove_trials
    from pipezero.runtime.watch import Desk, ask

    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _: received.append(signum)) for s in stop_signals()}
    previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda *_: ask(out))
    desk = Desk(out, world)
    try:
        env = dict(env)
        proc = subprocess.Popen(cmd, env=env, pass_fds=bind_child(env, lock_fd))
        while proc.poll() is None and not received:
            time.sleep(0.1)
            if text := desk.poll():
                print(text, file=sys.stderr, flush=True)
        if not received:  # a negative status is torchrun's own death by that signal: say it as a shell does
            remove_trials(out)  # a rank that failed mid-trial left it
            if proc.returncode != 0 and (text := desk.final()):
                print(text, file=sys.stderr, flush=True)
            return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        stop(proc)
        remove_trials(out)  # stopped ranks run no `finally`: --out as the job found it
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    name = signal.Signals(received[0]).name
    after_stop = after_stop or stop_advice(out)
    print(f"pipezero: stopped by {name}; every rank ended, {after_stop}", file=sys.stderr, flush=True)
    return 128 + received[0]
