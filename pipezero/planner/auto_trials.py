"""`train --layout auto` settles near-ties by trial steps inside the job that trains.

The planner's step-time model is within its stated error (auto_check.TOLERANCE) of measured, and
its top layouts are often predicted within a percent or two of one another: among those, the
model's order is a coin toss. Peers settle it by launching candidate jobs; here the job's process
group already exists, and one process group trains layout after layout (tests/training.py does),
so the near-ties are measured where they will run. Which layouts, in what rounds, and which wins:
planner/trial_rounds.py (at most `--layout-trials K`, auto_job.DEFAULT_TRIALS unless given). A trial
trains the run's own data and seed in a scratch folder inside --out (rundir.py `TRIALS`, removed
afterwards, also on failure), saving, evaluating, sampling and logging nothing; every figure the
ranks decide by is agreed by an all-reduce, so every rank picks alike. The real run then starts
from step 0 as it would without trials.
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipezero.planner.auto import LayoutChoice
from pipezero.planner.trial_rounds import (MAX_ROUNDS, TRIAL_STEPS, Trial, budget_holds_two, candidates, combined,
                                           cut_line, figures, room_for_another, room_for_round, runoff, settled,
                                           skipped_line, trial_budget_s, trial_lines)
from pipezero.rundir import TRIALS



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
    scratch = Path(req.base.run.out) / TRIALS
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
        out.mkdir(parents=True, exist_ok=True)  # the trial's own folder (its ranks answer the doctor in the run's)
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
