"""ZeRO-3's prefetch depth (--zero3-prefetch): where the program starts each layer's gather, what the
memory model counts for it, and the planner's choice for `auto` (sim/prefetch.py). Pure data."""

from __future__ import annotations

import pytest

from pipezero.config import GradReduce, ScheduleKind
from pipezero.errors import ConfigError
from pipezero.schedules.actions import Op
from pipezero.schedules.bucket_plan import uniform_plan
from pipezero.schedules.layer_plan import Moment
from pipezero.schedules.program import Compute, Kind, lower
from pipezero.schedules.program_check import check_program
from pipezero.schedules.program_sim import CommCost, simulate_program
from pipezero.schedules.registry import build_schedule
from pipezero.settings import build_config
from pipezero.sim.layouts import Cluster, Layout
from pipezero.sim.memory import _layerwise_gathered, build_plan, prefetch_choice
from pipezero.sim.prefetch import LayerCost, choose, exposed, plan_choice

LAYERS = 6


def program(depth: int, recompute: bool = False):
    s = build_schedule(ScheduleKind.ONE_F_ONE_B, 1, 2, 1)
    return lower(s, 2, 3, GradReduce.STEP, uniform_plan(1, LAYERS, 1000, 2), keep_gathered=False, depth=depth,
                 recompute=recompute)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_layers_gather_starts_depth_layers_ahead_in_forward_and_backward(depth):
    prog = program(depth)
    check_program(prog)  # the checker proves it: gathered before use, dp groups agree
    order = [u.bucket for u in prog.buckets.layers(0)]  # model order
    index = {u.bucket: u.index for u in prog.buckets.layers(0)}
    for ins in prog.ranks[0]:
        if not isinstance(ins, Compute):
            continue
        gathers = [d for d in ins.during if d.kind is Kind.UNSHARD]
        releases = [d for d in ins.during if d.kind is Kind.RESHARD]
        assert sorted(d.bucket for d in gathers) == sorted(order)  # each layer once: nothing gathered twice
        assert sorted(d.bucket for d in releases) == sorted(order)  # and every one released in the action
        if ins.action.op is Op.F:
            for k, b in enumerate(order):
                at = next(d.at for d in gathers if d.bucket == b)
                assert (at.moment, at.index) == (Moment.FORWARD, index[order[max(0, k - depth)]])
        else:
            back = order[::-1]
            for k, b in enumerate(back):
                at = next(d.at for d in gathers if d.bucket == b)
                assert (at.moment, at.index) == (Moment.BACKWARD, index[back[max(0, k - depth)]])
        assert [d.blocking for d in gathers] == [True] + [False] * (LAYERS - 1)  # only the first waited at once
        # nothing outlives the action, and at most depth + 1 layers are gathered or in flight (in backward
        # the memory model adds the layer just done, which autograd may still hold: sim/memory.py)
        live, most = set(), 0
        for d in ins.during:
            if d.kind is Kind.UNSHARD:
                live.add(d.bucket)
            elif d.kind is Kind.RESHARD:
                live.discard(d.bucket)
            most = max(most, len(live))
        assert not live
        assert most == min(LAYERS, depth + 1)


@pytest.mark.parametrize("depth", [2, 3])
def test_deeper_programs_check_and_play_with_recompute(depth):
    prog = program(depth, recompute=True)
    check_program(prog)
    assert simulate_program(prog, comm=CommCost(bandwidth=1e4)).step_time > 0


def config(**extra: str):
    return build_config(None, {"model.preset": "tiny", "model.n_layers": "4", "parallel.dp": "2",
                               "parallel.zero": "3", "parallel.microbatches": "2", **extra})


def test_the_memory_model_counts_the_layers_gathered_ahead():
    plans = {d: build_plan(config(**{"parallel.zero3_prefetch": str(d)})) for d in (1, 2, 3)}
    layers = [n for n in plans[1].chunk_params[0] if n > 0]
    for d, plan in plans.items():
        assert plan.depth == d and plan.program.depth == d
        for span in (2, 3):  # forward: d + 1 layers, backward one more (the layer just done)
            most = max(sum(layers[i:i + span + d - 1]) for i in range(len(layers)))
            assert _layerwise_gathered(plan, 0, span) == 4 * most
    assert _layerwise_gathered(plans[1], 0, 2) < _layerwise_gathered(plans[2], 0, 2) < _layerwise_gathered(plans[3], 0, 2)


def bench_like(gather_s: float) -> list[LayerCost]:
    """The bench's block-dominated model at D = 2: a small embedding and head around four blocks whose
    forward takes 55 ms, each layer's reduction twice its gather (gloo's reduce-scatter)."""
    small = gather_s * 0.08
    return [LayerCost(0.001, small, 2 * small)] + [LayerCost(0.055, gather_s, 2 * gather_s)] * 4 + \
        [LayerCost(0.01, small, 2 * small)]


def test_deeper_prefetch_hides_more_only_where_the_link_idled():
    idle = bench_like(0.063)  # a block's gather a little slower than its forward: the reductions queue ahead
    assert exposed(idle, 2) < exposed(idle, 1) - 0.01
    assert exposed(idle, 3) == pytest.approx(exposed(idle, 2))
    assert choose(idle).depth == 2
    busy = bench_like(0.4)  # the link never idles: depth 1 already keeps it busy
    assert exposed(busy, 3) == pytest.approx(exposed(busy, 1))
    assert choose(busy).depth == 1
    assert choose(idle, fits=lambda d: d < 2).depth == 1  # memory caps it
    assert "memory" in choose(idle, fits=lambda d: d < 2).why


def test_the_planner_prefetches_deeper_on_the_slower_link():
    model = config().model
    lay = Layout(1, 2, 3, ScheduleKind.ONE_F_ONE_B, 1, 8, 1, False)

    def depth(inter_gbps: float) -> int:
        cluster = Cluster(2, 8, node_size=1, intra_gbps=1e3, inter_gbps=inter_gbps, tflops=0.05, mfu=1.0,
                          wire_bytes=4, cpu=True, bucket_mb=1)
        choice = plan_choice(model, 128, cluster, lay, 2**30)
        assert choice is not None and choice.why
        return choice.depth

    assert depth(0.0625) > depth(1.0) == 1
    assert plan_choice(model, 128, Cluster(2, 8), Layout(2, 1, 3, ScheduleKind.ONE_F_ONE_B, 1, 8, 2, False), 1e9) is None


def test_auto_in_a_run_needs_the_link_and_says_why():
    with pytest.raises(ConfigError, match="--link-gbps"):
        config(**{"parallel.zero3_prefetch": "auto"})
    with pytest.raises(ConfigError, match="--zero3-prefetch auto"):
        config(**{"parallel.link_gbps": "0.05"})
    slow = prefetch_choice(config(**{"parallel.zero3_prefetch": "auto", "parallel.link_gbps": "0.1",
                                     "parallel.tflops": "0.05", "data.seq_len": "128"}))
    fast = prefetch_choice(config(**{"parallel.zero3_prefetch": "auto", "parallel.link_gbps": "1",
                                     "parallel.tflops": "0.05", "data.seq_len": "128"}))
    assert slow.depth == 2 and fast.depth == 1  # the slower link, deeper
    assert "hides no more" in slow.why and slow.exposed_s[1] < slow.exposed_s[0]
    assert build_plan(config(**{"parallel.zero3_prefetch": "auto", "parallel.link_gbps": "10"})).depth == 1
