"""A run folder (`--out`) belongs to one run at a time, and is never reused by mistake.

Claiming it checks, before any rank starts, that it can be a run folder (a writable folder, not
a file or an empty name); refuses one that already holds a run unless the user says `--resume`
(continue it) or `--force` (train beside what is there); and takes an exclusive `flock` on
`DIR/.lock`, held by the process that launches the ranks (or rank 0 under an outside torchrun)
until the run ends, so a second run in the same folder stops at once instead of both writing the
same checkpoints. The kernel drops the lock when its holder dies, so a crash never leaves a stale
lock behind.

Each run has an id, kept in `DIR/.run-id` and written into its checkpoints' manifests: pruning
deletes only checkpoints of the same id, and resuming takes only those, so a `--force` run never
deletes or continues from the checkpoints of the run it trained beside; a `--force` run that would
save a step that run saved (the same `step-N` folder) is refused before it starts. `--resume` keeps
the id; in a folder that holds a run's file names (config.json, metrics.jsonl, ...) but was never
claimed and holds no checkpoints, it is refused: those files are someone else's.

A run refused after its claim (the corpus too small for a batch, a checkpoint of another model),
or one that failed before writing anything, leaves the folder as the claim found it: no `.lock`, no
new `.run-id`, none of the folders made for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from pipezero.errors import ConfigError
from pipezero.files import atomic_write_bytes, make_folders, remove_made

LOCK = ".lock"
RUN_ID = ".run-id"
HELD_BY_LAUNCHER = "PIPEZERO_RUN_CLAIMED"  # set for the ranks a launcher started: it holds the lock
# what a run writes at the top of its folder (engine.py, summary.py, telemetry/): in a folder no run
# claimed, --resume would replace them
RUN_FILES = {"config.json", "metrics.jsonl", "summary.json", "trace.json", "trace.png", "tensorboard", "hf"}
RUN_FOLDERS = {"checkpoints", "tensorboard", "hf"}  # of RUN_FILES and the checkpoints, those that are folders
OPENING = {"config.json", "metrics.jsonl"}  # what a run writes before its first step (engine.Trainer.set_up)


def wrong_kind(path: Path) -> str | None:
    """A name the run writes that holds the other kind (a folder where a file goes, a file or a
    pipe where a folder goes) would fail only when written, after the training: said here
    instead, or None."""
    for name in sorted(RUN_FILES | RUN_FOLDERS | {RUN_ID, LOCK}):
        entry = path / name
        if name in RUN_FOLDERS and entry.exists() and not entry.is_dir():
            return f"{name} is a file, where the run writes a folder: move it away, or choose another --out"
        if name not in RUN_FOLDERS and entry.exists() and not entry.is_file():
            kind = "a folder" if entry.is_dir() else "not a regular file"
            return f"{name} is {kind}, where the run writes a file: move it away, or choose another --out"
    return None


def run_id(out: str | Path) -> str | None:
    """The id of the run that claimed `out`; None for a folder never claimed (tests, old runs). A
    pipe at .run-id (no run writes one) is no id: reading it would wait for a writer for ever."""
    path = Path(out) / RUN_ID
    if not path.is_file():
        return None
    try:
        return path.read_text().strip() or None
    except (OSError, UnicodeDecodeError):  # a damaged id claims nothing: the run is not ours to resume
        return None


Entries = dict[str, tuple[int, int, int]]


def _entries(path: Path) -> Entries:
    """The folder's entries besides the claim's own files, each as (inode, mtime, size): a run that
    wrote anything at the top of its folder, or made or removed anything in a folder there (its
    checkpoints, RUN/hf), changes one of them."""
    out = {}
    for p in path.iterdir():
        if p.name not in (LOCK, RUN_ID):
            st = p.lstat()
            out[p.name] = (st.st_ino, st.st_mtime_ns, st.st_size)
    return out


@dataclass
class AsFound:
    """The run folder as a claim found it, to put back when the run is refused: nothing of a run
    that never started may stay (a .lock, a .run-id, the folders made for it)."""

    made: list[Path]  # folders the claim created, innermost first
    had_lock: bool
    previous_id: bytes | None  # the .run-id file's bytes; None: there was none
    entries: Entries


@dataclass
class Claim:
    """An exclusive hold on a run folder; release it (or leave the `with` block) when the run ends.
    A run that wrote nothing there (refused, or failed before it started) leaves the folder as it
    found it."""

    path: Path
    fd: int
    id: str
    found: AsFound

    def release(self) -> None:
        if self.fd >= 0:
            try:
                if _entries(self.path) == self.found.entries:
                    self._put_back()  # under the lock still: no other run is in between
            except OSError:
                pass  # the folder went away or cannot be read: nothing to put back
            os.close(self.fd)  # closing drops the flock
            self.fd = -1

    def drop_opening(self) -> None:
        """Forget a run refused at its first step (its --model-spec code raised: exit 2): the opening
        files it wrote (config.json, an empty metrics.jsonl) removed where this run made them, so
        `release` leaves the folder as it found it, as a refusal before the claim would. A run that
        wrote anything else (a metrics line, a checkpoint, tensorboard), or over files it found,
        keeps everything."""
        if self.fd < 0:
            return
        try:
            now = _entries(self.path)
            made = set(now) - set(self.found.entries)
            if not made <= OPENING or any(now.get(k) != v for k, v in self.found.entries.items()):
                return
            if "metrics.jsonl" in made and now["metrics.jsonl"][2]:
                return
            for name in made:
                (self.path / name).unlink()
        except OSError:
            pass  # then release keeps what is there: nothing of the user's is at stake

    def _put_back(self) -> None:
        run_file = self.path / RUN_ID
        if self.found.previous_id is None:
            run_file.unlink(missing_ok=True)
        elif _read(run_file) != self.found.previous_id:
            atomic_write_bytes(run_file, self.found.previous_id)
        if not self.found.had_lock:
            (self.path / LOCK).unlink(missing_ok=True)
        remove_made(self.found.made)

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def holds_steps(folder: Path) -> bool:
    """Whether `folder` holds a checkpoint's folder (`step-N`, or one being saved): the mark of a run
    that lost its .run-id. A `checkpoints` folder of nothing else is no run: any folder may be named so."""
    try:
        return any(p.name.startswith(("step-", ".tmp-step-")) for p in folder.iterdir())
    except OSError:  # none there, or not a folder
        return False


def checkpoints_above(path: Path) -> Path | None:
    """The checkpoints folder of a run that `path` is (or is inside), or None. `--force` there wrote a
    whole run into another's `checkpoints/step-N` (its metrics, its own checkpoints beside the
    saved shards); a folder is a run's checkpoints when named so beside a `.run-id`, or holding steps."""
    try:
        here = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop: the claim's own checks name it
        return None
    for folder in (here, *here.parents):
        if folder.name == "checkpoints" and ((folder.parent / RUN_ID).is_file() or holds_steps(folder)):
            return folder
    return None


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def in_use(out: str) -> None:
    """Refuse `out` if another run holds its lock, without taking it: said first, before the checks
    of what a resume would find there (the other run's checkpoints are changing under it)."""
    try:  # not blocking: opening a pipe at .lock to read would wait for a writer for ever
        fd = os.open(Path(out) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # none, a link, not readable: the claim says what is wrong with it
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return  # a pipe or a device: the claim names it (wrong_kind)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(f"--out {out!r} is in use by another run ({_holder(fd)}); wait for it to end or choose "
                          f"another --out") from None
    except OSError:
        return
    finally:
        os.close(fd)  # closing drops the probe's lock


def _holder(fd: int) -> str:
    """Who holds the lock open at `fd`, as the message says it: the pid its taker wrote, or, when that
    process is gone, the ranks it started, which keep the lock while they live (lifeline.py)."""
    text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    if not text.isdigit():
        return "pid ?"
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return f"the ranks of pid {text}, which is gone; they end within seconds"
    except OSError:  # another user's process: alive
        pass
    return f"pid {text}"


def _lock(path: Path) -> int:
    while True:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(f"--out {str(path)!r} is in use by another run ({holder}); wait for it to end "
                              f"or choose another --out") from None
        try:
            if os.stat(path / LOCK).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # the file was removed by a refused run's claim as we locked it: lock the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


@contextlib.contextmanager
def held(path: Path) -> Iterator[int]:
    """An exclusive hold on folder `path` (made if missing) for a command that is not a run, as long
    as the block lasts: two `pipezero verify` at one --out deleted and read each other's rank files,
    and one said the layout trains another model. The second is refused, naming the first's pid.
    Yields the lock's descriptor, for the ranks to hold too (lifeline.py)."""
    make_folders(path)
    fd = _lock(path)
    try:
        yield fd
    finally:
        os.close(fd)  # closing drops the flock; the .lock file stays, as a run's does


def refuse_folder(out: str, resume: bool | None = None, force: bool = False) -> None:
    """The claim's checks of `out` that need no lock (its kind, where it lies, the kinds of the
    names a run writes there): a ConfigError, or nothing. `pipezero cluster` runs them before it
    builds the cluster, whose rank 0 takes the claim: refused there, it was every node's torchrun
    report instead of one line."""
    path = Path(out)
    if not out.strip():
        raise ConfigError("--out is empty: name a folder for the run")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {out!r} is a file, not a folder: name a folder for the run")
    if (inside := checkpoints_above(path)) is not None:
        raise ConfigError(f"--out {out!r} is inside {inside}, a run's checkpoints folder, which that run's saves, "
                          f"pruning and resume manage: choose a folder outside it")
    if path.is_dir() and (wrong := wrong_kind(path)):  # before the lock: a refusal leaves the folder as found
        raise ConfigError(f"--out {out!r}: {wrong}")
    if (path / LOCK).is_symlink():  # the lock is opened and its pid written through the link: the target's bytes
        raise ConfigError(f"--out {out!r}: {LOCK} is a symlink (to {os.readlink(path / LOCK)}), and the run writes "
                          f"its pid there, over that file: remove the link, or choose another --out")
    if resume is not None and not (resume or force) and path.is_dir() and (names := sorted(_entries(path))):
        raise ConfigError(_holds_a_run(out, names))  # the claim says it again under its lock


def _holds_a_run(out: str, names: list[str]) -> str:
    """Why a run without --resume or --force is refused `out`, which holds `names`, with the fixes
    that would be taken: --force writes over the records of a run pipezero started only (`claim`),
    and beside files that are none of a run's."""
    path = Path(out)
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    if (path / RUN_ID).is_file() or holds_steps(path / "checkpoints"):
        return (f"--out {out!r} already holds a run ({shown}): pass --resume to continue it, --force to train there "
                f"anyway, or choose another --out")
    if foreign := sorted(set(names) & RUN_FILES):
        return (f"--out {out!r} holds {', '.join(foreign)} but no run pipezero started (no {RUN_ID}, no checkpoints): "
                f"a run would write over them, and they are not pipezero's to replace; move them away, or choose "
                f"another --out")
    return (f"--out {out!r} holds files of no run ({shown}): pass --force to train there beside them (none is "
            f"replaced), or choose another --out")


# --layout auto's trials train in this folder inside --out (planner/auto_trials.py): on the run's own
# disk, removed afterwards
TRIALS = ".layout-trials"


def run_of_trial(trial: Path) -> Path:
    """The run folder a layout trial's folder (`OUT/TRIALS/<trial>`) belongs to: its ranks answer the
    hang doctor there, where the launcher asks and `pipezero doctor OUT` reads."""
    if trial.parent.name != TRIALS:
        raise ValueError(f"{trial} is not a layout trial's folder (OUT/{TRIALS}/...)")
    return trial.parent.parent


def remove_trials(out: str | Path) -> None:
    """Remove `--layout auto`'s trials folder (`TRIALS`) where no rank can be
    using it: the job is over, or its folder's lock is held before any rank starts. A rank stopped by
    a signal, or killed, runs no `finally`, and the folder stayed, where the next run read it as a run
    already there. Never followed where it is a link."""
    import shutil

    shutil.rmtree(Path(out) / TRIALS, ignore_errors=True)  # a link is refused, not removed: rmtree raises on it


def refuse_trials_name(out: str | Path) -> None:
    """A file or link under the trials folder's name is the user's, not a scratch folder: the trials
    wrote through a link (into the folder it names) and failed on both with every rank's traceback."""
    path = Path(out) / TRIALS
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        what = "a link" if path.is_symlink() else "a file"
        raise ConfigError(f"--out {str(out)!r} holds {TRIALS}, {what}, under the name --layout auto's trials take "
                          f"for their scratch folder: move it away (pipezero neither writes through nor removes it)")


def claim(out: str, resume: bool, force: bool, clashes: Callable[[], str | None] | None = None) -> Claim:
    """Take run folder `out` for a run, or raise a ConfigError saying why it cannot be. `clashes`:
    with `--force`, what of the run already there this run would write over (its checkpoints of the
    steps this one saves: a save replaces a folder of its step), as the fix to print; None: nothing.
    A refusal leaves the folder as it was."""
    path = Path(out)
    refuse_folder(out)
    refuse_trials_name(path)
    made: list[Path] = []
    try:
        made = make_folders(path)
        had_lock = (path / LOCK).exists()
        fd = _lock(path)
    except OSError as e:
        remove_made(made)
        raise ConfigError(f"--out {out!r} cannot be written ({e.strerror or e}): choose a writable folder") from None
    except BaseException:
        remove_made(made)
        raise
    if "RANK" not in os.environ:  # a launcher or a lone process: no rank of this run has started
        remove_trials(path)
    previous = _read(path / RUN_ID)
    held = Claim(path, fd, "", AsFound(made, had_lock, previous, _entries(path)))
    try:
        if held.found.entries and not (resume or force):
            raise ConfigError(_holds_a_run(out, sorted(held.found.entries)))
        foreign = sorted(set(held.found.entries) & RUN_FILES)
        if (resume or force) and previous is None and foreign and not holds_steps(path / "checkpoints"):
            flag = "--resume" if resume and not force else "--force"
            raise ConfigError(f"--out {out!r} holds {', '.join(foreign)} but no run pipezero started (no {RUN_ID}, "
                              f"no checkpoints), and {flag} would write over them: they are not pipezero's to "
                              f"replace; move them away, or choose another --out")
        clash = clashes() if held.found.entries and force and not resume and clashes else None
        if clash:
            raise ConfigError(f"--out {out!r}: {clash}")
        kept = run_id(path)
        held.id = kept if (resume and kept) else uuid.uuid4().hex[:16]
        if kept != held.id:
            atomic_write_bytes(path / RUN_ID, f"{held.id}\n".encode())  # never a torn id that resumes nothing
    except BaseException:
        held.release()
        raise
    return held


def claim_here(out: str, resume: bool, force: bool,
               clashes: Callable[[], str | None] | None = None) -> contextlib.AbstractContextManager[object]:
    """Claim `out` if this process is the one that should: a launcher or a lone process, or rank 0
    under an outside torchrun (after an elastic restart it continues its own run, so the folder may
    hold it). Ranks our launcher started, and other ranks, claim nothing."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if os.environ.get(HELD_BY_LAUNCHER) and under_torchrun:  # set by hand in a lone process, it holds nothing
        return contextlib.nullcontext()
    if under_torchrun:
        if os.environ["RANK"] != "0":
            return contextlib.nullcontext()
        resume = resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    return claim(out, resume, force, clashes)
