"""Which layouts `train --layout auto`'s trials try, in what rounds, and which wins (torch-free;
the trials themselves run in planner/auto_trials.py).

The candidates are the layouts predicted within `BAND` of the chosen one, another shape (P, D,
schedule, V) before a sibling that differs only in its micro-batching (`candidates`). A trial
trains `TRIAL_STEPS` steps, the first untimed; its figure is the slowest rank's median. Two timed
steps of one trial are not a layout's steady step: on a shared host a step moves by 20-30% from
one to the next and the host's load by more over the seconds the trials take
(bench/trial_drift.py), so trials run one after another compare different minutes. So the trials
go in rounds: every candidate once, then, while a whole round fits the budget, those measured
within `RUNOFF` of the round's fastest again, each round in the reverse order of the one before
(`runoff`; at most `MAX_ROUNDS`), so that drift falls on the finalists alike. A candidate's figure
is the median of its rounds; the fastest of the last round's wins, a later one in the model's
order only where it measured more than `TIE` faster (`winner`). The trials together stay within
`BUDGET_SHARE` of the run's predicted time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Any

from pipezero.planner.auto import MODELS_CHOICE, LayoutChoice
from pipezero.planner.auto_check import TOLERANCE

BAND = TOLERANCE  # tried: predicted within the model's stated error of the chosen layout
# A trial's steps; the first pays one-off costs (allocation, warm-up) and is not timed. Over 35 runs
# of 6 steps on the emulated cluster on a quiet host (bench/results/layout_auto_cluster/
# layout_auto_cluster_trials.json), the median of steps 2-3 over the run's steady step (steps 5-6)
# was 0.80-1.23 (10th-90th percentile), of steps 2-4 0.84-1.17, the least of 3-4 0.76-1.05: the
# noise is each step's, so a longer window buys little and another round, in other minutes, more.
TRIAL_STEPS = 3
# Tried again in the next round: measured within this of the round's fastest. One trial's figure is
# within 0.80-1.23 of its layout's steady step (TRIAL_STEPS, above): two layouts that tie at steady
# state may stand 25% apart in a round, and the next round, in other minutes, may reverse them.
RUNOFF = 0.25
MAX_ROUNDS = 3  # rounds at most: the first of every candidate, then two of the finalists
BUDGET_SHARE = 0.10  # the trials' time at most this share of --max-steps x the chosen layout's predicted step
TIE = 0.02  # a candidate later in the model's order wins only where it measured this much faster
PICKED_BY_TRIALS = "measured fastest in trials"
PICKED_BY_MODEL = MODELS_CHOICE


@dataclass(frozen=True)
class Trial:
    """One candidate's trials: its flags and prediction, the median of its rounds (None: it failed
    on some rank, `failed` says where and how) and each round's figure (the slowest rank's median
    step)."""

    flags: str
    predicted_step_s: float
    trial_step_s: float | None
    failed: str | None = None
    rounds_s: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"flags": self.flags, "predicted_step_s": self.predicted_step_s,
                               "trial_step_s": self.trial_step_s}
        if self.rounds_s:
            out["rounds_s"] = list(self.rounds_s)
        if self.failed:
            out["failed"] = self.failed
        return out


def shape_of(ranked: dict[str, Any]) -> tuple[Any, ...]:
    """A layout's shape less its micro-batching: P, D, schedule and V (its settings)."""
    s = ranked.get("settings", {})
    return tuple(s.get(f"parallel.{k}") for k in ("pp", "dp", "schedule", "virtual_stages"))


def candidates(ranked: list[dict[str, Any]], k: int, band: float = BAND) -> list[int]:
    """Which of `ranked` (the model's order, the chosen one first) to try, in the model's order:
    those predicted within `band` of the chosen one, at most `k`, a shape not yet taken before a
    sibling of one taken (on the emulated cluster at 100 Mbit and 1 Gbit, gpipe siblings that differ
    only in M and B measured 2% and 9% apart, zb-h2 and gpipe of the same P 39% and 70%, where the
    model had them within 6%: its error is mostly a shape's);
    none where fewer than two are near (nothing to settle)."""
    if k < 2 or not ranked:
        return []
    best = ranked[0]["predicted_step_s"]
    near = [i for i, r in enumerate(ranked) if r["predicted_step_s"] <= best * (1 + band)]
    if len(near) < 2:
        return []
    seen: set[tuple[Any, ...]] = set()
    new = []
    for i in near:
        if shape_of(ranked[i]) not in seen:
            seen.add(shape_of(ranked[i]))
            new.append(i)
    picked = set((new + [i for i in near if i not in new])[:k])
    return [i for i in near if i in picked]


def runoff(figures: dict[int, list[float]], order: list[int]) -> list[int]:
    """The next round's order: those of `order` (the last round's) still measured (`figures`: each
    one's rounds so far) whose last round is within RUNOFF of that round's fastest, in reverse;
    none where fewer than two are (nothing left to settle)."""
    ran = [n for n in order if n in figures]
    if not ran:
        return []
    best = min(figures[n][-1] for n in ran)
    near = [n for n in reversed(ran) if figures[n][-1] <= best * (1 + RUNOFF)]
    return near if len(near) > 1 else []


def figures(rounds: dict[int, list[Trial]]) -> dict[int, list[float]]:
    """Each candidate's figure of every round, for those measured in every round they ran."""
    out: dict[int, list[float]] = {}
    for n, ts in rounds.items():
        got = [t.trial_step_s for t in ts if t.trial_step_s is not None]
        if len(got) == len(ts):
            out[n] = got
    return out


def combined(rounds: list[Trial]) -> Trial:
    """A candidate's trials of every round it ran as one: the median of its rounds, or its first
    failure (a layout that failed once is dropped)."""
    got = tuple(t.trial_step_s for t in rounds if t.trial_step_s is not None)
    failed = next((t.failed for t in rounds if t.trial_step_s is None), None)
    first = rounds[0]
    if failed is not None or not got:
        return Trial(first.flags, first.predicted_step_s, None, failed or "not measured", got)
    return Trial(first.flags, first.predicted_step_s, statistics.median(got), None, got)


def winner(trials: list[Trial]) -> int | None:
    """Index of the trial to train: among those measured in the most rounds (the last round's
    finalists), the fastest, a later one only where it measured more than TIE faster than the best
    before it (ties keep the model's order); None where none ran."""
    most = max((len(t.rounds_s) for t in trials if t.trial_step_s is not None), default=0)
    best = None
    for i, t in enumerate(trials):
        if t.trial_step_s is None or len(t.rounds_s) < most:
            continue
        if best is None or t.trial_step_s < trials[best].trial_step_s * (1 - TIE):  # type: ignore[operator]
            best = i
    return best


def settled(choice: LayoutChoice, tried: list[int], trials: list[Trial], cut: str | None,
            seconds: float = 0.0) -> LayoutChoice:
    """`choice` with the trials' winner first (the rest in the model's order), the trials, why
    the winner was picked, the budget's line where it cut them short and their `seconds` (in the
    costs, beside the probe's). Every figure of a ranked layout stays the model's:
    `predicted_step_s` is what the prediction check holds the run to."""
    best = winner(trials)
    measured = [t for t in trials if t.trial_step_s is not None]
    costs = {**choice.costs, "trials_s": seconds}
    if best is None or len(measured) < 2:  # nothing compared: the model's order stands
        return replace(choice, trials=[t.to_json() for t in trials], picked_by=PICKED_BY_MODEL, trials_cut=cut,
                       costs=costs)
    first = tried[best]
    ranked = [choice.ranked[first]] + [r for i, r in enumerate(choice.ranked) if i != first]
    return replace(choice, ranked=ranked, trials=[t.to_json() for t in trials], picked_by=PICKED_BY_TRIALS,
                   trials_cut=cut, costs=costs)


def trial_budget_s(max_steps: int, predicted_step_s: float) -> float:
    """Seconds the trials may take: BUDGET_SHARE of the run the model predicts for the chosen layout."""
    return BUDGET_SHARE * max_steps * predicted_step_s


def budget_holds_two(max_steps: int) -> bool:
    """Whether the budget can hold two trials at all: each takes TRIAL_STEPS steps at least (and
    its set-up), so a run of fewer than 2 x TRIAL_STEPS / BUDGET_SHARE steps (60) tries nothing. The
    chosen layout's trial alone settles nothing, and in an 8-step run it took as long as the steps."""
    return BUDGET_SHARE * max_steps >= 2 * TRIAL_STEPS


def skipped_line(max_steps: int, predicted_s: float) -> str:
    """The one line that says the budget is too small for trials."""
    return (f"layout trials skipped: their budget, {BUDGET_SHARE:.0%} of --max-steps {max_steps} x the chosen "
            f"layout's predicted {predicted_s:.3g} s a step, holds fewer than two trials of {TRIAL_STEPS} steps "
            f"(a run of {math.ceil(2 * TRIAL_STEPS / BUDGET_SHARE)} steps or more tries them); training the model's "
            f"choice")


def room_for_another(spent_s: float, took_s: list[float], budget_s: float) -> bool:
    """Whether another trial fits the budget, each trial taken to cost the most one has so far (a
    trial is mostly its set-up and steps of about the same length: the candidates are near-ties)."""
    return spent_s + max(took_s, default=0.0) <= budget_s


def room_for_round(spent_s: float, took_s: list[float], budget_s: float, trials: int) -> bool:
    """Whether a whole round of `trials` more fits the budget, each costing the most one has so far."""
    return spent_s + trials * max(took_s, default=0.0) <= budget_s


def cut_line(done: int, planned: int, spent_s: float, budget_s: float, max_steps: int, predicted_s: float) -> str:
    """The one line that says the budget stopped the trials."""
    return (f"layout trials cut short after {done} of {planned} candidates: {spent_s:.1f} s spent, another would "
            f"pass the budget of {budget_s:.1f} s ({BUDGET_SHARE:.0%} of --max-steps {max_steps} x the chosen "
            f"layout's predicted {predicted_s:.3g} s a step)")


def trial_lines(choice: LayoutChoice, seconds: float) -> list[str]:
    """What rank 0 prints after the trials: each candidate's prediction and trial, which was picked."""
    trials = choice.trials
    lines = [f"layout trials ({seconds:.1f} s): the layouts predicted within {BAND:.0%} of the chosen one, "
             f"{TRIAL_STEPS} steps each (the first untimed; a step is the slowest rank's median), in rounds: those "
             f"within {RUNOFF:.0%} of the fastest again while the budget allows (a trial: the median of its rounds)"]
    picked = choice.chosen["flags"]
    for t in trials:
        if t["trial_step_s"] is None:
            lines.append(f"  {t['flags']}: predicted {t['predicted_step_s']:.3g} s, dropped: {t['failed']}")
            continue
        tag = f"  <- picked: {choice.picked_by}" if t["flags"] == picked and choice.picked_by != PICKED_BY_MODEL else ""
        each = t.get("rounds_s", [])
        rounds = f" (rounds {', '.join(f'{x:.3g}' for x in each)})" if len(each) > 1 else ""
        lines.append(f"  {t['flags']}: predicted {t['predicted_step_s']:.3g} s, trial {t['trial_step_s']:.3g} s"
                     f"{rounds}{tag}")
    if choice.picked_by == PICKED_BY_MODEL:
        lines.append(f"  training the model's choice, {picked}: fewer than two candidates were measured")
    if choice.trials_cut:
        lines.append(choice.trials_cut)
    return lines
