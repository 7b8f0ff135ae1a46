"""Files written so that nothing is lost or half-written: atomic writes (a temporary file renamed
over the target), folders made and removed again on refusal, writes the filesystem refused named in
one line, and the paths a user names that would be traps (an unexpanded '~', a dangling or looping
link)."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


# A write that failed for want of room (or on a read-only filesystem): the user's to fix (another
# folder, free space), not a bug.
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


# A write the filesystem refused: no room (FULL), or no right (read-only files, folders, mounts;
# chattr +i refuses even root). Not a bug of pipezero's: the user's to fix, named in one line.
REFUSED = (*FULL, errno.EPERM, errno.EACCES)
_OS_ERROR = re.compile(r"os error (\d+)")  # how Rust's std::io reports one (safetensors' save_file)


def refused_write(e: BaseException) -> str | None:
    """`e` as one line naming the file and the fix, if it is a write the filesystem refused; else
    None (a bug's traceback stays a traceback)."""
    if not isinstance(e, OSError) or e.errno not in REFUSED:
        return None
    where = os.fsdecode(e.filename) if e.filename else "a file"
    fix = ("free space there, or choose a folder on another disk" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
           else "make it (or its folder) writable: chmod, chattr -i, a read-write mount; or choose another folder")
    return f"{where} cannot be written ({e.strerror or os.strerror(e.errno)}): {fix}"


def as_os_error(e: BaseException, path: str | Path, tmp: str = "") -> OSError | None:
    """The OSError behind a writer's own exception (safetensors reports 'os error 28' in a
    SafetensorError), naming `path` (not the temporary file `tmp` the user never named); None when
    `e` carries no errno."""
    if isinstance(e, OSError):
        named = os.fsdecode(e.filename) if e.filename else ""
        return e if named and named != tmp else OSError(e.errno, e.strerror, str(path))
    found = _OS_ERROR.search(str(e))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1))), str(path)) if found else None


def physical(folder: str | Path) -> str:
    """`folder` as the filesystem walks it, for tempfile: mkstemp and mkdtemp make their folder
    absolute by text (os.path.abspath), so 'link/../run' would become './run' there, not the folder
    the link's target's parent holds that mkdir made (`--out lnk/../o`)."""
    return os.path.realpath(folder)


def atomic_write_with(path: str | Path, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path` (a unique name: writers may race); it is
    fsynced, then renamed over `path`: readers see the old file or the new one, never half of one.
    A write the filesystem refuses raises an OSError naming `path` (refused_write says it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=physical(path.parent), prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode_for(path))  # mkstemp's file is the owner's alone
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, Exception) and (os_error := as_os_error(e, path, tmp)) is not None and os_error is not e:
            raise os_error from e
        raise


def mode_for(path: Path) -> int:
    """The permissions a file written at `path` gets: those of the file it replaces, else what the
    user's umask gives a new file (0644 under the usual 022), as open() would: a teammate reading a
    run's summary or a checkpoint's manifest reads them as they read the shards beside them."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return 0o666 & ~umask()


def umask() -> int:
    """This process's umask, read without setting it (Linux says it in /proc); elsewhere set and
    restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write_with(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def make_folders(path: Path) -> list[Path]:
    """Create `path` and its missing parents; the folders made, innermost first, so that a caller
    refused after this can leave the filesystem as it found it (`remove_made`). Raises OSError."""
    missing = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        missing.append(p)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        remove_made(missing)  # those made before the one that failed
        raise
    return missing


def remove_made(made: list[Path]) -> None:
    """Remove the folders `make_folders` made, innermost first, each only while it is still empty
    (something another process put there stays, and so do its parents)."""
    for p in made:
        try:
            p.rmdir()
        except FileNotFoundError:
            continue  # never made: a deeper one failed first
        except OSError:
            return


def unexpanded_home(flag: str, path: str) -> str | None:
    """Why `path` would be a trap, or None. A shell expands a leading '~' only in a bare word:
    a TOML value, a quoted argument or --out=~/x reach us as is, and the run was written to a new
    folder named '~' in the working directory, which a later `rm -r ~` would take for the home."""
    first = Path(path).parts[0] if path.startswith("~") else None
    if first is None or Path(first).exists():  # a real folder of that name is the user's choice
        return None
    return (f"{flag} {path!r} starts with '~', which only a shell expands: it would make a folder named {first!r} "
            f"in the working directory; write the full path, {os.path.expanduser(path)!r}")


def dangling_link(flag: str, path: str) -> str | None:
    """Why `path` cannot be made a folder because it is a link to nothing, or None: mkdir through
    it fails with "File exists", which names neither the link nor its missing target."""
    p = Path(path)
    if p.is_symlink() and not p.exists():
        return (f"{flag} {path!r} is a symlink to {os.readlink(p)}, which does not exist: create that folder, remove "
                f"the link, or choose another {flag.split(' ')[0]}")
    return None


def unfollowable(flag: str, path: str) -> str | None:
    """Why `path` cannot be followed to a place (a link on it loops), or None: Path.resolve raised
    out of the checks that compare an output folder with the run's and the data's."""
    try:
        Path(path).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError up to Python 3.12, OSError after
        return f"{flag} {path!r} cannot be followed ({e}): a link on its path loops; fix the link or choose another {flag}"
    return None
