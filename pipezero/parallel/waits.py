"""Every wait on another rank goes through here: bounded, and failing with what was awaited."""

from __future__ import annotations

from datetime import timedelta
from typing import Any


class PipelineTimeout(RuntimeError):
    """A wait on a peer ran past the timeout; the message names rank, step and what was awaited."""


def wait_or_raise(work: Any, timeout_s: float, what: str) -> None:
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise PipelineTimeout(f"{what}: failed or timed out after {timeout_s:g}s ({e})") from e
    if ok is False:
        raise PipelineTimeout(f"{what}: timed out after {timeout_s:g}s")
