"""`train --layout auto` settles near-ties by trial steps inside the job that trains.

The planner's step-time model is within its stated error (auto_check.TOLERANCE) of measured, and
its top layouts are often predicted within a percent or two of one another: among those, the
model's order is a coin toss. Peers settle it by launching candidate jobs; here the job's process
group already exists, and one process group trains layout after layout (tests/training.py does),
so the near-ties are measured where they will run. Every candidate predicted within `BAND` of the
chosen one (at most `--layout-trials K`, the chosen one first) trains `TRIAL_STEPS` steps of the
run's own data and seed (the first warms up and is not timed) in a scratch folder inside --out
(`SCRATCH`, removed afterwards, also on failure), saving, evaluating, sampling and logging nothing.
A candidate's step is the slowest rank's median (an all-reduce MAX, so every rank picks alike);
the fastest measured wins, a later one in the model's order only where it measured more than
`TIE` faster. The trials together stay within `BUDGET_SHARE` of the run's predicted time (the
chosen one's trial always runs). The real run then starts from step 0 as it would without trials.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipezero.planner.auto import MODELS_CHOICE, LayoutChoice
from pipezero.planner.auto_check import TOLERANCE

DEFAULT_TRIALS = 3  # candidates tried, the chosen one included (--layout-trials; 0: off)
BAND = TOLERANCE  # tried: predicted within the model's stated error of the chosen layout
TRIAL_STEPS = 3  # a trial's steps; the first pays one-off costs (allocation, warm-up) and is not timed
BUDGET_SHARE = 0.10  # the trials' time at most this share of --max-steps x the chosen layout's predicted step
TIE = 0.02  # a candidate later in the model's order wins only where it measured this much faster
SCRATCH = ".layout-trials"  # inside --out: on the run's own disk, removed afterwards
PICKED_BY_TRIALS = "measured fastest in trials"
PICKED_BY_MODEL = MODELS_CHOICE


@dataclass(frozen=True)
class Trial:
    """One candidate's trial: its flags and prediction, and the slowest rank's median step (None:
    it failed on some rank, `failed` says where and how)."""

    flags: str
    predicted_step_s: float
    trial_step_s: float | None
    failed: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"flags": self.flags, "predicted_step_s": self.predicted_step_s, "trial_step_s": self.trial_step_s}
        if self.failed:
            out["failed"] = self.failed
        return out


def candidates(ranked: list[dict[str, Any]], k: int, band: float = BAND) -> list[int]:
    """Which of `ranked` (the model's order, the chosen one first) to try: those predicted within
    `band` of the chosen one, at most `k`; none where fewer than two are (nothing to settle)."""
    if k < 2 or not ranked:
        return []
    best = ranked[0]["predicted_step_s"]
    near = [i for i, r in enumerate(ranked) if r["predicted_step_s"] <= best * (1 + band)][:k]
    return near if len(near) > 1 else []


def trial_budget_s(max_steps: int, predicted_step_s: float) -> float:
    """Seconds the trials may take: BUDGET_SHARE of the run the model predicts for the chosen layout."""
    return BUDGET_SHARE * max_steps * predicted_step_s


def room_for_another(spent_s: float, took_s: list[float], budget_s: float) -> bool:
    """Whether another trial fits the budget, each trial taken to cost the most one has so far (a
    trial is mostly its set-up and steps of about the same length: the candidates are near-ties)."""
    return spent_s + max(took_s, default=0.0) <= budget_s


def winner(trials: list[Trial]) -> int | None:
    """Index of the trial to train: the fastest measured, a later one only where it measured more
    than TIE faster than the best before it (ties keep the model's order); None where none ran."""
    best = None
    for i, t in enumerate(trials):
        if t.trial_step_s is None:
            continue
        if best is None or t.trial_step_s < trials[best].trial_step_s * (1 - TIE):  # type: ignore[operator]
            best = i
    return best


def settled(choice: LayoutChoice, tried: list[int], trials: list[Trial], cut: str | None) -> LayoutChoice:
    """`choice` with the trials' winner first (the rest in the model's order), the trials, why
    the winner was picked and the budget's line where it cut them short. Every figure of a ranked
    layout stays the model's: `predicted_step_s` is what the prediction check holds the run to."""
    best = winner(trials)
    measured = [t for t in trials if t.trial_step_s is not None]
    if best is None or len(measured) < 2:  # nothing compared: the model's order stands
        return replace(choice, trials=[t.to_json() for t in trials], picked_by=PICKED_BY_MODEL, trials_cut=cut)
    first = tried[best]
    ranked = [choice.ranked[first]] + [r for i, r in enumerate(choice.ranked) if i != first]
    return replace(choice, ranked=ranked, trials=[t.to_json() for t in trials], picked_by=PICKED_BY_TRIALS,
                   trials_cut=cut)


def cut_line(done: int, planned: int, spent_s: float, budget_s: float, max_steps: int, predicted_s: float) -> str:
    """The one line that says the budget stopped the trials."""
    return (f"layout trials cut short after {done} of {planned} candidates: {spent_s:.1f} s spent, another would "
            f"pass the budget of {budget_s:.1f} s ({BUDGET_SHARE:.0%} of --max-steps {max_steps} x the chosen "
            f"layout's predicted {predicted_s:.3g} s a step)")


def trial_lines(choice: LayoutChoice, seconds: float) -> list[str]:
    """What rank 0 prints after the trials: each candidate's prediction and trial, which was picked."""
    trials = choice.trials
    lines = [f"layout trials: {len(trials)} candidate{'s' * (len(trials) != 1)} predicted within {BAND:.0%} of the "
             f"chosen, {TRIAL_STEPS} steps each (the first untimed; a step is the slowest rank's median), "
             f"{seconds:.1f} s"]
    picked = choice.chosen["flags"]
    for t in trials:
        if t["trial_step_s"] is None:
            lines.append(f"  {t['flags']}: predicted {t['predicted_step_s']:.3g} s, dropped: {t['failed']}")
            continue
        tag = f"  <- picked: {choice.picked_by}" if t["flags"] == picked else ""
        lines.append(f"  {t['flags']}: predicted {t['predicted_step_s']:.3g} s, trial {t['trial_step_s']:.3g} s{tag}")
    if choice.picked_by == PICKED_BY_MODEL:
        lines.append(f"  training the model's choice, {picked}: fewer than two candidates were measured")
    if choice.trials_cut:
        lines.append(choice.trials_cut)
    return lines
