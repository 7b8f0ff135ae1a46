"""The user's cache folder (tokenizers, tokenized corpora): where it is, its lock, and building an
entry there once among the processes that share it."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pipezero.errors import ConfigError
from pipezero.files import FULL, unexpanded_home


def cache_root() -> tuple[Path, str]:
    """The cache folder and what chose it (the variable a user would change)."""
    if os.environ.get("PIPEZERO_CACHE"):
        return Path(os.environ["PIPEZERO_CACHE"]), "PIPEZERO_CACHE"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "pipezero", "XDG_CACHE_HOME"
    return Path(os.path.expanduser("~/.cache")) / "pipezero", "the default, ~/.cache/pipezero"


def cache_error(path: Path, source: str, what: str, e: OSError,
                fix: str = "point PIPEZERO_CACHE at a folder you can write") -> ConfigError:
    return ConfigError(f"the cache folder {path} ({source}) {what} ({e.strerror or e}); {fix}")


def cache_dir() -> Path:
    """Where tokenizers and tokenized corpora are cached: $PIPEZERO_CACHE, else ~/.cache/pipezero.
    Created private (0700): what is cached is read back as trusted tokens and tokenizers. Only
    made here, not probed for writing: a read-only cache whose entries are complete is still read
    (writes fail in one line where an entry is built: `cache_lock`)."""
    path, source = cache_root()
    if source == "PIPEZERO_CACHE" and (home := unexpanded_home("PIPEZERO_CACHE", str(path))):
        raise ConfigError(home)  # set quoted, or in a unit or compose file: no shell expanded it
    if path.exists() and not path.is_dir():
        raise ConfigError(f"the cache folder {path} ({source}) is a file, not a folder; point PIPEZERO_CACHE at a "
                          f"folder you can write")
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise cache_error(path, source, "cannot be made", e) from None
    return path


@contextmanager
def cache_lock(name: str) -> Iterator[None]:
    """Hold the cache's lock file for entry `name` (flock; released by the kernel if the holder
    dies). Without it, the ranks of a job that an outside torchrun starts each tokenize the same
    corpus at once, N times the work, and keep one result. The holder removes the file as it
    leaves, so none is left behind: a process already waiting on it then finds the entry built,
    and one that comes later makes a new file. A filesystem without locks (ENOLCK) goes unlocked:
    every process builds and one atomic rename wins."""
    path = cache_dir() / f".{name}.lock"
    try:
        f = open(path, "a")  # noqa: SIM115 - closed by the `with` below
    except OSError as e:  # the first write of any build
        raise cache_error(path.parent, cache_root()[1], "cannot be written", e) from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"pipezero: waiting for another process building {name} (lock {path})", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            yield
            return
        try:
            yield
        finally:
            try:
                if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:  # not a newer process's file
                    path.unlink()
            except FileNotFoundError:
                pass
            fcntl.flock(f, fcntl.LOCK_UN)


def build_once(name: str, ready: Callable[[], bool], build: Callable[[], None]) -> None:
    """`build()` the cache entry `name` unless `ready()`: among the processes sharing the cache,
    one builds it while the others wait on its lock, then find it ready. A disk that fills up
    during the build is one line naming the cache folder."""
    if ready():
        return
    with cache_lock(name):
        if not ready():
            try:
                build()
            except OSError as e:
                if e.errno not in FULL:
                    raise
                path, source = cache_root()
                raise cache_error(path, source, f"could not hold {name}", e,
                                  "free space there, or point PIPEZERO_CACHE at a folder with room") from None
