"""Each rank's watchdog: writes its flight record to the run folder when the hang doctor needs it.

A rank blocked in a wait cannot speak for itself (its thread is inside gloo or NCCL, and Python
signal handlers run only between bytecodes of the main thread), so a daemon thread looks at the
rank's flight record a few times a second and writes it, by temp file and rename, to
`RUN/doctor/rank-NNNNN.json` when
- a wait has lasted past the stall threshold (`--stall-report`; then it asks every rank for theirs),
- a wait failed (a timeout, a peer gone: written at once from the failing thread, then it asks),
- a stalled wait ended after all (a straggler: the record says `resumed`),
- a report was asked for: `RUN/doctor/request` holds a newer time than the last answered (written by
  a stalled rank, a failing rank, the launcher on SIGUSR1, or any rank on SIGUSR1: see `Bell`).
Rank 0 under an outside launcher (torchrun, srun) also gathers the records and prints the doctor's
report (doctor.py); under pipezero's own launcher the launcher does (job.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pipezero.doctor import FOLDER, REQUEST, report
from pipezero.flight_files import RecordError, load_records, plan_path, read_json, record_path
from pipezero.runtime.flight import FlightRecord
from pipezero.files import atomic_write_bytes, atomic_write_json

SETTLE_S = 1.5  # after a request, how long a gatherer waits for every rank's answer before printing


def ask(out: str | Path) -> float:
    """Ask every rank of the run in `out` for its record; the request's time."""
    now = time.time()
    atomic_write_bytes(Path(out) / FOLDER / REQUEST, f"{now!r}\n".encode())
    return now


def asked(out: str | Path) -> float:
    """When a report was last asked for; 0 when never, or when the request is not a plain file of
    a number (read without waiting on a pipe or following a link: every tick reads it)."""
    try:
        when = read_json(Path(out) / FOLDER / REQUEST, max_bytes=64)
    except RecordError:
        return 0.0
    return float(when) if type(when) in (int, float) else 0.0


class Desk:
    """Gathers the records after each request and prints the report once (launcher, or rank 0)."""

    def __init__(self, out: str | Path, world: int, since: float | None = None) -> None:
        self.out, self.world = Path(out), world
        self.printed = time.time() if since is None else since  # requests before this are another run's

    def poll(self) -> str | None:
        """The report, once per request: when every rank answered it, or SETTLE_S after it."""
        req = asked(self.out)
        if req <= self.printed:
            return None
        try:
            answered = [r for r in load_records(self.out).values() if r["written"] >= req - SETTLE_S]
        except RecordError:  # said once, by the report below, when the request settles
            answered = []
        if len(answered) < self.world and time.time() - req < SETTLE_S:
            return None
        self.printed = req
        return self._report()

    def _report(self) -> str | None:
        """The report, or the line naming a file under RUN/doctor that is not a rank's record (one
        planted or damaged there must not stop the launcher that watches the ranks)."""
        try:
            return report(self.out)
        except RecordError as e:
            return f"pipezero doctor: {e}"

    def final(self) -> str | None:
        """At the job's end: the report of records newer than the last printed (a failed job whose
        ranks wrote their records, and died before a request could settle)."""
        try:
            records = load_records(self.out)
        except RecordError as e:
            return f"pipezero doctor: {e}"
        if not records or max(r["written"] for r in records.values()) <= self.printed:
            return None
        self.printed = time.time()
        return self._report()


class Bell:
    """SIGUSR1 ("where is everyone") heard by the watchdog thread, whatever the main thread does.

    By default SIGUSR1 ends a process (exit 138): every rank that pipezero's launcher did not start
    (one process, srun's tasks, an outside torchrun's workers) died of the question. A Python handler
    alone runs only between bytecodes of the main thread, so a rank blocked in a wait (the very rank
    the question is for) would answer only after it; the interpreter's wakeup descriptor is written by
    the C-level handler at once, from any thread, and the watchdog reads it on its next tick. Installed
    from the main thread only (where Python allows it), for as long as the watchdog runs."""

    def __init__(self) -> None:
        self._pipe: tuple[int, int] | None = None
        self._saved: tuple[int, Callable[..., object] | int | None] | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # a rank run inside a thread (tests): signals are its host's business
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r), os.close(w)
            return
        if old_fd != -1:  # the host process listens there itself (an event loop): leave it to it
            signal.set_wakeup_fd(old_fd)
            os.close(r), os.close(w)
            return
        self._pipe = (r, w)
        self._saved = (old_fd, signal.signal(signal.SIGUSR1, _heard))

    def rang(self) -> bool:
        """Whether SIGUSR1 arrived since the last look (other signals' bytes are dropped: nothing
        else reads this descriptor)."""
        if self._pipe is None:
            return False
        heard = b""
        try:
            while chunk := os.read(self._pipe[0], 512):
                heard += chunk
        except BlockingIOError:
            pass
        return signal.SIGUSR1 in heard

    def remove(self) -> None:
        if self._pipe is None or self._saved is None:
            return
        old_fd, handler = self._saved
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGUSR1, handler if handler is not None else signal.SIG_DFL)
        for fd in self._pipe:
            os.close(fd)
        self._pipe = self._saved = None


def _heard(signum: int, frame: object) -> None:
    """SIGUSR1's Python handler: nothing to do in the main thread, the watchdog answers (`Bell`)."""


def _too_early(signum: int, frame: object) -> None:
    print("pipezero: SIGUSR1 (the hang doctor's request) while this process trains no step (starting up or "
          "finishing): nothing to report; ask again while it trains", file=sys.stderr, flush=True)


@contextlib.contextmanager
def early_requests(active: bool = True) -> Iterator[None]:
    """SIGUSR1 before a rank's watchdog runs (its imports, the corpus, the process group), or to a
    launcher before its job starts, is answered with a line instead of ending the process; the
    watchdog's `Bell` and the launcher's own handler take over while they run."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGUSR1, _too_early)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def relaying_requests(out: str | Path) -> Iterator[None]:
    """For a process that starts ranks elsewhere (`pipezero cluster`'s nodes): SIGUSR1 asks every rank
    of the run in `out` for its record, as the `--nproc` launcher's does (job.py), instead of ending
    the process, and with it the teardown of what it started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGUSR1, lambda *_: ask(out))
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous if previous is not None else signal.SIG_DFL)


class Watch:
    """The watchdog thread of one rank (`start`, then `stop` at the end of the run)."""

    def __init__(self, flight: FlightRecord, out: str | Path, stall_s: float, plan: dict[str, Any],
                 run: str | None, desk: Desk | None = None) -> None:
        self.flight, self.out, self.stall_s = flight, Path(out), stall_s
        self.plan, self.run, self.desk = plan, run, desk
        self.tick = min(0.5, max(0.05, stall_s / 4))
        self._answered = time.time()  # requests older than the run are not for it
        self._stalled = 0.0  # `awaited_since` of the wait last reported as stalled
        self._resumed = 0.0
        self._failed_at = False  # after a failed wait the record stays as it was then
        self._wrote = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"pipezero-watch-{flight.rank}", daemon=True)
        self.bell = Bell()
        flight.on_failure = self._failed

    def start(self) -> Watch:
        self.bell.install()
        self._thread.start()
        return self

    def stop(self, finished: bool = True) -> None:
        """End the thread; a rank that `finished` its run and wrote records says so (the last record
        is then not a stale wait, and `pipezero doctor` on the finished run finds no hang)."""
        self._stop.set()
        self._thread.join()
        self.bell.remove()
        self.flight.on_failure = None
        if finished and self._wrote and not self._failed_at:
            self.write("finished")

    def write(self, state: str) -> None:
        rec = self.flight.snapshot(state)
        rec.update(run=self.run)
        with self._lock:
            if not self._wrote:  # the plan once a run, before any record that needs it (flight_files.py)
                plan = plan_path(self.out, self.run)
                if not plan.is_file():  # ranks that race write the same plan: either rename wins
                    atomic_write_json(plan, self.plan)
            atomic_write_json(record_path(self.out, self.flight.rank), rec)
            self._wrote = True

    def _failed(self) -> None:
        self._failed_at = True
        self.write("failed")
        self._answered = ask(self.out)

    def check(self) -> None:
        """One look at the record (the thread's tick; tests call it directly)."""
        f = self.flight
        if self._failed_at:
            return
        since = f.awaited_since if f.awaited else 0.0
        if since and since != self._stalled and time.time() - since >= self.stall_s:
            self._stalled = since
            self.write("stalled")
            self._answered = ask(self.out)
        elif self._stalled and self._stalled != self._resumed and since != self._stalled:
            self._resumed = self._stalled  # the stalled wait ended: a straggler, not a hang
            self.write("resumed")
        if self.bell.rang():  # asked of this rank: every rank of the run answers, as the launcher's asking
            ask(self.out)
        req = asked(self.out)
        if req > self._answered:
            self._answered = req
            self.write("asked")
        if self.desk is not None and (text := self.desk.poll()):
            print(text, file=sys.stderr, flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                self.check()
            except OSError as e:  # a full disk or a removed folder must not kill the rank's training
                print(f"pipezero: rank {self.flight.rank}: hang doctor record not written ({e})", file=sys.stderr)


def plan_facts(cfg: Any, stage: Any) -> dict[str, Any]:
    """What the doctor needs to compile every rank's program in one process (doctor.programs): the
    layout and the model's shapes the run compiled its plan from (schedules/compile.py)."""
    p = cfg.parallel
    return {"schedule": p.schedule.value, "pp": p.pp, "dp": p.dp, "microbatches": p.microbatches,
            "virtual_stages": p.virtual_stages, "zero": p.zero, "grad_reduce": p.grad_reduce.value,
            "bucket_mb": p.bucket_mb, "zero3_keep_gathered": p.zero3_keep_gathered, "recompute": p.recompute,
            "zero3_prefetch": stage.plan.depth, "zero3_unit": p.zero3_unit.value,
            "placement": p.placement.value, "model": stage.plan.model.to_json()}


def start_watch(cfg: Any, stage: Any, out: str | Path | None = None) -> Watch:
    """The rank's watchdog, started; rank 0 also prints reports unless pipezero's launcher does.
    `out`: the run folder whose doctor/ it answers (None: the run's --out; a layout trial's: the run's
    it belongs to, where the launcher's SIGUSR1 asks and `pipezero doctor RUN` reads)."""
    from pipezero.rundir import HELD_BY_LAUNCHER, run_id

    p, out = cfg.parallel, cfg.run.out if out is None else out
    stall = p.stall_report_s if p.stall_report_s is not None else p.timeout_s / 4
    lead = stage.mesh.rank == 0 and not os.environ.get(HELD_BY_LAUNCHER)
    return Watch(stage.executor.flight, out, stall, plan_facts(cfg, stage), run_id(out),
                 Desk(out, p.world_size) if lead else None).start()
