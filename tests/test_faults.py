"""Failures under torchrun: a SIGKILLed rank is recovered by the elastic agent from the last
checkpoint with the same losses; a rank that stops sending fails the job within the timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipezero.cli import main

WORKER = str(Path(__file__).with_name("fault_worker.py"))


def train_args(data: Path, out: Path) -> list[str]:
    return ["train", "--pp", "2", "--dp", "1", "--schedule", "1f1b", "--microbatches", "2", "--data", str(data),
            "--tokenizer", "bytes", "--seq-len", "32", "--max-steps", "6", "--checkpoint-every", "2",
            "--sample-tokens", "0", "--out", str(out), "--no-progress"]


def faulty_job(fault: str, args: list[str], max_restarts: int) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           f"--max-restarts={max_restarts}", WORKER, *args]
    t0 = time.monotonic()
    done = subprocess.run(cmd, env={**os.environ, "PIPEZERO_TEST_FAULT": fault, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr, time.monotonic() - t0


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.distributed
@pytest.mark.slow(37)
def test_sigkilled_rank_restarts_from_checkpoint_with_the_same_losses(text_dir, tmp_path):
    assert main([*train_args(text_dir, tmp_path / "clean"), "--nproc", "2"]) == 0
    code, log, _ = faulty_job("kill:1:4", train_args(text_dir, tmp_path / "faulty"), max_restarts=1)
    assert code == 0, log[-4000:]
    assert "resumed from" in log and "step-00000002" in log  # killed in step 4: step 2 is the newest
    assert losses(tmp_path / "faulty") == losses(tmp_path / "clean")  # every step once, bit for bit


@pytest.mark.distributed
@pytest.mark.slow
def test_rank_that_stops_sending_fails_the_job_within_the_timeout(text_dir, tmp_path):
    args = [*train_args(text_dir, tmp_path / "silent"), "--timeout", "5"]
    code, log, took = faulty_job("silent:0:3", args, max_restarts=0)
    assert code != 0
    assert "rank 1, step 3: chunk 1 waiting for activation of micro-batch 0 from rank 0" in log, log[-4000:]
    assert took < 60


def mismatched_settings(rank: int, world: int, data: str, out: str) -> list[str]:
    """Train two layouts whose settings differ on rank 1 (as under an outside torchrun started with
    different flags on one node); report what each raised."""
    from pipezero.config import ScheduleKind as K
    from pipezero.engine import train
    from pipezero.settings import build_config
    from training import tiny_overrides

    cases = [  # (layout, rank 1's own settings)
        ((2, 1, K.ONE_F_ONE_B, 2), {"parallel.microbatches": 4}),  # a pipeline waiting for a 3rd micro-batch
        ((1, 2, K.ONE_F_ONE_B, 2), {"optim.lr": 1e-2}),  # replicas that would silently drift apart
    ]
    seen = []
    for i, ((pp, dp, kind, m), own) in enumerate(cases):
        overrides = tiny_overrides(data, f"{out}/case{i}", pp, dp, kind, m,
                                   **{"parallel.timeout_s": 20.0, "run.max_steps": 2, **(own if rank == 1 else {})})
        t0 = time.monotonic()
        try:
            train(build_config(None, overrides))
            seen.append("trained")
        except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
            seen.append(f"{time.monotonic() - t0:.1f}|{type(e).__name__}: {e}")
    return seen


@pytest.mark.distributed
def test_settings_that_differ_between_ranks_are_refused_before_any_step(text_dir, tmp_path):
    from ranks import run_ranks

    ranks = run_ranks(mismatched_settings, 2, str(text_dir), str(tmp_path), timeout=300)
    for seen in ranks:
        for outcome, name in zip(seen, ("parallel.microbatches", "optim.lr")):
            took, _, error = outcome.partition("|")
            assert error.startswith("ConfigError") and name in error and "rank 1" in error, seen
            assert float(took) < 10, seen  # said at once, not after a wait runs into the timeout


def stall_in_evaluation(rank: int, world: int, data: str, out: str) -> tuple[str, float]:
    """P=2: the last stage stalls after its held-out forward, so the first waits in the sum of the
    held-out loss; report what each stage saw, and when the first failed or the stalled one came back."""
    from pipezero.config import ScheduleKind as K
    from pipezero.engine import train
    from pipezero.runtime.executor import Executor
    from pipezero.settings import build_config
    from training import tiny_overrides

    failed = Path(out, "rank0-failed")
    back = {"at": None}
    clean = Executor.evaluate

    def evaluate(self, program, batches, sum_loss):
        # the evaluation's waits time out after 3 s; the step's before it keep the run's 60 s, which
        # start-up on a loaded machine (ranks reaching their first transfer seconds apart) needs
        self.p2p.timeout_s = 3.0

        def stalled(local):
            # stalls past the timeout, until rank 0 has failed (at most 60 s, short of the process
            # group's own 120 s): a stall of fixed seconds would race a loaded machine
            deadline = time.monotonic() + 60
            while not failed.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            back["at"] = time.monotonic()  # the clock all processes of this machine share
            return sum_loss(local)

        return clean(self, program, batches, stalled if rank == 1 else sum_loss)

    Executor.evaluate = evaluate
    overrides = tiny_overrides(data, out, 2, 1, K.ONE_F_ONE_B, 2, **{"parallel.timeout_s": 60.0, "run.max_steps": 1})
    t0 = time.monotonic()
    try:
        train(build_config(None, overrides))
        return "trained", back["at"]
    except Exception as e:  # noqa: BLE001 - the test reports what each rank raised
        at = time.monotonic()
        if rank == 0:
            failed.touch()
        return f"{at - t0:.1f}|{type(e).__name__}: {e}", (back["at"] or at)


@pytest.mark.distributed
def test_a_stage_stalling_in_evaluation_fails_its_peers_within_the_timeout(text_dir, tmp_path):
    from ranks import run_ranks

    (first, failed_at), (_, back_at) = run_ranks(stall_in_evaluation, 2, str(text_dir), str(tmp_path), timeout=120)
    error = first.partition("|")[2]
    assert error.startswith("PipelineTimeout: rank 0, step 1: held-out evaluation"), first
    assert "timed out after 3s" in error and failed_at < back_at, first  # before the stalled rank came back
