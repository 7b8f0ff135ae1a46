"""The memory model against measured runs: each rank's predicted peak (sim/memory.py) within 10% of
its measured peak of the first step (train --memory-profile: the profiler's live tensor bytes),
for 1F1B and ZB-H1 at ZeRO 0 and 3 on P=2 x D=2, one spawn of four ranks. The whole table (every
schedule, stage, P, D, recompute, two models) is bench/memory_model.py."""

from __future__ import annotations

import pytest

from pipezero.config import ScheduleKind as K
from pipezero.settings import build_config
from pipezero.sim.memory import predict
from pipezero.sim.memory_runs import phase_peaks
from ranks import run_ranks
from training import tiny_overrides

pytestmark = pytest.mark.distributed

# model state and activations of the same order: four blocks of width 128 over 2 x 32 tokens
MODEL = {"model.n_layers": 4, "model.dim": 128, "model.n_heads": 4, "model.vocab_size": 256,
         "data.seq_len": 32, "data.packing": "concat", "parallel.micro_batch_size": 2, "parallel.bucket_mb": 0.5,
         "run.max_steps": 1, "run.threads": 1}
CASES = [(kind, zero) for kind in (K.ONE_F_ONE_B, K.ZB_H1) for zero in (0, 3)]


def test_predicted_peaks_within_a_tenth_of_measured(text_dir, tmp_path):
    cfgs = [build_config(None, tiny_overrides(str(text_dir), f"{tmp_path}/{kind.value}-z{zero}", 2, 2, kind, 4,
                                              **MODEL, **{"parallel.zero": zero}))
            for kind, zero in CASES]
    measured = run_ranks(phase_peaks, 4, cfgs, timeout=240)
    off = []
    for i, ((kind, zero), cfg) in enumerate(zip(CASES, cfgs)):
        for r, pred in enumerate(predict(cfg, cuda=False)):
            peak = max(measured[r][i].values())
            ratio = pred.peak_bytes / peak
            if not 0.9 <= ratio <= 1.1:
                off.append(f"{kind.value} ZeRO-{zero} rank {r}: predicted {pred.peak_bytes / 2**20:.2f} MiB, "
                           f"measured {peak / 2**20:.2f} MiB ({ratio:.3f})")
    assert not off, "; ".join(off)
