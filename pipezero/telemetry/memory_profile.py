"""Measure a rank's peak memory by phase of the run (its first training step, its first held-out
evaluation, the end-of-run text sample), to hold the memory model (memory/model.py) against: on CUDA the caching allocator's peak of allocated bytes; on CPU the most
bytes of tensors alive at once, summed from the profiler's memory events (every allocation and free
of torch's CPU allocator on the threads it follows: the main thread, autograd's and gloo's workers).

Resident memory would not do on CPU: it moves with malloc's arenas, the interpreter and other jobs
by more than a small model's state. The events also count what only a collective holds (a
reduction's wire copy), which no walk over Python's objects would find. The window opens before
the rank builds its model, so parameters, buckets and AdamW's state are counted from nothing; the
corpus loaded before it is not (it is no part of a layout's memory).

The meter is paused between phases (the profiler off: the steps after the first run at full
speed) and carries the bytes alive at a pause into the next window: between the first step and a
later evaluation the steps allocate what they free, so the live bytes a window starts from are
those of the pause.

Only with `--memory-profile`: the profiler slows every operator, so a normal run never starts it.
"""

from __future__ import annotations

import gc
from contextlib import AbstractContextManager

import torch
from torch.profiler import ProfilerActivity, profile


def peak_of_events(prof: profile, start: int = 0) -> tuple[int, int]:
    """(most bytes alive at once, bytes alive at the end) over the allocations `prof` saw (an
    allocation is +bytes, a free -bytes, in time order), from `start` bytes alive when it opened."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = start
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live


class PeakMeter(AbstractContextManager):
    """`with PeakMeter(device) as m: ...` then `m.peak_bytes`: the window's peak memory. Phases:
    `pause(phase)` folds the peak since the window opened (or resumed) into `phases[phase]`, and
    `resume()` opens the next window; `peak_bytes` is the most of every phase."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.phases: dict[str, int] = {}
        self._prof: profile | None = None
        self._open = False
        self._live = 0  # CPU: bytes alive when the window last closed

    @property
    def peak_bytes(self) -> int:
        return max(self.phases.values(), default=0)

    def __enter__(self) -> "PeakMeter":
        return self.resume()

    def resume(self) -> "PeakMeter":
        """Open the next window (a window still open goes on: a run resumed at its last step
        evaluates before any step closed the first)."""
        if self._open:
            return self
        # Garbage of what ran before (objects in reference cycles: torch's first checkpoint call
        # imports torch._dynamo, whose import leaves the calling frames, a run's model among their
        # locals, in a cycle) would be freed by the collector inside the window and counted there as
        # frees, below the window's own bytes: collect it first.
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        self._open = True
        return self

    def pause(self, phase: str) -> None:
        """Close the window, its peak counted as `phase`'s (the most of its windows)."""
        if not self._open:
            return
        self._open = False
        if self._prof is None:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._prof.__exit__(None, None, None)
            peak, self._live = peak_of_events(self._prof, self._live)
            self._prof = None
        self.phases[phase] = max(peak, self.phases.get(phase, 0))

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.pause("train")
        elif self._prof is not None:
            self._prof.__exit__(*exc)
            self._prof, self._open = None, False

