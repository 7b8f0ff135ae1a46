"""Small helpers with no better home: atomic file writes and the user's cache directory."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import Any


def cache_dir() -> Path:
    """Where tokenizers and tokenized corpora are cached: $PIPEZERO_CACHE, else ~/.cache/pipezero.
    Created private (0700): what is cached is read back as trusted tokens and tokenizers."""
    root = os.environ.get("PIPEZERO_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pipezero"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def atomic_write_with(path: str | Path, write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path` (a unique name: writers may race); it is
    fsynced, then renamed over `path`: readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write_with(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())
