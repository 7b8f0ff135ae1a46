"""Each trainable preset's default learning rate trains without a loss spike: after the warm-up
reaches the peak rate (2 steps), no step's loss rises above the first step's. The same check with a rate far
above the default does fail for `base`, so the test can tell a stable rate from an unstable one.

The presets train at their own width, vocabulary and heads but two blocks deep: Adam moves every
weight by about the rate whatever the depth, so the width sets the spike, and the full depth cost
most of the suite's time (base's 16 blocks: minutes on two cores). bench/lr_stability.py runs a
preset at full depth. Measured here at two blocks: base's default rate 8.43 -> 4.33 with no step
above the first, 2e-2 without clipping reaches 15.09."""

import pytest

from pipezero.settings import build_config
from pipezero.engine import train
from pipezero.models.presets import PRESET_LR, PRESET_WARMUP
from pipezero.optim import short_of_peak


def short_run(preset: str, out: str, **extra) -> list[float]:
    cfg = build_config(None, {"model.preset": preset, "model.n_layers": 2, "data.seq_len": 32, "data.max_bytes": 1_000_000,
                              "data.tokenizer": "bytes", "parallel.microbatches": 1, "parallel.micro_batch_size": 8,
                              "run.max_steps": 6, "optim.warmup_steps": 2, "run.out": out, "run.progress": False,
                              "run.sample_tokens": 0, "run.eval_every": 0, "run.eval_batches": 1, **extra})
    return train(cfg).losses


def test_presets_take_their_rate_and_a_tenth_as_floor():
    for preset, lr in PRESET_LR.items():
        cfg = build_config(None, {"model.preset": preset})
        assert (cfg.optim.lr, cfg.optim.min_lr) == (lr, lr / 10)
    cfg = build_config(None, {"model.preset": "base", "optim.lr": 1e-3, "optim.min_lr": 1e-5})
    assert (cfg.optim.lr, cfg.optim.min_lr) == (1e-3, 1e-5)
    assert PRESET_LR["1b"] < PRESET_LR["base"] < PRESET_LR["small"] < PRESET_LR["tiny"]


def test_large_presets_warm_up_longer_unless_told():
    assert build_config(None, {"model.preset": "base"}).optim.warmup_steps == 20
    for preset, steps in PRESET_WARMUP.items():
        assert build_config(None, {"model.preset": preset}).optim.warmup_steps == steps >= 2000
    assert build_config(None, {"model.preset": "1b", "optim.warmup_steps": "50"}).optim.warmup_steps == 50


def test_a_run_shorter_than_its_warm_up_says_it_never_reaches_the_peak():
    optim = build_config(None, {"model.preset": "1b"}).optim
    note = short_of_peak(optim, 500)
    assert note and "2000 steps" in note and "reaches 5e-05, not its peak 0.0002" in note, note
    assert short_of_peak(optim, 2000) is None and short_of_peak(optim, 10_000) is None


@pytest.mark.distributed  # full lane: seconds of one-process training or planning
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "small", "base"])
def test_default_rate_has_no_spike(preset, tmp_path):
    losses = short_run(preset, str(tmp_path))
    assert max(losses[1:]) <= losses[0], losses
    assert losses[-1] < losses[0] - 0.1, losses  # and it does learn


@pytest.mark.distributed  # full lane: seconds of one-process training or planning
@pytest.mark.slow
def test_a_far_too_high_rate_does_spike(tmp_path):
    losses = short_run("base", str(tmp_path), **{"optim.lr": 2e-2, "optim.grad_clip": 0.0})
    assert max(losses[1:]) > losses[0], losses
