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


def test_grad_reduce_modes_trade_memory_for_traffic():
    """ZeRO-2 inside a pipeline: `step` holds the whole bf16 gradient (2Ψ(1-1/D) bytes more),
    `microbatch` keeps the sharded memory for M reduce-scatters a step."""
    from pipezero.config import GradReduce, ScheduleKind
    from pipezero.sim.planner import GIB, Layout, estimate

    model = apply_preset(ModelConfig(), "7b")
    cluster = Cluster(gpus=64, gpu_memory_gib=80, inter_gbps=1.0)  # a slow link: traffic shows
    step, per_mb = (estimate(model, 2048, 256, cluster, Layout(4, 16, 2, ScheduleKind.ONE_F_ONE_B, 1, 1, 16, False, g))
                    for g in (GradReduce.STEP, GradReduce.MICROBATCH))
    psi_gib = (step.model_states_gib - per_mb.model_states_gib) / (2 * (1 - 1 / 16))
    assert psi_gib * GIB == pytest.approx(7e9 / 4, rel=0.2)  # about a quarter of the model per stage
    assert per_mb.dp_comm_s > step.dp_comm_s  # more reduce-scatters than compute can hide
    fits, _ = plan(model, Cluster(gpus=64, gpu_memory_gib=80), seq_len=2048, global_batch=256)
    assert {e.layout.grad_reduce for e in fits} == {GradReduce.STEP, GradReduce.MICROBATCH}


def test_placement_follows_the_bandwidths_and_plan_takes_nodes_and_two_link_classes(capsys):
    """2 nodes x 2: a slow inter-node link keeps gradients inside a node (dp-inner); the CLI takes
    --nodes, --gpus-per-node, --intra-bw and --inter-bw and shows the placement."""
    from pipezero.config import Placement, ScheduleKind
    from pipezero.sim.planner import Layout, estimate

    model = apply_preset(ModelConfig(), "tiny")
    slow = Cluster(gpus=4, gpu_memory_gib=80, node_size=2, intra_gbps=10.0, inter_gbps=0.01, tflops=1e-3)
    dp_in, pp_in = (estimate(model, 128, 16, slow, Layout(2, 2, 1, ScheduleKind.ONE_F_ONE_B, 1, 2, 4, False,
                                                           placement=p)) for p in Placement)
    assert dp_in.dp_comm_s < pp_in.dp_comm_s and dp_in.step_time_s < pp_in.step_time_s
    assert main(["plan", "--preset", "tiny", "--nodes", "2", "--gpus-per-node", "2", "--intra-bw", "10",
                 "--inter-bw", "0.02", "--gpu-memory", "8", "--global-batch", "16", "--seq-len", "128",
                 "--json", "--top", "400"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert {r["placement"] for r in rows} == {"dp-inner", "pp-inner"}
    assert rows[0]["placement"] == "dp-inner" or rows[0]["pp"] == 1
