"""What the bad-input tests use to prove a user's files untouched, and to make paths that refuse
what pipezero does to them: read-only or immutable files and folders, and pipes read with a limit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest


def tree(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under `folder` (hidden ones too) with size, inode and modification time: to
    prove nothing was written, replaced or removed there."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_ino, p.lstat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes: to prove nothing was written there."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


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
