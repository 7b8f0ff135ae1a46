"""How much of a bucketed collective hides behind the compute beside it, as the runtime orders them.

Two shapes occur (zero/sharded.py, zero/coordinator.py):

- **Reduction during a backward.** Autograd fills the gradient buckets one after another over the
  backward; each bucket's all-reduce or reduce-scatter starts as soon as it is full and the link has
  finished the one before. What is left of the transfers after the backward ends is exposed. At
  ZeRO-2/3 the backward also waits whenever more than `in_flight` reductions are outstanding
  (bounding the full-gradient buckets alive at once), which stalls compute itself.
- **Gathers before a forward.** After the optimizer step (ZeRO-1/2) every bucket's all-gather of
  updated weights starts at once, in forward order, and each layer waits only for its own bucket
  (the program's WAIT at the `fwd` of the first layer reading it: schedules/lowering.py
  `update_waits`): the forward runs as far as the gathers have come.

With k even buckets, c = C/k on the link and dt = T/k of compute each, both come to the same
exposed time, max(c, C - T(1 - 1/k)): the last bucket's transfer when the link keeps up, else the
link's time less what compute covered. The in-flight bound moves part of it into the backward
without adding any: the backward ends when bucket k - n has gone, at dt + (k - n)c. These closed
forms are those of playing the buckets one by one (tests/test_planner.py checks both).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reduced:
    stall_s: float  # compute delayed inside the backward by the in-flight bound
    tail_s: float  # transfers still running when the (delayed) backward ends

    @property
    def exposed_s(self) -> float:
        return self.stall_s + self.tail_s


def _exposed(comm_s: float, window_s: float, k: int) -> float:
    return max(comm_s / k, comm_s - window_s * (1 - 1 / k))


def reduce_during(comm_s: float, window_s: float, buckets: int, in_flight: int | None = None) -> Reduced:
    """A backward of `window_s` fills `buckets` buckets evenly; reducing all of them takes `comm_s`
    on the link. `in_flight`: after starting a bucket's reduction the backward goes on only once at
    most that many are outstanding (None: unbounded)."""
    k = max(1, buckets)
    stall = 0.0 if in_flight is None else max(0.0, ((k - in_flight) * comm_s - (k - 1) * window_s) / k)
    return Reduced(stall, _exposed(comm_s, window_s, k) - stall)


def gather_before(comm_s: float, window_s: float, buckets: int) -> float:
    """Seconds a forward of `window_s` is delayed by waiting, bucket by bucket in forward order, on
    all-gathers started together at its beginning that take `comm_s` in all."""
    return _exposed(comm_s, window_s, max(1, buckets))
