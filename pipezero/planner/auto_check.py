"""`--layout auto` checks its own prediction: after the first measured steps the run compares the
chosen layout's predicted step time and peak memory with what it measured, keeps both for
summary.json (`layout_choice`), and warns in one line where they differ by more than `TOLERANCE`,
naming the term that differs most.

The terms: the prediction splits a step into compute (the busy share of the schedule) and waiting
(the bubble and the data-parallel traffic compute does not hide); a run measures each rank's share
blocked on its peers (the metrics' `bubble`), so the measured step splits the same way. The first
step pays one-off costs (allocation, warm-up) and is left out. Memory is measured only with
--memory-profile (or on GPUs, the allocator's peak): the prediction is the heaviest rank's, held
against the most any rank measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from pipezero.planner.auto import MODELS_CHOICE

TOLERANCE = 0.15  # the step-time model's accuracy on the emulated cluster (docs/explanation/network.md)
CHECK_STEPS = 5  # steps after the first the comparison waits for (fewer where the run is shorter)


def off_by(predicted: float, measured: float) -> float:
    """measured / predicted - 1 (0 where nothing was predicted)."""
    return measured / predicted - 1 if predicted > 0 else 0.0


def compare(chosen: dict[str, Any], step_s: float, bubble: float, peak_gib: float | None) -> tuple[dict, str | None]:
    """(the figures summary.json keeps, the one-line warning or None): the chosen layout's prediction
    (auto.describe_estimate) against a measured step time, its blocked share and peak GiB."""
    terms = {"compute": (chosen["predicted_compute_s"], step_s * (1 - bubble)),
             "bubble and exposed communication": (chosen["predicted_idle_s"], step_s * bubble)}
    figures = {"predicted_step_s": chosen["predicted_step_s"], "measured_step_s": step_s,
               "predicted_peak_gib": chosen["predicted_peak_gib"], "measured_peak_gib": peak_gib,
               "terms_s": {k: {"predicted": p, "measured": m} for k, (p, m) in terms.items()}}
    said = []
    step_off = off_by(chosen["predicted_step_s"], step_s)
    if abs(step_off) > TOLERANCE:
        worst = max(terms, key=lambda k: abs(terms[k][1] - terms[k][0]))
        p, m = terms[worst]
        said.append(f"step time {step_s:.3g} s measured, {chosen['predicted_step_s']:.3g} s predicted "
                    f"({step_off:+.0%}), most in {worst} ({m:.3g} s measured, {p:.3g} s predicted)")
    if peak_gib is not None and abs(mem_off := off_by(chosen["predicted_peak_gib"], peak_gib)) > TOLERANCE:
        said.append(f"peak memory {peak_gib:.3g} GiB measured, {chosen['predicted_peak_gib']:.3g} GiB predicted "
                    f"({mem_off:+.0%})")
    warning = None
    if said:
        warning = (f"--layout auto's prediction is off by more than {TOLERANCE:.0%}: " + "; ".join(said)
                   + "; the choice may not be the fastest (summary.json layout_choice has both)")
    return figures, warning


@dataclass
class LayoutCheck:
    """Rank 0's running comparison (engine.py feeds it each step's record)."""

    choice: dict[str, Any]  # auto.LayoutChoice.to_json()
    steps: list[float] = field(default_factory=list)
    bubbles: list[float] = field(default_factory=list)
    said: str | None = None  # the step-time warning, once
    done: bool = False

    def observe(self, record: dict[str, Any], first: bool, last: bool) -> str | None:
        """Keep a step's time and blocked share (not the first step's); the warning line, once, when
        CHECK_STEPS steps are in (or at the last step)."""
        if self.done:
            return None
        if not first:
            self.steps.append(record["step_time_s"])
            self.bubbles.append(record["bubble"])
        if (len(self.steps) >= CHECK_STEPS or last) and self.steps:
            self.done = True
            _, self.said = compare(self.choice["ranked"][0], *self.measured(), None)
            return self.said
        return None

    def measured(self) -> tuple[float, float]:
        """(median step seconds, mean blocked share) of the steps kept."""
        return statistics.median(self.steps), sum(self.bubbles) / len(self.bubbles)

    def summary(self, peak_gib: float | None) -> tuple[dict[str, Any], str | None]:
        """summary.json's `layout_choice` and a memory warning not said before (the step time's was)."""
        chosen = self.choice["ranked"][0]
        step_s, bubble = self.measured() if self.steps else (float("nan"), 0.0)
        figures, warning = compare(chosen, step_s, bubble, peak_gib)
        memory_warning = None
        if peak_gib is not None:
            _, memory_warning = compare({**chosen, "predicted_step_s": step_s}, step_s, bubble, peak_gib)
        out = {"flags": chosen["flags"], **figures, "steps_measured": len(self.steps),
               "bubble": {"predicted": chosen["bubble"], "measured": bubble},
               "runners_up": [{k: r[k] for k in ("flags", "predicted_step_s", "predicted_peak_gib", "bubble",
                                                 "exposed_comm_s")} for r in self.choice["ranked"][1:]],
               "search": {k: self.choice[k] for k in ("fitting", "weighed", "skipped", "seconds")},
               "costs": self.choice["costs"], "warning": warning,
               # the trial steps that settled near-ties (planner/auto_trials.py), and why `flags` was trained
               "trials": self.choice.get("trials", []), "picked_by": self.choice.get("picked_by", MODELS_CHOICE),
               "trials_cut": self.choice.get("trials_cut")}
        return out, memory_warning


def summary_entry(check: LayoutCheck | None, per_rank: list[dict[str, Any]]) -> dict[str, Any] | None:
    """summary.json's `layout_choice` (None without --layout auto), the measured peak the most any
    rank measured (--memory-profile; on GPUs, the allocator's peak of the training steps); a memory
    warning is printed here, where every rank's peak is known."""
    if check is None:
        return None
    import sys

    measured = [x["measured_peak_bytes"] for x in per_rank]
    if any(m is None for m in measured):
        measured = [x["peak_device_bytes"]["train"]["allocated"] for x in per_rank
                    if "train" in x.get("peak_device_bytes", {})]
    peak = max(measured) / 2**30 if measured and len(measured) == len(per_rank) else None
    out, warning = check.summary(peak)
    if warning:
        print(f"pipezero: warning: {warning}", file=sys.stderr, flush=True)
    return out
