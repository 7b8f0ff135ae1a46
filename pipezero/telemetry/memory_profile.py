"""Measure a rank's peak memory over its first training step, to hold the memory model
(sim/memory.py) against: on CUDA the caching allocator's peak of allocated bytes; on CPU the most
bytes of tensors alive at once, summed from the profiler's memory events (every allocation and free
of torch's CPU allocator on the threads it follows: the main thread, autograd's and gloo's workers).

Resident memory would not do on CPU: it moves with malloc's arenas, the interpreter and other jobs
by more than a small model's state. The events also count what only a collective holds (a
reduction's wire copy), which no walk over Python's objects would find. The window opens before
the rank builds its model, so parameters, buckets and AdamW's state are counted from nothing; the
corpus loaded before it is not (it is no part of a layout's memory).

Only with `--memory-profile`: the profiler slows every operator, so a normal run never starts it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch.profiler import ProfilerActivity, profile


def peak_of_events(prof: profile) -> int:
    """Most bytes alive at once among the allocations `prof` saw (an allocation is +bytes, a free
    -bytes, in time order); frees of what was allocated before the window are not counted below 0."""
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


class PeakMeter(AbstractContextManager):
    """`with PeakMeter(device) as m: ...` then `m.peak_bytes`: the window's peak memory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak_bytes = 0
        self._prof: profile | None = None

    def __enter__(self) -> "PeakMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prof is None:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.peak_bytes = peak_of_events(self._prof)
        self._prof = None

