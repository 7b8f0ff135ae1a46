import json
import math

import pytest

from pipezero.cli import main
from pipezero.config import ModelConfig
from pipezero.models import apply_preset
from pipezero.planner.layouts import Cluster
from pipezero.planner.search import plan
from pipezero.zero.accounting import paper_bytes_per_param
from one_line import assert_one_line, run_main


def test_zero_paper_table_1_for_7_5b_at_dp_64():
    """Rajbhandari et al. 2020, Table 1: a 7.5B model with D=64 holds 120, 31.4, 16.6 and 1.88 GB."""
    psi, d = 7.5e9, 64
    gb = [paper_bytes_per_param(stage, d, mixed=True) * psi / 1e9 for stage in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.88], abs=0.05)


@pytest.mark.distributed  # full lane: seconds of one-process training or planning
def test_70b_on_1024_gpus_of_80_gib_fits():
    model = apply_preset(ModelConfig(), "70b")
    cluster = Cluster(gpus=1024, gpu_memory_gib=80)
    fits, considered = plan(model, cluster, seq_len=4096, global_batch=1024)
    assert considered > len(fits) > 0  # some layouts are dropped for memory
    best = fits[0]
    assert best.memory_gib <= 80 * cluster.headroom
    assert best.layout.pp * best.layout.dp == 1024
    assert all(best.step_time_s <= e.step_time_s for e in fits)


@pytest.mark.distributed  # full lane: seconds of one-process training or planning
def test_plan_cli_json(capsys):
    assert main(["plan", "--preset", "7b", "--gpus", "64", "--gpu-memory", "80", "--global-batch", "256",
                 "--seq-len", "2048", "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["layouts"]) == 3 and out["layouts"][0]["memory_gib"] <= 72
    assert main(["plan", "--preset", "70b", "--gpus", "2", "--gpu-memory", "16"]) == 2  # nothing fits


@pytest.mark.distributed  # full lane: seconds of one-process training or planning
def test_grad_reduce_modes_trade_memory_for_traffic():
    """ZeRO-2 inside a pipeline: `step` holds the whole fp32 gradient through the step (pipezero
    keeps fp32 gradients whatever the compute dtype), `microbatch` keeps the sharded memory, a few
    full buckets in flight, for M reduce-scatters a step."""
    from pipezero.config import GradReduce, ScheduleKind
    from pipezero.planner.layouts import Layout
    from pipezero.memory.model import layout_memory
    from pipezero.planner.search import estimate

    model = apply_preset(ModelConfig(), "7b")
    cluster = Cluster(gpus=64, gpu_memory_gib=80, inter_gbps=1.0)  # a slow link: traffic shows
    step, per_mb = (estimate(model, 2048, 256, cluster, Layout(4, 16, 2, ScheduleKind.ONE_F_ONE_B, 1, 1, 16, False, g))
                    for g in (GradReduce.STEP, GradReduce.MICROBATCH))
    assert step.model_states_gib > per_mb.model_states_gib
    lays = [Layout(4, 16, 2, ScheduleKind.ONE_F_ONE_B, 1, 1, 16, False, g) for g in (GradReduce.STEP, GradReduce.MICROBATCH)]
    whole, sharded = (layout_memory(model, 2048, lay, True, True, cluster.bucket_mb).categories for lay in lays)
    assert whole["grads"] == whole["params"]  # the stage's whole fp32 gradient, as large as its weights
    assert whole["params"] == pytest.approx(4 * 7e9 / 4, rel=0.2)  # about a quarter of the model per stage
    assert sharded["grads"] < whole["grads"] / 2  # its 1/16 shard and two buckets (a layer each) in flight
    assert per_mb.dp_comm_s > step.dp_comm_s  # more reduce-scatters than compute can hide
    fits, _ = plan(model, Cluster(gpus=64, gpu_memory_gib=80), seq_len=2048, global_batch=256)
    assert {e.layout.grad_reduce for e in fits} == {GradReduce.STEP, GradReduce.MICROBATCH}


def test_placement_follows_the_bandwidths_and_plan_takes_nodes_and_two_link_classes(capsys):
    """2 nodes x 2: a slow inter-node link keeps gradients inside a node (dp-inner); the CLI takes
    --nodes, --gpus-per-node, --intra-bw and --inter-bw and shows the placement."""
    from pipezero.config import Placement, ScheduleKind
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import estimate

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


def test_one_stage_holds_every_parameter_and_zero_1_moves_what_the_code_moves():
    """P=1 holds the embedding and the head (16 bytes each at ZeRO-0); ZeRO-1 and ZeRO-2 both
    reduce-scatter and all-gather (2 passes on NCCL, an all-reduce's), ZeRO-3 gathers twice."""
    from pipezero.config import ScheduleKind
    from pipezero.models import param_count
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import GIB, estimate

    model = apply_preset(ModelConfig(), "tiny")
    slow = Cluster(gpus=4, gpu_memory_gib=80, node_size=4, intra_gbps=0.001, tflops=1e6)
    one = estimate(model, 128, 16, slow, Layout(1, 1, 0, ScheduleKind.ONE_F_ONE_B, 1, 4, 4, False))
    assert one.model_states_gib * GIB == pytest.approx(16 * param_count(model))
    comm = [estimate(model, 128, 16, slow, Layout(1, 4, z, ScheduleKind.ONE_F_ONE_B, 1, 4, 1, False)).dp_comm_s
            for z in range(4)]
    assert comm[1] == pytest.approx(comm[0]) and comm[2] == pytest.approx(comm[0])
    assert comm[3] == pytest.approx(1.5 * comm[0])


def test_cpu_clusters_price_gloo_and_offer_the_two_level_reduction_where_groups_cross_nodes(capsys):
    """On CPU ranks a reduce-scatter is a direct exchange and a node's ranks share one link: at 2
    nodes x 2 with a free inside path, the two-level reduce-scatter puts 2x fewer seconds on the
    link than the flat exchange, the two-level all-reduce 1.5x fewer than gloo's ring (parallel/hierarchical.py's arithmetic). GPU clusters
    never get --hierarchical."""
    from pipezero.config import Placement, ScheduleKind
    from pipezero.planner.layouts import Layout
    from pipezero.planner.traffic import collective_s, dp_split

    assert dp_split(2, 1, 4, Placement.DP_INNER) == (2, 2)  # 2 ranks of the group on each of 2 nodes
    assert dp_split(2, 2, 2, Placement.PP_INNER) == (1, 2)
    assert dp_split(2, 2, 2, Placement.DP_INNER) == (2, 1)  # inside one node
    assert dp_split(4, 1, 6, Placement.DP_INNER) is None  # 4 + 2: uneven
    cpu = Cluster(gpus=4, gpu_memory_gib=80, node_size=2, intra_gbps=1e9, inter_gbps=0.01, cpu=True)
    flat, two = (collective_s(cpu, Layout(1, 4, 2, ScheduleKind.ONE_F_ONE_B, 1, 4, 1, False, hierarchical=h), 1e6)
                 for h in (False, True))
    # the flat exchange puts g (D - g) / D = 1 buffer on a node's link, the ring's all-reduce 2 x 3/4
    # over the node's 2 ranks, the two-level exchange across (n - 1) / n of a 1/g piece = 1/4 a rank
    # (bench/cluster_hierarchical.uplink_share's arithmetic)
    assert flat["reduce_scatter"] == pytest.approx(flat["all_reduce"] * 2 / 3)
    assert flat["reduce_scatter"] / two["reduce_scatter"] == pytest.approx(2.0)
    assert flat["all_reduce"] / two["all_reduce"] == pytest.approx(1.5)
    args = ["plan", "--preset", "tiny", "--nodes", "2", "--gpus-per-node", "2", "--intra-bw", "10", "--inter-bw",
            "0.02", "--gpu-memory", "8", "--global-batch", "16", "--seq-len", "128", "--json", "--top", "1000"]
    assert main(args) == 0
    assert not any(r["hierarchical"] for r in json.loads(capsys.readouterr().out)["layouts"])
    assert main([*args, "--device", "cpu"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    two_level = [r for r in rows if r["hierarchical"]]
    assert two_level and all(r["dp"] > 1 for r in two_level)
    fastest = {}  # the same layout flat and two-level: never slower two-level (equal for an all-reduce
    # with one rank a node, whose ring and exchange send the same), faster for most
    for r in rows:
        key = tuple(v for k, v in r.items()
                    if k not in ("hierarchical", "step_time_s", "tokens_per_s", "node_link_bytes", "why"))
        fastest.setdefault(key, {})[r["hierarchical"]] = r["step_time_s"]
    pairs = [v for v in fastest.values() if len(v) == 2]
    assert pairs and all(v[True] <= v[False] for v in pairs)
    assert sum(v[True] < v[False] for v in pairs) > len(pairs) / 2


def test_ranks_sharing_cores_slow_each_other_except_while_idle():
    """`cores`: four ranks on two cores compute half as fast as on four devices when all are busy;
    a pipeline whose first stage is lighter (the head is on the last) lends it back."""
    from pipezero.config import ScheduleKind
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import estimate

    model = apply_preset(ModelConfig(), "tiny")
    base = dict(gpus=4, gpu_memory_gib=80, node_size=4, intra_gbps=1e6, tflops=1e-3)
    own, shared = (Cluster(**base), Cluster(**base, cores=2))
    dp = Layout(1, 4, 0, ScheduleKind.ONE_F_ONE_B, 1, 4, 1, False)
    pp = Layout(2, 2, 0, ScheduleKind.ONE_F_ONE_B, 1, 1, 8, False)
    assert estimate(model, 128, 16, shared, dp).step_time_s == pytest.approx(
        2 * estimate(model, 128, 16, own, dp).step_time_s, rel=1e-3)
    slowdown = estimate(model, 128, 16, shared, pp).step_time_s / estimate(model, 128, 16, own, pp).step_time_s
    assert 1.0 <= slowdown < 1.9


def test_a_pipelines_pace_is_its_heaviest_rank_as_the_run_cuts_the_layers():
    """The run cuts [embedding, blocks..., head] uniformly by layer count: 4 blocks over 4 stages give
    [embedding + block, 2 blocks, block, head], so the pace is the head's or two blocks', not a
    block and the head (which priced P=4 1.4 times what the emulated cluster measured against
    P=2). At P=2 the last stage holds two blocks and the head, as before."""
    from pipezero.config import ScheduleKind
    from pipezero.models.presets import layer_costs
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import estimate

    model = apply_preset(ModelConfig(), "tiny")
    model.n_layers = 4
    cluster = Cluster(gpus=4, gpu_memory_gib=80, node_size=4, intra_gbps=1e6, inter_gbps=1e6, tflops=1e-3, mfu=1.0)
    block, head = layer_costs(model, 128)[1], layer_costs(model, 128)[-1]
    step = {pp: estimate(model, 128, 16, cluster, Layout(pp, 4 // pp, 0, ScheduleKind.GPIPE, 1, 1, 16 * pp // 4,
                                                          False)).step_time_s for pp in (2, 4)}
    units = {pp: (16 * pp // 4 + pp - 1) * 3 for pp in (2, 4)}  # GPipe's step: M + P - 1 forwards and backwards
    heaviest = {2: 2 * block + head, 4: max(2 * block, head)}
    tokens = 128 / 3  # a micro-batch of one row; layer_costs counts forward and backward (3x the forward)
    for pp in (2, 4):
        assert step[pp] == pytest.approx(units[pp] * heaviest[pp] * tokens / 1e9, rel=1e-3), (pp, step)


def test_a_pipelines_hops_cross_the_slow_link_only_between_nodes():
    """P=4 over 2 nodes of 2 ranks: of its three boundaries one crosses the nodes, and its one
    sender has its node's link to itself (CPU ranks share a node's link); the other two are inside
    a node. Every hop was priced across at a rank's share, which made P=4 at 100 Mbit 0.13 s
    slower than P=2 x D=2, where the emulated cluster measured it faster."""
    from pipezero.config import ScheduleKind
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import estimate

    model = apply_preset(ModelConfig(), "tiny")
    model.n_layers = 4
    fast = Cluster(gpus=4, gpu_memory_gib=80, node_size=2, intra_gbps=1e3, inter_gbps=1e3, tflops=1e-3, cpu=True,
                   wire_bytes=4)
    slow = Cluster(**{**fast.__dict__, "inter_gbps": 1e-3})
    hop = 4 * 2 * 128 * model.dim  # fp32 activations of a micro-batch of two rows
    lay = Layout(4, 1, 0, ScheduleKind.GPIPE, 1, 2, 8, False)
    extra = estimate(model, 128, 16, slow, lay).step_time_s - estimate(model, 128, 16, fast, lay).step_time_s
    # forward and back across the one boundary between nodes, at the whole link (2 ranks' shares)
    assert extra == pytest.approx(2 * hop / (2 * 1e-3 * 1e9), rel=0.02)


def test_a_links_latency_is_paid_by_each_hop_and_each_buckets_collective():
    """A probe times each link's latency beside its bandwidth; the planner threw it away. A pipeline
    hop pays its link's (between nodes, the nodes'), and each bucket's collective its group's link's
    once for each of its ring's steps: at ZeRO-1 over D = 4, a step's reduce-scatter and all-gather
    over k buckets pay 3 + 3 latencies each bucket; the two-level reduction 1 inside and 1 across."""
    from pipezero.config import ScheduleKind
    from pipezero.models import param_count
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import hop_seconds
    from dataclasses import replace

    from pipezero.planner.traffic import dp_traffic, latency_s

    model = apply_preset(ModelConfig(), "tiny")
    model.n_layers = 4
    base = Cluster(gpus=4, gpu_memory_gib=80, node_size=2, intra_gbps=1.0, inter_gbps=0.1, tflops=1e-3, cpu=True,
                   wire_bytes=4, bucket_mb=1.0)
    slow = Cluster(**{**base.__dict__, "intra_latency_s": 1e-4, "inter_latency_s": 2e-3})
    pp4 = Layout(4, 1, 0, ScheduleKind.GPIPE, 1, 2, 8, False)
    plain, late = hop_seconds(base, pp4, 1e5), hop_seconds(slow, pp4, 1e5)
    # [embedding + block, 2 blocks] | [block, head]: inside, across, inside
    assert [b - a for a, b in zip(plain, late)] == pytest.approx([1e-4, 2e-3, 1e-4])
    dp4 = Layout(1, 4, 1, ScheduleKind.ONE_F_ONE_B, 1, 4, 1, False)
    psi = param_count(model)
    k = math.ceil(psi * 4 / 2**20)
    (_, link_plain, _), (_, link_late, _) = (dp_traffic(c, dp4, psi, 0.01) for c in (base, slow))
    assert link_late - link_plain == pytest.approx(k * 6 * 2e-3)
    assert latency_s(slow, replace(dp4, hierarchical=True))["reduce_scatter"] == pytest.approx(1e-4 + 2e-3)


def test_a_slow_boundary_makes_1f1b_dearer_than_the_schedules_that_stream_through_it():
    """The emulated 2 nodes x 2 ranks at 100 Mbit, as bench/layout_auto_cluster.py's probe measured it
    (58 GFLOP/s, 0.4 ms an action, 5.2 MB/s a rank across, 1.25 cores): P=4's middle boundary crosses
    the nodes, and the planner plays each boundary at its own link. 1F1B waits a round trip across it
    for a micro-batch's backward, where GPipe and ZB-H1 keep the link busy, so 1F1B is priced slower,
    as measured (1.57 s against 0.53 and 0.52): one hop cost added after the play priced all three
    alike (0.297 s) and chose 1F1B. Where the link between nodes is fast they tie again."""
    from dataclasses import replace

    from pipezero.config import ScheduleKind as K
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import estimate, hop_seconds, plan_within

    model = apply_preset(ModelConfig(), "tiny")
    model.n_layers = 4
    slow = Cluster(gpus=4, gpu_memory_gib=0.07, node_size=2, intra_gbps=1.327, inter_gbps=0.00517, tflops=0.0578,
                   mfu=1.0, wire_bytes=4, overhead_s=4e-4, cpu=True, cores=1.25, bucket_mb=1.0)
    fast = replace(slow, inter_gbps=100.0)
    lay = {k: Layout(4, 1, 0, k, 1, 2, 8, False) for k in (K.ONE_F_ONE_B, K.GPIPE, K.ZB_H1)}
    hop = 4 * 2 * 128 * model.dim  # fp32 activations of a micro-batch of two rows
    # the middle boundary crosses the nodes, its one sender with the node's link (two ranks' shares) to itself
    assert hop_seconds(slow, lay[K.GPIPE], hop) == pytest.approx(
        (hop / 1.327e9, hop / (2 * 0.00517e9), hop / 1.327e9))
    step = {k: estimate(model, 128, 16, slow, x).step_time_s for k, x in lay.items()}
    assert step[K.ONE_F_ONE_B] > 1.1 * step[K.GPIPE] and step[K.ONE_F_ONE_B] > 1.02 * step[K.ZB_H1]
    tie = {k: estimate(model, 128, 16, fast, x).step_time_s for k, x in lay.items()}
    assert tie[K.ONE_F_ONE_B] == pytest.approx(tie[K.GPIPE], rel=0.01)
    ranked = [e.layout for e in plan_within(model, slow, 128, 16).fits]
    assert ranked[0].schedule is not K.ONE_F_ONE_B
    assert ranked.index(lay[K.GPIPE]) < ranked.index(lay[K.ONE_F_ONE_B])
    assert ranked.index(lay[K.ZB_H1]) < ranked.index(lay[K.ONE_F_ONE_B])


def test_a_fixed_cost_per_action_is_paid_once_by_a_fused_backward():
    """`CostModel.per_action`: each rank of ZB-H1 (F, B, W apart) pays it M times more than 1F1B
    (F, fused BW), so on an oversubscribed host, where the bubble is not the limit, 1F1B wins."""
    from pipezero.config import ScheduleKind
    from pipezero.schedules.check import CostModel, simulate
    from pipezero.schedules.registry import build_schedule
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import estimate

    m, fixed = 8, 0.5
    one, zb = (simulate(build_schedule(k, 2, m, 1), CostModel(per_action=fixed))
               for k in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1))
    busy = [[r.step_time - idle for idle in r.idle] for r in (one, zb)]
    assert busy[0] == pytest.approx([m * (3 + 2 * fixed)] * 2) and busy[1] == pytest.approx([m * (3 + 3 * fixed)] * 2)
    model = apply_preset(ModelConfig(), "tiny")
    shared = Cluster(gpus=8, gpu_memory_gib=80, node_size=8, intra_gbps=1e6, tflops=1e-3, overhead_s=0.05, cores=2)
    t = {k: estimate(model, 128, 16, shared, Layout(2, 4, 0, k, 1, 1, 4, False)).step_time_s
         for k in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1)}
    assert t[ScheduleKind.ONE_F_ONE_B] < t[ScheduleKind.ZB_H1]


def _play_buckets(comm: float, window: float, k: int, in_flight: int | None) -> tuple[float, float, float]:
    """Reference for planner/overlap.py, bucket by bucket: (backward stall, tail after it, forward delay)."""
    per, dt = comm / k, window / k
    t, finishes = 0.0, []
    for _ in range(k):  # a reduction starts when its bucket is full and the link is free
        t += dt
        finishes.append(max(t, finishes[-1] if finishes else 0.0) + per)
        if in_flight is not None and len(finishes) > in_flight:
            t = max(t, finishes[-1 - in_flight])  # the backward waits for all but the newest n
    gather = 0.0
    for i in range(1, k + 1):  # gathers all started at once; bucket i's layers wait for it
        gather = max(gather, i * per) + dt
    return t - window, finishes[-1] - t, gather - window


def test_bucketed_collectives_hide_behind_the_compute_beside_them():
    """planner/overlap.py's closed forms equal playing the buckets one by one: a reduction during a
    backward and gathers before a forward are exposed max(C/k, C - T(1 - 1/k)); the in-flight bound
    (ZeRO-2/3's default of one bucket outstanding) stalls the backward instead, adding nothing."""
    import itertools

    from pipezero.planner.overlap import gather_before, reduce_during

    for comm, window, k, n in itertools.product((0.0, 0.2, 0.5, 2.0), (0.0, 0.3, 1.0), (1, 2, 13, 40),
                                                 (None, 1, 3, 50)):
        stall, tail, delay = _play_buckets(comm, window, k, n)
        got = reduce_during(comm, window, k, n)
        assert (got.stall_s, got.tail_s) == pytest.approx((stall, tail), abs=1e-12)
        assert gather_before(comm, window, k) == pytest.approx(delay, abs=1e-12)
    fast, slow = reduce_during(0.2, 1.0, 10, in_flight=1), reduce_during(2.0, 1.0, 10, in_flight=1)
    assert fast.stall_s == 0.0 and fast.tail_s == pytest.approx(0.02)  # only the last bucket shows
    assert slow.stall_s > 0.5 and slow.exposed_s == pytest.approx(reduce_during(2.0, 1.0, 10).exposed_s)


def test_data_parallel_traffic_hides_behind_a_long_backward_and_crossing_bytes_cost_the_host():
    """A step whose backward outlasts its gradient all-reduce shows one bucket's share of it, not all
    of it; the emulated cluster's network CPU (`net_cpu_s_per_gb`) slows a step only for bytes that
    cross a node's link: none when the data-parallel group stays inside a node."""
    from pipezero.config import Placement, ScheduleKind
    from pipezero.models import param_count
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import estimate
    from pipezero.planner.traffic import collective_s

    model = apply_preset(ModelConfig(), "tiny")
    base = dict(gpus=2, gpu_memory_gib=80, node_size=1, intra_gbps=1e6, inter_gbps=0.05, tflops=1e-4, cpu=True,
                bucket_mb=0.25)
    lay = Layout(1, 2, 0, ScheduleKind.ONE_F_ONE_B, 1, 8, 1, False)
    free = estimate(model, 128, 16, Cluster(**{**base, "inter_gbps": 1e6}), lay)
    hidden = estimate(model, 128, 16, Cluster(**base), lay)
    nbytes = 2 * param_count(model)  # bf16 gradients of every parameter
    link = collective_s(Cluster(**base), lay, nbytes)["all_reduce"]
    assert link < free.step_time_s * 2 / 3  # the backward is longer than the transfer
    assert 0 < hidden.dp_comm_s < 0.2 * link
    assert hidden.step_time_s == pytest.approx(free.step_time_s + hidden.dp_comm_s, rel=1e-6)
    busy = estimate(model, 128, 16, Cluster(**base, net_cpu_s_per_gb=10.0, cores=2), lay)
    # a ring of 2 over 2 nodes crosses both links, half the buffer each way, twice; what moved while
    # the ranks waited ran on idle cores
    behind = 2 * nbytes * (1 - hidden.dp_comm_s / link)
    assert busy.step_time_s - hidden.step_time_s == pytest.approx(10.0 * behind / 1e9 / 2, rel=1e-6)
    inside = dict(base, gpus=4, node_size=2, inter_gbps=1e6)
    pp2 = Layout(2, 2, 0, ScheduleKind.ONE_F_ONE_B, 1, 2, 4, False, placement=Placement.DP_INNER)
    quiet, noisy = (estimate(model, 128, 16, Cluster(**inside, net_cpu_s_per_gb=c, cores=4), pp2)
                    for c in (0.0, 10.0))
    hops = 2 * 4 * 2 * (2 * 2 * 128 * model.dim)  # one boundary both ways, M=4, D=2; 2 bytes x B=2 x 128 x dim
    assert noisy.step_time_s - quiet.step_time_s == pytest.approx(10.0 * hops / 1e9 / 4, rel=1e-6)


def test_zero_3_gathers_once_a_step_in_a_pipeline_and_every_pass_alone():
    """ZeRO-3 keeps a chunk gathered through the step when P > 1 (one all-gather, waited before the
    first forward) and gathers layer by layer for every forward and backward when P = 1: 2M gathers."""
    from pipezero.config import ScheduleKind
    from pipezero.models import param_count
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import estimate
    from pipezero.planner.traffic import collective_s

    model = apply_preset(ModelConfig(), "tiny")
    slow = Cluster(gpus=4, gpu_memory_gib=80, node_size=4, intra_gbps=0.001, tflops=1e6)
    lay = Layout(1, 4, 3, ScheduleKind.ONE_F_ONE_B, 1, 1, 4, False)
    e = estimate(model, 128, 16, slow, lay)
    took = collective_s(slow, lay, 2 * param_count(model))  # one stage holds every parameter, bf16
    assert e.step_time_s == pytest.approx(8 * took["all_gather"] + took["reduce_scatter"], rel=1e-3)
    pipeline = [estimate(model, 128, 16, slow, Layout(2, 2, z, ScheduleKind.ONE_F_ONE_B, 1, 1, 8, False)).dp_comm_s
                for z in (2, 3)]
    assert pipeline[1] == pytest.approx(pipeline[0])  # one gather and one reduce-scatter, as ZeRO-2


def test_plan_takes_the_compute_and_the_shared_host_as_flags(capsys):
    """`--tflops`/`--mfu` set the compute (half the peak: a compute-bound step twice as long), the
    wire carries fp32 by default with `--device cpu` (train's dtype there),
    `--overhead-ms`, `--cores` and `--net-cpu` describe ranks sharing one host, as the emulated
    cluster's bench tells the planner; a value out of range is one line naming the flag."""
    base = ["plan", "--preset", "tiny", "--nodes", "2", "--gpus-per-node", "2", "--gpu-memory", "8",
            "--global-batch", "16", "--seq-len", "128", "--json", "--top", "1000", "--device", "cpu"]

    def steps(*extra: str) -> dict[tuple, float]:
        assert main([*base, *extra]) == 0
        # the bubble is the played step's (fixed costs and hops wait too): a figure, not the layout
        return {tuple(v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s", "why", "zero3_prefetch",
                                                                  "zero3_prefetch_why", "zero3_unit", "bubble")):
                r["step_time_s"]
                for r in json.loads(capsys.readouterr().out)["layouts"]}

    fast, slow = steps("--tflops", "1e-3"), steps("--tflops", "5e-4")
    assert all(slow[k] == pytest.approx(2 * fast[k], rel=0.02) for k in fast)  # links at 300 GB/s: compute decides
    assert steps("--tflops", "1e-3", "--wire-bytes", "4") == fast != steps("--tflops", "1e-3", "--wire-bytes", "2")
    shared = steps("--tflops", "1e-3", "--cores", "2", "--net-cpu", "12", "--overhead-ms", "3", "--inter-bw", "0.0125")
    assert all(shared[k] > fast[k] for k in fast)
    for bad in (["--mfu", "0"], ["--mfu", "1.5"], ["--cores", "-1"], ["--net-cpu", "-2"], ["--tflops", "0"]):
        assert main([*base, *bad]) == 2
        assert bad[0] in capsys.readouterr().err


def test_cpu_exchanges_cross_the_node_links_as_the_wire_counts():
    """A CPU rank's reduce-scatters and unquantized gathers are direct exchanges: with g ranks of a
    group on each node, (D - g) buffers a group cross the links, and a node's link carries g (D - g) / D
    of one. On the emulated 2 x 2, P=1 D=4 ZeRO-3 (M=2: 4 gathers and a reduce-scatter) the links'
    counters read 136.8 MB a step where the ring's arithmetic said 100.3 and this says 133.8
    (bench/cluster_compressed.py); with one rank of each group a node the exchange is the ring."""
    from pipezero.config import Placement, ScheduleKind
    from pipezero.planner.layouts import Layout
    from pipezero.planner.traffic import crossing_bytes, dp_traffic

    cpu = Cluster(4, 8, node_size=2, inter_gbps=0.0125, cpu=True, wire_bytes=4)
    psi = 1e6
    _, link, crossing = dp_traffic(cpu, Layout(1, 4, 3, ScheduleKind.ONE_F_ONE_B, 1, 2, 2, False), psi, 0.01)
    assert crossing == pytest.approx(5 * 2 * 4 * psi)
    assert link == pytest.approx(5 * 1 * 4 * psi / (2 * 0.0125e9))
    pp2 = Layout(2, 2, 3, ScheduleKind.ONE_F_ONE_B, 1, 2, 4, False, placement=Placement.PP_INNER)
    assert crossing_bytes(cpu, pp2, 1.0) == pytest.approx({"all_reduce": 4.0, "all_gather": 2.0, "reduce_scatter": 2.0})
    gpu = Cluster(4, 8, node_size=2, inter_gbps=0.0125, wire_bytes=4)  # NCCL's rings: unchanged
    assert dp_traffic(gpu, Layout(1, 4, 3, ScheduleKind.ONE_F_ONE_B, 1, 2, 2, False), psi, 0.01)[2] == \
        pytest.approx(5 * 1.5 * 4 * psi)


def test_plan_proposes_int8_traffic_only_where_it_wins(capsys):
    """`plan --compress auto`: every weighed layout also with int8 gathers and reductions (hpZ where it
    applies), kept where that is at least COMPRESS_GAIN faster: over a 0.0125 GB/s link between
    one-rank nodes every data-parallel byte crosses and the int8 twin wins; over a fast one the
    traffic hides and nothing is proposed. The same layouts are weighed either way."""
    from dataclasses import replace

    from pipezero.planner.search import COMPRESS_GAIN, plan_within

    model = apply_preset(ModelConfig(), "tiny")
    slow = Cluster(gpus=4, gpu_memory_gib=16, node_size=1, inter_gbps=0.0125, cpu=True, wire_bytes=4, tflops=0.1)
    plain, auto = (plan_within(model, slow, 128, 8, propose=p) for p in (False, True))
    assert plain.considered == auto.considered and plain.skipped == auto.skipped
    best = auto.fits[0]
    assert best.layout.weight_bits == 8 and best.layout.grad_bits == 8
    assert best.step_time_s <= plain.fits[0].step_time_s * (1 - COMPRESS_GAIN)
    # each layout once, as it is or as its twin
    keys = [(e.layout.pp, e.layout.dp, e.layout.zero, e.layout.schedule, e.layout.placement, e.layout.micro_batch,
             e.layout.microbatches, e.layout.recompute, e.layout.grad_reduce, e.layout.hierarchical, e.layout.partition)
            for e in auto.fits]
    assert len(keys) == len(set(keys)) == len(plain.fits)
    fast = replace(slow, inter_gbps=10, intra_gbps=10)
    assert not any(e.layout.weight_bits or e.layout.grad_bits for e in plan_within(model, fast, 128, 8, propose=True).fits[:5])
    code = main(["plan", "--preset", "tiny", "--gpus", "4", "--gpu-memory", "16", "--compress", "auto",
                 "--quantize-grads", "int8"])
    assert code == 2 and "--compress auto chooses the options itself" in capsys.readouterr().err


def test_plan_refuses_a_bandwidth_both_link_flags_override(capsys):
    """--intra-bw and --inter-bw each replace one half of --bandwidth: with both, it was read by nothing."""
    from one_line import assert_one_line, run_main

    argv = ["plan", "--preset", "tiny", "--gpus", "4", "--gpu-memory", "8", "--intra-bw", "10", "--inter-bw", "1"]
    assert_one_line(*run_main([*argv, "--bandwidth", "100,5"], capsys), "--bandwidth 100,5 is overridden by --intra-bw")
    # both link flags without --bandwidth plan as before: test_placement_follows_the_bandwidths_and_plan_takes_...


def test_plan_offloads_7b_on_one_gpu_where_the_host_holds_it(capsys):
    """7b on one 80 GiB GPU fits only with AdamW's state on the host: plan proposes the offloaded
    layouts, each saying why, within the host memory a node has."""
    argv = ["plan", "--preset", "7b", "--gpus", "1", "--gpu-memory", "80", "--seq-len", "1024", "--global-batch", "8"]
    assert main([*argv, "--host-memory", "256", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layouts"]
    assert rows and all(r["offload"] == "optimizer" for r in rows)
    for r in rows:
        assert r["memory_gib"] <= 80 * 0.9 < r["memory_gib"] + 8 * 6.7e9 / 2**30  # fits offloaded, not without
        assert 16 * 6.7e9 / 2**30 < r["host_gib_per_node"] <= 256 * 0.9
        assert "optimizer offloaded: without it" in r["why"] and "CPU AdamW add" in r["why"]
    code, err = run_main([*argv, "--host-memory", "64"], capsys)
    assert_one_line(code, err, "--offload optimizer fits the GPUs")
    need = rows[0]["host_gib_per_node"] / 0.9
    assert f"plan with --host-memory {math.ceil(need)} or more" in err and need > 64


def test_7b_at_4096_tokens_fits_one_80_gib_gpu_offloaded_and_recomputed_a_block_at_a_time(capsys):
    """At 4096 tokens a sequence one 7b micro-batch's activations (about 40 GiB) and the fp32 weights and
    gradients pipezero keeps on the GPU (50.2 GiB) pass 72 GiB even with the optimizer offloaded;
    --recompute, a block at a time, keeps 2.9 GiB of activations: the plan proposes it, offloaded,
    and says why."""
    code = main(["plan", "--preset", "7b", "--gpus", "1", "--gpu-memory", "80", "--host-memory", "256",
                 "--global-batch", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["layouts"]
    best = out["layouts"][0]
    assert best["offload"] == "optimizer" and best["recompute"] and best["memory_gib"] <= 72.0
    assert best["model_states_gib"] > 50 and best["activations_gib"] < 5
    assert "optimizer offloaded: without it" in best["why"] and "recompute" in best["why"]


def test_plan_says_what_the_gpu_lacks_where_offload_is_not_enough(capsys):
    """On a 48 GiB GPU the fp32 weights and gradients alone pass its 43.2 usable GiB, whatever is
    offloaded or recomputed: plan says so."""
    code, err = run_main(["plan", "--preset", "7b", "--gpus", "1", "--gpu-memory", "48", "--host-memory", "256",
                          "--global-batch", "8"], capsys)
    assert_one_line(code, err, "even with --offload optimizer (AdamW's moments off the GPU) the nearest")
    assert "GiB a GPU" in err and "lower --seq-len" in err and "50.2 of fp32 weights and gradients" in err


def test_offload_is_priced_by_its_host_copies_and_cpu_step():
    """An offloaded layout's step pays its updated parameters' gradients down and weights up over
    the host link (4 B each way) and their AdamW on the CPU, at the cluster's rates."""
    from dataclasses import replace

    from pipezero.models import param_count
    from pipezero.planner.search import candidate_layouts, estimate

    model = apply_preset(ModelConfig(), "7b")
    cluster = Cluster(gpus=1, gpu_memory_gib=80, host_memory_gib=256, pcie_gbps=20.0, adamw_params_s=1e9)
    lay = candidate_layouts(model, cluster, 8)[0]
    plain, off = (estimate(model, 1024, 8, cluster, replace(lay, offload=o)) for o in (False, True))
    n = off.host_gib * 2**30 / 16  # updated elements: the whole padded model at D = 1
    assert n == pytest.approx(param_count(model), rel=1e-3)
    assert off.offload_s == pytest.approx(2 * 4 * n / 20e9 + n / 1e9)
    assert off.step_time_s == pytest.approx(plain.step_time_s + off.offload_s)
    assert plain.offload_s == plain.host_gib == 0
    assert plain.memory_gib - off.memory_gib == pytest.approx(8 * n / 2**30)


def test_plan_offers_no_offload_where_layouts_fit_without_it():
    """Offload only adds to a step: where enough layouts fit as they are, none is offloaded."""
    from pipezero.planner.search import plan_within

    model = apply_preset(ModelConfig(), "tiny")
    fits = plan_within(model, Cluster(gpus=2, gpu_memory_gib=80, host_memory_gib=1024), 64, 8, offload=True).fits
    assert len(fits) >= 10 and not any(e.layout.offload for e in fits)


@pytest.mark.parametrize("flag, value", [("--pcie-gbps", "5"), ("--cpu-adamw", "1e9")])
def test_offload_rates_without_host_memory_are_refused_as_unread(flag, value, capsys):
    """The planner offers --offload optimizer only with --host-memory: without it nothing prices the
    host link or the host's AdamW."""
    assert_one_line(*run_main(["plan", "--preset", "1b", "--gpus", "8", "--gpu-memory", "16", flag, value], capsys),
                    f"{flag} {float(value):g} prices --offload optimizer, which plan offers only with --host-memory")


@pytest.mark.parametrize("flags, needle", [
    (["--inter-bw", "0.001"], "--inter-bw 0.001 prices the link between nodes"),
    (["--net-cpu", "1"], "--net-cpu 1 prices the host CPU work of bytes crossing between nodes"),
    (["--device", "cpu", "--gpus", "2", "--gpus-per-node", "2", "--net-cpu", "100"], "--net-cpu 100 prices"),
])
def test_link_rates_between_nodes_on_one_node_are_refused_as_unread(flags, needle, capsys):
    """On one node nothing crosses a node's link: the plan was the same with or without them."""
    argv = ["plan", "--preset", "tiny", "--gpus", "8", "--gpu-memory", "80", *flags]
    code, err = run_main(argv, capsys)
    assert_one_line(code, err, needle)
    assert "is one node of --gpus-per-node" in err, err


def test_the_planner_prices_the_runs_buckets_in_flight():
    """--buckets-in-flight is the run's, not a constant of the planner's: with more reductions left
    in flight a ZeRO-2 backward holds no fewer full gradient buckets (the memory walk of the program)
    and stalls less behind a slow link (reduced every micro-batch here); `--layout auto` weighs every
    layout with the run's value."""
    from dataclasses import replace

    from pipezero.config import GradReduce, ScheduleKind
    from pipezero.planner.layouts import Layout
    from pipezero.planner.search import estimate, plan_within

    model = apply_preset(ModelConfig(), "tiny")
    slow = Cluster(gpus=4, gpu_memory_gib=80, node_size=4, intra_gbps=0.1, tflops=1.0, bucket_mb=0.05)
    lay = Layout(1, 4, 2, ScheduleKind.ONE_F_ONE_B, 1, 1, 4, False, GradReduce.MICROBATCH)
    one, eight = (estimate(model, 128, 16, slow, replace(lay, in_flight=k)) for k in (1, 8))
    assert eight.memory_gib >= one.memory_gib and eight.dp_comm_s < 0.97 * one.dp_comm_s
    ranked = plan_within(model, slow, 128, 16, in_flight=8).fits
    assert ranked and {e.layout.in_flight for e in ranked} == {8}


def test_layout_autos_cluster_takes_each_links_latency_and_the_cpu_its_crossing_bytes_cost():
    """The probe's latencies and the CPU a GB across nodes reach the cluster the choice prices (a
    GPU's collectives leave its host's CPU out of it)."""
    from pipezero.planner.auto import cluster_for
    from pipezero.probe import LinkCost, Probe
    from pipezero.settings import build_config

    cfg = build_config(None, {"model.preset": "tiny"})
    found = Probe("cpu", "fp32", 4, 128, {"F": 0.01, "B": 0.01, "W": 0.01}, 0.05, 1e-4,
                  {"node": LinkCost(1e-4, 1.0, 0.5), "across": LinkCost(2e-3, 0.05, 3.0)})
    cpu = cluster_for(cfg, 4, 2, 1.0, False, found)
    assert (cpu.intra_latency_s, cpu.inter_latency_s, cpu.net_cpu_s_per_gb) == (1e-4, 2e-3, 3.0)
    assert cluster_for(cfg, 4, 2, 1.0, True, found).net_cpu_s_per_gb == 0.0
    one_node = Probe(**{**found.__dict__, "links": {"node": LinkCost(1e-4, 1.0, 0.5)}})
    assert (cluster_for(cfg, 4, 4, 1.0, False, one_node).inter_latency_s,
            cluster_for(cfg, 4, 4, 1.0, False, one_node).net_cpu_s_per_gb) == (1e-4, 0.0)
