"""Where a rank is in its program, kept in constant memory, for the hang doctor (doctor.py).

The executor marks each instruction as it starts (`begin`: index, kind, chunk, micro-batch, peer,
start time); the waits on peers (runtime/p2p.py, zero/coordinator.py) say what they block on and
since when (`awaiting`). Finished instructions go into a fixed ring of the last `keep`, so a record
costs the same on step 1 and step 100,000. Nothing here talks to other ranks: a record is read by
the watchdog thread (`watch.py`), which writes it to the run folder when a wait stalls or a report
is asked for, while the rank's own thread is blocked in the wait.

What the doctor needs beyond "where": the sends a rank really posted to each peer this step
(`sent`), and the first SEND instruction that ended without posting anything (`unposted`): a
program that passed a SEND its peer never got is told apart from a link that lost it. And, for
stragglers (doctor.stragglers), two sums: the seconds this rank waited on each peer (p2p) and in
collectives over the run, and the seconds of its own work over the steps after the first: its
compute instructions (F, B, W, BW) less the waits inside them (a forward's receive of its input, a
backward's gathers and reductions).
Waits say who waited, not for whom (a rank fed late by a slow peer passes the delay on and looks as
guilty as it); own work says who was slow, and every rank of a stage has the same work to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Finished = tuple[int, int, Any, float, float]  # (step, index, instruction, start, end), wall-clock


def describe(ins: Any) -> tuple[str, int, int, int]:
    """(kind, chunk, micro-batch, peer) of a program instruction (schedules/program.py), or of the
    text naming where a rank is outside its program; -1: none."""
    if isinstance(ins, str):
        return "", -1, -1, -1
    kind = ins.kind.value
    if hasattr(ins, "action"):  # Compute
        return kind, ins.action.chunk, ins.action.mb, -1
    if hasattr(ins, "transfer"):  # PointToPoint
        chunk, _, mb = ins.transfer
        return kind, chunk, mb, ins.peer
    return kind, getattr(ins, "chunk", -1), -1, -1  # DataParallel, OptimStep


class FlightRecord:
    """One rank's place in its program. Written by the rank's thread, read (a snapshot, possibly a
    field or two apart) by its watchdog thread: every field is a plain value, replaced whole."""

    def __init__(self, rank: int, stage: int, keep: int = 16, step_of: Any = None) -> None:
        self.rank, self.stage = rank, stage
        self._step_of = step_of  # the tracer (its `step` is the run's one step counter), or None
        self.index = -1  # instruction under way; -1: outside the program (evaluation, checkpoint, start)
        # The instruction itself (or the text naming where the rank is outside its program): kept by
        # reference, turned into text and fields only when a record is written.
        self.ins: Any = "start"
        self.nbytes = 0  # bytes this instruction put on the wire so far
        self.started = time.time()
        self.awaited: dict[str, Any] | None = None  # what the rank blocks on now (see `awaiting`)
        self.awaited_since = 0.0
        self.sent: dict[int, int] = {}  # peer -> sends posted to it this step
        self.unposted = -1  # first SEND of the step that ended with nothing posted
        self.waited_on: dict[int, float] = {}  # peer -> seconds blocked on its p2p transfers (run)
        self.collective_wait_s = 0.0  # seconds blocked in data-parallel collectives (run)
        self.world_wait_s = 0.0  # seconds blocked in the optimizer step's all-reduce over the world (run)
        # Seconds in compute instructions less the waits inside them, over the steps after the first
        # this process played (the first warms up allocators and caches unevenly), and in that first.
        self.own_work_s, self.own_steps, self.first_work_s = 0.0, 0, 0.0
        self._work_steps: tuple[int, int] | None = None  # (first step with own work, latest)
        self._t0 = time.perf_counter()  # start of the instruction under way, for own_work_s
        self._waited = 0.0  # seconds blocked so far inside the instruction under way
        self.failure = ""  # the error a wait ended with; the record then stays as it was at that wait
        self.on_failure: Callable[[], None] | None = None  # the watchdog's: write the record at once
        self._ring: list[Finished | None] = [None] * keep
        self._n = 0  # instructions finished so far (the ring's write position is _n % keep)

    @property
    def instr(self) -> str:
        """The instruction under way as the program prints it (`1F3`, `SEND(act 1:3 to 2)`)."""
        return str(self.ins)

    @property
    def step(self) -> int:
        return int(getattr(self._step_of, "step", 0))

    def begin(self, index: int, ins: Any) -> None:
        """Instruction `index` of the program starts (the previous one, if any, is finished)."""
        self.finish()
        self.index, self.ins = index, ins
        self.nbytes, self.started = 0, time.time()
        self._t0, self._waited = time.perf_counter(), 0.0
        if index == 0:
            self.sent, self.unposted = {}, -1

    def outside(self, what: str) -> None:
        """The rank leaves its program for `what` (evaluation, a checkpoint, the end of the run)."""
        self.finish()
        self.index, self.ins = -1, what
        self.started = time.time()

    def finish(self) -> None:
        if self.index < 0:
            return
        if self.nbytes == 0 and self.unposted < 0 and getattr(self.ins, "send", False):
            self.unposted = self.index
        if hasattr(self.ins, "action"):  # Compute: F, B, W or BW
            self._worked(max(0.0, time.perf_counter() - self._t0 - self._waited))
        self._ring[self._n % len(self._ring)] = (self.step, self.index, self.ins, self.started, time.time())
        self._n += 1
        self.index = -1

    def _worked(self, seconds: float) -> None:
        step = self.step
        first, latest = self._work_steps or (step, step)
        if step == first:
            self.first_work_s += seconds
        else:
            self.own_steps += step != latest
            self.own_work_s += seconds
        self._work_steps = first, step

    def work(self) -> dict[str, float]:
        """Own work a step, as seconds over steps (those after the first when there are any), for the
        straggler in summary.json (doctor.stragglers)."""
        if self.own_steps:
            return {"own_s": self.own_work_s, "steps": self.own_steps}
        return {"own_s": self.first_work_s, "steps": 1 if self._work_steps else 0}

    def posted(self, peer: int, nbytes: int) -> None:
        """A send of `nbytes` to `peer` was posted (runtime/p2p.py)."""
        self.nbytes += nbytes
        self.sent[peer] = self.sent.get(peer, 0) + 1

    @contextmanager
    def awaiting(self, what: str, **awaited: Any) -> Iterator[None]:
        """The rank blocks on a peer. `awaited` says on what, in the plan's terms: op (RECV, SEND,
        REDUCE_GRAD, UNSHARD, OPTIM_STEP, or another word for waits outside the program), and peer
        and transfer (chunk, is a gradient, micro-batch) for p2p, chunk and bucket for collectives."""
        self.awaited, self.awaited_since = {"what": what, **awaited}, time.time()
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:
            self.failure = str(e)
            if self.on_failure is not None:  # the rank is about to stop: no later tick would see it
                self.on_failure()
            raise
        finally:
            took = time.perf_counter() - t0
            self._waited += took
            peer, op = awaited.get("peer"), awaited.get("op")
            if op in ("RECV", "SEND") and peer is not None:
                self.waited_on[peer] = self.waited_on.get(peer, 0.0) + took
            elif op == "OPTIM_STEP":
                self.world_wait_s += took
            elif op in ("REDUCE_GRAD", "UNSHARD"):
                self.collective_wait_s += took
            self.awaited = None

    def recent(self) -> list[Finished]:
        """The finished instructions in the ring, oldest first."""
        keep = len(self._ring)
        order = range(self._n - keep, self._n) if self._n > keep else range(self._n)
        return [e for e in (self._ring[i % keep] for i in order) if e is not None]

    def snapshot(self, state: str) -> dict[str, Any]:
        """The record as JSON-ready data; `state`: why it is written (stalled, failed, asked, ...)."""
        now = time.time()
        kind, chunk, mb, peer = describe(self.ins)
        return {"rank": self.rank, "stage": self.stage, "state": state, "step": self.step, "written": now,
                "index": self.index, "instr": self.instr, "kind": kind, "chunk": chunk, "mb": mb,
                "peer": peer, "nbytes": self.nbytes, "started": self.started,
                "awaited": dict(self.awaited) if self.awaited else None,
                "waited_s": now - self.awaited_since if self.awaited else 0.0, "failure": self.failure,
                "sent": {str(k): v for k, v in self.sent.items()}, "unposted": self.unposted,
                "recent": [[step, i, str(ins), t0, t1] for step, i, ins, t0, t1 in self.recent()]}

    def waits(self) -> dict[str, Any]:
        """Seconds blocked, for summary.json (own work, for the straggler, is `work`)."""
        return {"p2p": {str(k): v for k, v in self.waited_on.items()}, "collectives": self.collective_wait_s,
                "world": self.world_wait_s}
