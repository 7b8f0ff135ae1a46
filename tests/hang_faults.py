"""Faults injected into one rank of a P=2 D=2 run, for the hang doctor's tests (test_hang_doctor.py).

Each fault strikes rank FAULTY in step 2 (step 1 runs clean) and writes what it struck at to
OUT/fault.json, so the test knows the instruction the doctor must name:
- "stop": SIGSTOP itself just before posting its first send of the step (it never resumes; the
  test's spawner kills it once the others failed);
- "kill": SIGKILL itself inside its first wait for a gradient reduction (mid-collective);
- "skip": return from its first send of micro-batch 1 without posting it (a planted bug);
- "slow": every compute action takes three times as long, plus 0.3 s after each of its chunks'
  forward of micro-batch 0 (once a step; twice with zb-v's two chunks a rank): a straggler that
  catches up (no hang). The sleeps fall inside the compute instructions, so they count as the
  rank's own work (runtime/flight.py), as a slower device's compute would.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from pipezero.config import ScheduleKind as K

FAULTY = 1  # stage 0, replica 1: its pipeline peer is rank 3, its data-parallel peer rank 0
CASES = {"1f1b": (K.ONE_F_ONE_B, 0), "zb-v": (K.ZB_V, 0), "zero3": (K.ONE_F_ONE_B, 3)}


def _mark(out: str, **what: object) -> None:
    Path(out, "fault.json").write_text(json.dumps({"pid": os.getpid(), **what}))


def inject(fault: str, out: str) -> None:
    from pipezero.runtime.executor import Executor
    from pipezero.runtime.p2p import P2P, Payload
    from pipezero.zero.coordinator import Coordinator

    if fault in ("stop", "skip"):
        clean_send = P2P.send
        # A stopped process stops its transport threads too: a send it posted just before is then
        # lost as well (gloo moves the data once the receiver asks), so it stops at its first send
        # of the step, when no other is in flight; the planted bug skips one in the middle.
        strike_mb = 0 if fault == "stop" else 1

        def send(self, kind, consumer, mb, tensor):
            remote = self.rank_of_chunk[consumer] != self.rank
            if self.tracer.step == 2 and mb == strike_mb and remote and not Path(out, "fault.json").exists():
                _mark(out, transfer=[consumer, kind is Payload.GRAD, mb], peer=self.rank_of_chunk[consumer],
                      index=self.flight.index, instr=self.flight.instr)
                if fault == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                return
            clean_send(self, kind, consumer, mb, tensor)

        P2P.send = send
    elif fault == "kill":
        clean_wait = Coordinator.wait

        def wait(self, work, op, across=""):
            if self.tracer.step == 2 and op.startswith("REDUCE_GRAD"):
                _mark(out, op=op.split(":")[0], index=self.flight.index)
                os.kill(os.getpid(), signal.SIGKILL)
            clean_wait(self, work, op, across)

        Coordinator.wait = wait
    elif fault == "slow":
        clean_timed = Executor._timed

        def _timed(self, a):
            t0 = time.perf_counter()
            with clean_timed(self, a):
                yield
            # twice the action's own time more: a margin a loaded machine (which slows every rank's
            # compute alike) scales with it, where a fixed 0.3 s alone drowned in the others' slowness
            time.sleep((time.perf_counter() - t0) * 2 + (0.3 if a.mb == 0 and a.op.value == "F" else 0.0))

        from contextlib import contextmanager

        Executor._timed = contextmanager(_timed)


def short_waits_from_step_2(timeout_s: float) -> None:
    """Every wait of step 2 on is bounded by `timeout_s`: the run's own --timeout stays long, so
    start-up (ranks of a loaded machine reach their first collective seconds apart) cannot fail."""
    from pipezero.runtime.executor import Executor

    clean_run = Executor.run

    def run(self, *args, **kwargs):
        if self.tracer.step >= 2:
            self.p2p.timeout_s = self.hooks.comm.timeout_s = timeout_s
        return clean_run(self, *args, **kwargs)

    Executor.run = run


def faulty_run(rank: int, world: int, data: str, out: str, fault: str, case: str, injected: bool = False) -> str:
    """Train two steps of `case` at P=2 D=2 with `fault` on rank FAULTY (unless already `injected`);
    what this rank saw."""
    from pipezero.engine import train
    from pipezero.settings import build_config
    from training import tiny_overrides

    kind, zero = CASES[case]
    if not injected:
        short_waits_from_step_2(3.0)
        if rank == FAULTY:
            inject(fault, out)
    steps = 3 if fault == "slow" else 2
    overrides = tiny_overrides(data, out, 2, 2, kind, 4, **{
        "parallel.zero": zero, "parallel.timeout_s": 60.0, "parallel.stall_report_s": 0.2 if fault == "slow" else 0.5,
        "run.max_steps": steps, "run.eval_batches": 1})
    try:
        train(build_config(None, overrides))
        return "trained"
    except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
        return f"{type(e).__name__}: {e}"


def slow_cases(rank: int, world: int, data: str, out: str, cases: list[str]) -> list[str]:
    """`faulty_run` with rank FAULTY slow, for each case in one process group (a straggler ends)."""
    if rank == FAULTY:
        inject("slow", out)
    short_waits_from_step_2(3.0)
    return [faulty_run(rank, world, data, f"{out}/{case}", "slow", case, injected=True) for case in cases]
