"""`train --layout auto` settles near-ties by trial steps inside the job that trains.

The planner's step-time model is within its stated error (auto_check.TOLERANCE) of measured, and
its top layouts are often predicted within a percent or two of one another: among those, the
model's order is a coin toss. Peers settle it by launching candidate jobs; here the job's process
group already exists, and one process group trains layout after layout (tests/training.py does),
so the near-ties are measured where they will run. The candidates are the layouts predicted within
`BAND` of the chosen one, another shape (P, D, schedule, V) before a sibling that differs only in
its micro-batching (`candidates`: at most `--layout-trials K`, auto_job.DEFAULT_TRIALS unless given,
the chosen one first). A trial trains `TRIAL_STEPS` steps of the run's own data and seed (the first
pays the layout's one-off costs and is not timed) in a scratch folder inside --out (`SCRATCH`,
removed afterwards, also on failure), saving, evaluating, sampling and logging nothing; its figure
is the slowest rank's median (an all-reduce MAX, so every rank picks alike).

Two timed steps of one trial are not a layout's steady step: on a shared host a step moves by
20-30% from one to the next and the host's load by more over the seconds the trials take
(bench/trial_drift.py), so trials run one after another compare different minutes. So the trials
go in rounds: every candidate once, then, while the budget allows, those measured within `RUNOFF`
of the fastest again, each round in the reverse order of the one before (`runoff`; at most
`MAX_ROUNDS`), so that drift falls on the finalists alike. A candidate's figure is the median of
its rounds; the fastest of the last round's wins, a later one in the model's order only where it
measured more than `TIE` faster. The trials together stay within `BUDGET_SHARE` of the run's
predicted time (the chosen one's trial always runs; a run too short to hold two tries none). The
real run then starts from step 0 as it would without trials.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipezero.planner.auto import MODELS_CHOICE, LayoutChoice
from pipezero.planner.auto_check import TOLERANCE

BAND = TOLERANCE  # tried: predicted within the model's stated error of the chosen layout
TRIAL_STEPS = 3  # a trial's steps; the first pays one-off costs (allocation, warm-up) and is not timed
# Tried again in the next round: measured within this of the fastest of the round. Two timed steps
# on a shared host differ by 20-30% from the layout's steady step (bench/trial_drift.py).
RUNOFF = 0.15
MAX_ROUNDS = 3  # rounds at most: the first of every candidate, then two of the finalists
BUDGET_SHARE = 0.10  # the trials' time at most this share of --max-steps x the chosen layout's predicted step
TIE = 0.02  # a candidate later in the model's order wins only where it measured this much faster
SCRATCH = ".layout-trials"  # inside --out: on the run's own disk, removed afterwards
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
    sibling of one taken (measured on the emulated cluster, siblings that differ only in M and B
    were within 2-9% of one another, shapes 25-40% apart: the model's error is mostly a shape's);
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


class TrialFailed(Exception):
    """A trial failed where the job's process group cannot be trusted afterwards: the run stops."""


# How a rank's trial ended, as the ranks compare it: a failure in set-up that no peer waited on (out
# of memory, a refused setting) leaves nothing in flight; one mid-step, or a wait that timed out, can
# leave a peer's send or receive unmatched, which a later layout's message with the same peer and tag
# would meet: the group is no longer one the run may train in.
DONE, FAILED_IN_SET_UP, FAILED_MID_STEP = 0, 1, 2


class MidStep(Exception):
    """A trial's failure after its first step began (its cause is the failure)."""


def settle_by_trials(req: Any, choice: LayoutChoice, cfg: Any, names: dict[str, str]) -> LayoutChoice:
    """Inside the job, on every rank alike: try the near-ties of `choice` (`candidates`, at most
    req.trials) and return the choice with the winner first; rank 0 prints what the trials measured.
    `cfg`: the configuration the job started with (its process group's); `req`: auto_job.Request.
    TrialFailed where a trial failed mid-step on some rank (see FAILED_MID_STEP)."""
    tried = candidates(choice.ranked, req.trials)
    if not tried:
        return choice
    max_steps, predicted = req.base.run.max_steps, choice.chosen["predicted_step_s"]
    if not budget_holds_two(max_steps):
        line = skipped_line(max_steps, predicted)
        if int(os.environ.get("RANK", "0")) == 0:
            print(line, flush=True)
        return replace(choice, trials_cut=line)
    from pipezero.parallel.process_group import init_distributed

    rank, _ = init_distributed(cfg)  # with --costs no probe made the group: the trials' agreement needs it
    agreeing = agreement_group(req.world)
    scratch = Path(req.base.run.out) / SCRATCH
    budget = trial_budget_s(max_steps, predicted)
    rounds: dict[int, list[Trial]] = {}  # position in `tried` -> its trial of each round it ran
    took: list[float] = []  # each trial's seconds, as every rank agreed them
    order, spent, cut = list(range(len(tried))), 0.0, None
    t0 = time.perf_counter()
    try:
        for r in range(MAX_ROUNDS):
            if r and not room_for_round(spent, took, budget, len(order)):
                break  # a round is whole or not run: its finalists compare the same minutes
            for pos, n in enumerate(order):
                if r == 0 and took and not room_for_another(spent, took, budget):  # a later round: admitted whole
                    cut = cut_line(pos, len(tried), spent, budget, max_steps, predicted)
                    break
                trial, now = one_trial(req, choice.ranked[tried[n]], scratch / f"{r}-{n}", names, rank, t0, agreeing)
                rounds.setdefault(n, []).append(trial)
                took.append(now - spent)
                spent = now
            order = runoff(figures(rounds), order)
            if cut or not order:
                break
    finally:
        remove_scratch(scratch)
    done = sorted(rounds)
    out = settled(choice, [tried[n] for n in done], [combined(rounds[n]) for n in done], cut, spent)
    if rank == 0:
        print("\n".join(trial_lines(out, spent)), flush=True)
    return out


def figures(rounds: dict[int, list[Trial]]) -> dict[int, list[float]]:
    """Each candidate's figure of every round, for those measured in every round they ran."""
    out: dict[int, list[float]] = {}
    for n, ts in rounds.items():
        got = [t.trial_step_s for t in ts if t.trial_step_s is not None]
        if len(got) == len(ts):
            out[n] = got
    return out


def room_for_round(spent_s: float, took_s: list[float], budget_s: float, trials: int) -> bool:
    """Whether a whole round of `trials` more fits the budget, each costing the most one has so far."""
    return spent_s + trials * max(took_s, default=0.0) <= budget_s


def combined(rounds: list[Trial]) -> Trial:
    """A candidate's trials of every round it ran as one: the median of its rounds, or its first
    failure (a layout that failed once is dropped)."""
    got = tuple(t.trial_step_s for t in rounds if t.trial_step_s is not None)
    failed = next((t.failed for t in rounds if t.trial_step_s is None), None)
    first = rounds[0]
    if failed is not None or not got:
        return Trial(first.flags, first.predicted_step_s, None, failed or "not measured", got)
    return Trial(first.flags, first.predicted_step_s, statistics.median(got), None, got)


def agreement_group(world: int) -> Any:
    """A group of every rank that only the trials' agreement uses: a failed trial's collectives left
    in flight on the job's own groups cannot meet it (None: one rank, nothing to agree)."""
    import torch.distributed as dist

    return dist.new_group(list(range(world))) if world > 1 and dist.is_initialized() else None


def trial_settings(req: Any, ranked: dict[str, Any], out: Path) -> dict[str, Any]:
    """A trial's settings: the run's, the candidate's layout, and a run that writes nothing of its
    own. Its --max-steps stays past the trial's steps, so its last step is no run's last (which
    evaluates) and its learning rates are the run's own first."""
    quiet = {"run.out": str(out), "run.max_steps": str(max(req.base.run.max_steps, TRIAL_STEPS + 1)),
             "run.eval_every": "0", "run.checkpoint_every": "0", "run.save_final": False, "run.sample_tokens": "0",
             "run.trace": False, "run.tensorboard": False, "run.memory_profile": False, "run.resume": False,
             "run.progress": False, "run.quiet": True}
    return {**req.settings, **ranked["settings"], **quiet}


def one_trial(req: Any, ranked: dict[str, Any], out: Path, names: dict[str, str], rank: int, t0: float,
              group: Any) -> tuple[Trial, float]:
    """(the candidate's trial, the seconds since `t0` the trials have taken), both as every rank
    agrees them (over `group`): its step the slowest rank's median. A failure in set-up on every
    rank drops the candidate, named by the first rank that failed; one mid-step on any rank raises
    TrialFailed (see FAILED_MID_STEP) on every rank."""
    from pipezero.settings import build_config

    from pipezero.parallel.waits import PipelineTimeout, all_reduced

    timeout, world = req.base.parallel.timeout_s, req.world
    step_s, how, failed, blame = 0.0, DONE, None, 0
    try:
        out.mkdir(parents=True, exist_ok=True)  # the trial's own run folder (its flight records, were it to stall)
        step_s = time_steps(build_config(req.config, trial_settings(req, ranked, out), names))
    except Exception as e:  # noqa: BLE001 - said in one line and compared across ranks (below)
        # only facts of it are kept: its traceback holds the trial's stage, whose memory goes back below
        cause = e.__cause__ if isinstance(e, MidStep) and e.__cause__ is not None else e
        how = FAILED_IN_SET_UP if not isinstance(e, MidStep) and clean_failure(cause) else FAILED_MID_STEP
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        failed = f"rank {rank}: {type(cause).__name__}{': ' + first[:200] if first else ''}"
        # the line the ranks print: a rank's own failure before a wait for a peer's, the lowest rank first
        blame = (1 if isinstance(cause, PipelineTimeout) else 2) * (world + 1) + world - rank
        del cause
    free_memory()
    # a peer may come here only once a wait of its own has run out (`timeout`): twice it bounds this one
    step_s, worst, least, blamed, spent = all_reduced(
        [step_s, how, -how, blame, time.perf_counter() - t0], group, 2 * timeout,
        f"rank {rank}: --layout auto's trial of {ranked['flags']}: all-reduce (MAX) of its step time over {world} "
        f"ranks", largest=True)
    if not blamed:
        return Trial(ranked["flags"], ranked["predicted_step_s"], step_s), spent
    line = share_line(failed or "", world - int(blamed) % (world + 1), rank, 2 * timeout, group)
    if world > 1 and (worst, -least) != (FAILED_IN_SET_UP, FAILED_IN_SET_UP):
        raise TrialFailed(f"--layout auto: the trial of {ranked['flags']} failed ({line}) after ranks had begun "
                          f"exchanging its messages, which leaves the job's process group unfit to train in; rerun "
                          f"with --layout-trials 0, or give a layout yourself")
    return Trial(ranked["flags"], ranked["predicted_step_s"], None, line), spent


def clean_failure(e: BaseException) -> bool:
    """Whether a failure in a trial's set-up left nothing in flight: out of memory, or a setting
    refused; not a wait that failed or timed out (a peer stopped in the middle of a collective)."""
    import torch

    from pipezero.errors import ConfigError

    return isinstance(e, (torch.OutOfMemoryError, MemoryError, ConfigError))


def time_steps(cfg: Any) -> float:
    """This rank's median step of a trial: TRIAL_STEPS steps from step 0, the first not timed; a
    failure once the steps began raised as MidStep."""
    from pipezero.engine import Trainer

    trainer = Trainer.set_up(cfg, trial=True)
    try:
        times = [trainer.step(s)["step_time_s"] for s in range(TRIAL_STEPS)]
        trainer.stage.zero.settle("end of trial")  # nothing in flight when the stage is dropped
    except Exception as e:
        raise MidStep(str(e)) from e
    finally:
        trainer.stop_watch()
    return statistics.median(times[1:])


def free_memory() -> None:
    """Give back a trial's memory before the next layout is built (its stage is garbage now)."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def share_line(line: str, src: int, rank: int, timeout_s: float, group: Any = None) -> str:
    """Rank `src`'s `line` on every rank of `group` (one rank's failure, for rank 0 to print)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return line
    from pipezero.planner.auto_job import broadcast_bytes

    return broadcast_bytes(line.encode(), rank, timeout_s, src, "line on its failed --layout auto trial",
                           group).decode()


def remove_scratch(path: Path) -> None:
    """Remove the trials' folder; ranks sharing a disk remove it side by side, so an entry another
    rank removed first is no failure."""
    for _ in range(3):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            if not path.exists():
                return
