"""--memory-profile's arithmetic (telemetry/memory_profile.py) without starting the profiler: a
window's peak counts from the bytes alive when it opened, so an evaluation measured after steps run
unprofiled stands on the state the first step left."""

from __future__ import annotations

from types import SimpleNamespace

from pipezero.telemetry.memory_profile import peak_of_events


class Event:
    def __init__(self, t: int, nbytes: int, name: str = "[memory]") -> None:
        self.t, self.n, self.label = t, nbytes, name

    def name(self) -> str:
        return self.label

    def start_ns(self) -> int:
        return self.t

    def nbytes(self) -> int:
        return self.n


def window(*events: Event) -> SimpleNamespace:
    return SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: list(events))))


def test_a_window_counts_from_what_was_alive_when_it_opened():
    # out of time order on purpose, and an operator event among them that is not an allocation
    first = window(Event(3, -40), Event(1, 100), Event(2, 50), Event(2, 7, "aten::mm"))
    assert peak_of_events(first) == (150, 110)
    # the next window frees what the first allocated before it allocates: the peak is not the rise alone
    assert peak_of_events(window(Event(1, -60), Event(2, 30)), start=110) == (110, 80)
    assert peak_of_events(window(Event(1, 30), Event(2, -60)), start=110) == (140, 80)
