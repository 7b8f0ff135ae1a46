import json

import pytest

from pipezero.cli import main
from pipezero.config import ModelConfig
from pipezero.models import apply_preset
from pipezero.sim.planner import Cluster, plan
from pipezero.zero.accounting import paper_bytes_per_param


def test_zero_paper_table_1_for_7_5b_at_dp_64():
    """Rajbhandari et al. 2020, Table 1: a 7.5B model with D=64 holds 120, 31.4, 16.6 and 1.88 GB."""
    psi, d = 7.5e9, 64
    gb = [paper_bytes_per_param(stage, d, mixed=True) * psi / 1e9 for stage in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.88], abs=0.05)


def test_70b_on_1024_gpus_of_80_gib_fits():
    model = apply_preset(ModelConfig(), "70b")
    cluster = Cluster(gpus=1024, gpu_memory_gib=80)
    fits, considered = plan(model, cluster, seq_len=4096, global_batch=1024)
    assert considered > len(fits) > 0  # some layouts are dropped for memory
    best = fits[0]
    assert best.memory_gib <= 80 * cluster.headroom
    assert best.layout.pp * best.layout.dp == 1024
    assert all(best.step_time_s <= e.step_time_s for e in fits)


def test_plan_cli_json(capsys):
    assert main(["plan", "--preset", "7b", "--gpus", "64", "--gpu-memory", "80", "--global-batch", "256",
                 "--seq-len", "2048", "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["layouts"]) == 3 and out["layouts"][0]["memory_gib"] <= 72
    assert main(["plan", "--preset", "70b", "--gpus", "2", "--gpu-memory", "16"]) == 2  # nothing fits
