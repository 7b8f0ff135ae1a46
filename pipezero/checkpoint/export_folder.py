"""Where `pipezero export` writes: a folder of its own, made whole beside `--out`, then renamed into place.

Every format writes through here, so none can write over what a user has: `--out` must not exist
or be an empty folder (an export onto the model folder a run started from replaced its weights and
config; onto an earlier export of the other format, mixed the two), must not be a symlink (its
target may be that model folder), and must not lie among the folders a run manages: its
checkpoints (a save of step N replaces `checkpoints/step-N`, and debris there is deleted) and
`RUN/hf` (rewritten at each start). The files go into a temporary folder beside `--out`, renamed
onto it in one step: an interrupted export leaves no half model a loader takes for whole, and a
folder that filled up at `--out` meanwhile is never replaced (a rename onto it fails).
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

from pipezero.checkpoint.store import MANIFEST, CheckpointError
from pipezero.errors import ConfigError
from pipezero.rundir import RUN_ID
from pipezero.files import FULL, make_folders, remove_made


def run_of_source(source: Path) -> Path | None:
    """The run folder an export's `source` belongs to: itself (a run), the run of a
    `RUN/checkpoints/step-N`, or None (a checkpoint moved out of its run)."""
    if (source / "checkpoints").is_dir():
        return source
    if source.parent.name == "checkpoints":
        return source.parent.parent
    return None


def _inside_a_run(out: Path, source: Path) -> str | None:
    """Why `out` lies among folders a run or a checkpoint manages, or None. A run is the export's
    own, or any folder holding a run id (every run the CLI started)."""
    source_run = run_of_source(source)
    runs = {source_run.resolve()} if source_run else set()
    where = out.resolve()
    for p in (where, *where.parents):
        if p.parent in runs or (p.parent / RUN_ID).is_file():
            if p.name == "checkpoints":
                return (f"is inside the checkpoints folder of run {p.parent}, where its saves replace and its "
                        f"pruning deletes folders")
            if p.name == "hf":
                return (f"is the run's own hf folder ({p}), where the run keeps the model files it rewrites at "
                        f"each start")
        if (p / MANIFEST).is_file():
            return f"is inside the checkpoint {p}"
    return None


def check_out(out: Path, source: Path) -> None:
    """Refuse, before anything is read or written, an `--out` an export must not write (module
    docstring), in one line naming it and the fix."""
    if out.is_symlink():
        raise ConfigError(f"--out {out} is a symlink (to {os.readlink(out)}); an export writes only a folder "
                          f"of its own: give a new folder")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder; an export writes a folder of its own and never "
                          f"over a file: give a new folder")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} already holds files; an export never writes over them: give a new folder, "
                          f"or remove that one first")
    if out.is_dir() and (held := _in_place(out)):
        raise ConfigError(f"--out {out} is {held}, which an export cannot replace (it writes its folder beside --out, "
                          f"then renames it into place): give a new folder inside it, e.g. --out {out / 'export'}")
    reason = _inside_a_run(out, source)
    if reason:
        raise ConfigError(f"--out {out} {reason}: export beside the run instead, e.g. --out {out.name}-export "
                          f"next to it")


def _in_place(out: Path) -> str | None:
    """Why the existing (empty) folder `out` cannot be renamed onto: the working folder (the rename
    fails with "Device or resource busy" for `--out .`; where it works, the shell sits in a removed
    folder) or a mount point; None when it can."""
    if out.resolve() == Path.cwd().resolve():
        return "the working folder"
    if os.path.ismount(out):
        return "a mount point"
    return None


def _cannot_make(out: Path, e: OSError) -> ConfigError:
    return ConfigError(f"--out {out} cannot be made ({e.strerror or e}): give a folder where you can write")


def write_folder(out: Path, fill: Callable[[Path], None]) -> None:
    """Make the folder `out` (checked with `check_out`) holding what `fill(folder)` writes into the
    empty folder it is given: written beside `out`, renamed onto it whole. Nothing is left behind
    when `fill` fails, not even the parents made for `out`."""
    try:
        made = make_folders(out.parent)
    except OSError as e:
        raise _cannot_make(out, e) from None
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        try:
            tmp.mkdir(0o777)  # the umask applies, as to a folder the user makes
        except OSError as e:
            raise _cannot_make(out, e) from None
        if out.is_dir():  # an empty folder replaced: it keeps its permissions
            os.chmod(tmp, stat.S_IMODE(out.stat().st_mode))
        try:
            fill(tmp)
        except OSError as e:  # named as the user will look for it: in --out, not in our scratch folder
            name = os.fsdecode(e.filename) if e.filename else ""
            where = out / Path(name).relative_to(tmp) if name and Path(name).is_relative_to(tmp) else out
            reason = e.strerror or str(e)
            fix = ("free space there, or choose a folder on another disk" if e.errno in FULL
                   else "make the folder writable, or choose another --out")
            raise CheckpointError(f"writing the export to {out} failed: {where} cannot be written ({reason}): "
                                  f"{fix}; nothing was left there") from None
        try:
            os.replace(tmp, out)  # onto nothing, or onto a folder still empty
        except OSError as e:
            raise ConfigError(f"--out {out} cannot be written ({e.strerror or e}); an export never writes over "
                              f"files: give a new folder") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_made(made)
        raise
