"""Every wait on another rank goes through here: bounded, and failing with what was awaited."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any


class PipelineTimeout(RuntimeError):
    """A wait on a peer ran past the timeout; the message names rank, step and what was awaited."""


def wait_or_raise(work: Any, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        took = time.monotonic() - t0
        how = f"timed out after {timeout_s:g}s" if took >= 0.9 * timeout_s else f"failed after {took:.1f}s (peer gone?)"
        raise PipelineTimeout(f"{what}: {how} ({e})") from e
    if ok is False:
        raise PipelineTimeout(f"{what}: timed out after {timeout_s:g}s")
