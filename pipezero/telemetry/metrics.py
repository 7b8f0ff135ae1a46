"""`metrics.jsonl` (one line a step, flushed as written) and the rich progress display."""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from pipezero.files import atomic_write_bytes

# Every field a metrics.jsonl record may hold, with what it means. The reference page of the run's
# files is generated from this table, and `MetricsLog.write` refuses a field missing from it, so the
# documentation cannot fall behind what the loop writes.
FIELDS: dict[str, str] = {
    "step": "the optimizer step this line is about, counted from 1 (across a resume too)",
    "loss": "the step's training loss in nats a target token; null when the step was skipped as non-finite",
    "lr": "the learning rate the step used (warm-up, then cosine decay)",
    "grad_norm": "the global gradient norm before clipping, over trainable tensors; null when non-finite",
    "tokens": "targets trained on so far, across a resume too; padding and ignored targets are not counted",
    "step_time_s": "wall-clock seconds of the step, its queued device work included",
    "tokens_per_s": "the step's counted targets over step_time_s",
    "bubble": "the writing rank's idle share of the step: time blocked on peers (CPU) or the GPU's idle time "
              "between compute actions (CUDA events)",
    "peak_rss_mib": "the writing rank's resident-memory high-water mark so far, MiB",
    "bytes_sent": "bytes the writing rank has sent so far, p2p and collectives, before this step's evaluation",
    "skipped": "present (true) when a non-finite loss or gradient norm skipped the step on every rank",
    "heldout_loss": "present on evaluation steps (every run.eval_every and the last): the held-out loss",
}
REQUIRED_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s")


def _records(text: str) -> list[dict[str, Any]]:
    """The complete step records of a log; a line a crash cut short (or any line that is not a step
    record) is dropped rather than blocking a resume."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


class MetricsLog:
    """Writes one JSON object a line, flushed at once so a crash loses at most the current step."""

    def __init__(self, path: Path, keep_steps: int = 0) -> None:
        """A new log, or with `keep_steps` (a resumed run) the old one's first `keep_steps` steps
        kept and the rest dropped: the lines of steps a crash made us run again appear once."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_steps and path.exists():
            kept = [r for r in _records(path.read_text()) if r["step"] <= keep_steps]
        # the running `tokens` total goes on from the kept log (None: the resumed step's line is gone)
        last = kept[-1] if kept and kept[-1]["step"] == keep_steps else {}
        self.tokens: int | None = last.get("tokens") if keep_steps else 0
        atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self._f = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_FIELDS if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}")
        undeclared = [k for k in record if k not in FIELDS]
        if undeclared:  # a field the reference page would not list
            raise ValueError(f"metrics record field {undeclared} is not declared in telemetry/metrics.py FIELDS")
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class StepProgress:
    """A rich progress bar with loss and tokens/s on a terminal, a plain line every 10% elsewhere,
    on stderr; without the bar (`bar` False: --no-progress) the run's lines go to stdout as a log, a
    plain line every step (`train --no-progress > run.log`), and stderr holds only what went wrong."""

    def __init__(self, total: int, start: int, enabled: bool, bar: bool = True) -> None:
        # a log line is never wrapped; paths and the sample are printed as written, never read as
        # rich markup ("[/x]" in an --out raised MarkupError) or emoji codes
        self.console = Console(stderr=bar, highlight=bar, soft_wrap=not bar, markup=False, emoji=False)
        self.enabled = enabled
        self.total = total
        self._every = max(1, total // 10) if bar else 1
        self._progress: Progress | None = None
        if enabled and bar and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                TimeRemainingColumn(), console=self.console,
            )
            self._task = self._progress.add_task("train", total=total, completed=start, loss=float("nan"), tps=0.0)

    def __enter__(self) -> "StepProgress":
        if self._progress:
            self._progress.start()
        return self

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._progress:
            self._progress.update(self._task, completed=step + 1, loss=loss, tps=tokens_per_s)
        elif self.enabled and ((step + 1) % self._every == 0 or step + 1 == self.total):
            self.console.print(f"step {step + 1}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s")

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._progress:
            self._progress.stop()
