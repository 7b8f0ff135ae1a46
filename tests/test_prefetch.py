"""ZeRO-3's prefetch depth (--zero3-prefetch): where the program starts each layer's gather, what the
memory model counts for it, and the planner's choice for `auto` (planner/prefetch.py). Pure data."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipezero.config import GradReduce, ScheduleKind
from pipezero.errors import ConfigError
from pipezero.schedules.actions import Op
from pipezero.schedules.check import ScheduleError
from pipezero.schedules.bucket_plan import uniform_plan
from pipezero.schedules.layer_plan import Moment
from pipezero.schedules.program import Compute, Kind
from pipezero.schedules.lowering import lower
from pipezero.schedules.program_check import check_program
from pipezero.schedules.program_sim import CommCost, simulate_program
from pipezero.schedules.registry import build_schedule
from pipezero.settings import build_config
from pipezero.planner.layouts import Cluster, Layout
from pipezero.memory.model import _layerwise_gathered, build_plan, prefetch_choice
from pipezero.planner.prefetch import LayerCost, choose_depth, exposed, plan_choice

LAYERS = 6


def program(depth: int, recompute: bool = False):
    s = build_schedule(ScheduleKind.ONE_F_ONE_B, 1, 2, 1)
    return lower(s, 2, 3, GradReduce.STEP, uniform_plan(1, LAYERS, 1000, 2), keep_gathered=False, depth=depth,
                 recompute=recompute)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_layers_gather_starts_depth_layers_ahead_in_forward_and_backward(depth):
    prog = program(depth)
    check_program(prog)  # the checker proves it: gathered before use, dp groups agree, hand-overs match
    order = [u.bucket for u in prog.buckets.layers(0)]  # model order
    index = {u.bucket: u.index for u in prog.buckets.layers(0)}
    computes = [i for i in prog.ranks[0] if isinstance(i, Compute)]
    assert [c.action.op for c in computes] == [Op.F, Op.BW, Op.F, Op.BW]
    for n, ins in enumerate(computes):
        first = order if ins.action.op is Op.F else order[::-1]  # the order this action needs its layers
        gathers = [d for d in ins.during if d.kind is Kind.UNSHARD]
        releases = [d for d in ins.during if d.kind is Kind.RESHARD]
        # across actions: the next action's first depth - 1 layers stay gathered, none past the step
        nxt = computes[n + 1] if n + 1 < len(computes) else None
        want = set((order if nxt.action.op is Op.F else order[::-1])[:depth - 1]) if nxt else set()
        assert ins.kept == want and ins.held == (computes[n - 1].kept if n else frozenset())
        # each layer gathered once (nothing twice), but what the previous action left; each released
        # once, but what this one keeps
        assert sorted(d.bucket for d in gathers) == sorted(set(order) - ins.held)
        assert sorted(d.bucket for d in releases) == sorted(set(order) - ins.kept)
        for k, b in enumerate(first):
            if b in ins.held:
                continue
            at = next(d.at for d in gathers if d.bucket == b)
            moment = Moment.FORWARD if ins.action.op is Op.F else Moment.BACKWARD
            assert (at.moment, at.index) == (moment, index[first[max(0, k - depth)]])
        # only a first layer not kept from before is waited for at once
        assert [d.blocking for d in gathers] == [not ins.held] + [False] * (len(gathers) - 1)
        # at most depth + 1 layers are gathered or in flight (in backward the memory model adds the
        # layer just done, which autograd may still hold: memory/model.py)
        live, most = set(ins.held), len(ins.held)
        for d in ins.during:
            if d.kind is Kind.UNSHARD:
                live.add(d.bucket)
            elif d.kind is Kind.RESHARD:
                live.discard(d.bucket)
            most = max(most, len(live))
        assert live == ins.kept
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


def test_deeper_prefetch_hides_more_on_a_slow_link_within_memory():
    slow = bench_like(0.063)  # a block's gather a little slower than its forward, reductions queued on the link
    times = [exposed(slow, d) for d in range(1, 6)]
    assert all(b < a for a, b in zip(times, times[1:]))  # each layer deeper hides more (and keeps one more)
    assert choose_depth(slow).depth == 5 and choose_depth(slow).exposed_s == pytest.approx(times)
    capped = choose_depth(slow, fits=lambda d: d <= 2)
    assert capped.depth == 2 and "memory" in capped.why
    fast = bench_like(0.0005)  # the link keeps up: nothing left to hide
    assert choose_depth(fast).depth == 1 and "deeper hides no more" in choose_depth(fast).why


def test_the_planner_prefetches_deeper_on_the_slower_link():
    model = config().model
    lay = Layout(1, 2, 3, ScheduleKind.ONE_F_ONE_B, 1, 8, 1, False)

    def depth(inter_gbps: float) -> int:
        cluster = Cluster(2, 8, node_size=1, intra_gbps=1e3, inter_gbps=inter_gbps, tflops=0.05, mfu=1.0,
                          wire_bytes=4, cpu=True, bucket_mb=1)
        choice = plan_choice(model, 128, cluster, lay, 2**30)
        assert choice is not None and choice.why
        return choice.depth

    assert depth(0.0125) > depth(0.0625) > depth(10.0) == 1
    assert plan_choice(model, 128, Cluster(2, 8), Layout(2, 1, 3, ScheduleKind.ONE_F_ONE_B, 1, 8, 2, False), 1e9) is None


def test_auto_in_a_run_needs_the_link_and_says_why():
    with pytest.raises(ConfigError, match="--link-gbps"):
        config(**{"parallel.zero3_prefetch": "auto"})
    with pytest.raises(ConfigError, match="--zero3-prefetch auto"):
        config(**{"parallel.link_gbps": "0.05"})
    slow = prefetch_choice(config(**{"parallel.zero3_prefetch": "auto", "parallel.link_gbps": "0.1",
                                     "parallel.tflops": "0.05", "data.seq_len": "128"}))
    fast = prefetch_choice(config(**{"parallel.zero3_prefetch": "auto", "parallel.link_gbps": "10",
                                     "parallel.tflops": "0.05", "data.seq_len": "128"}))
    assert slow.depth > fast.depth == 1  # the slower link, deeper
    assert "hides no more" in slow.why and slow.exposed_s[slow.depth - 1] < slow.exposed_s[0]
    assert build_plan(config(**{"parallel.zero3_prefetch": "auto", "parallel.link_gbps": "10"})).depth == 1


def test_the_checker_refuses_a_hand_over_the_next_action_does_not_begin_with():
    prog = program(3)
    ranks = [list(r) for r in prog.ranks]
    for r in ranks:
        k = next(i for i, ins in enumerate(r) if isinstance(ins, Compute) and ins.held)
        r[k] = replace(r[k], held=frozenset())  # as if the previous action had released what it kept
    with pytest.raises(ScheduleError, match="begins with buckets"):
        check_program(replace(prog, ranks=tuple(tuple(r) for r in ranks)))
    last = [list(r) for r in prog.ranks]
    for r in last:
        k = max(i for i, ins in enumerate(r) if isinstance(ins, Compute))
        r[k] = replace(r[k], kept=frozenset({0}))  # a layer kept past the optimizer step
    with pytest.raises(ScheduleError, match="past the\\s+optimizer step|stay gathered"):
        check_program(replace(prog, ranks=tuple(tuple(r) for r in last)))


def test_the_planner_counts_the_gathers_a_deeper_prefetch_keeps():
    """What the planner prices is what the compiled program sends: at depth N a forward hands its last
    N - 1 layers to its backward and a backward its first N - 1 to the next micro-batch's forward, so
    those gathers are not sent again (the bench measured 19.14 -> 14.42 MiB a step at depth 5)."""
    from pipezero.schedules.program import DataParallel, flat
    from pipezero.planner.search import estimate

    cfg = config()
    p = cfg.parallel
    cluster = Cluster(2, 8, node_size=1, intra_gbps=1e3, inter_gbps=1.0, tflops=0.05, mfu=1.0, wire_bytes=4, cpu=True,
                      bucket_mb=1)

    def sent(depth: int) -> tuple[float, float]:
        prog = build_plan(config(**{"parallel.zero3_prefetch": str(depth)})).program
        program = sum(i.nbytes for i in flat(prog.ranks[0]) if isinstance(i, DataParallel)
                      and i.kind in (Kind.UNSHARD, Kind.REDUCE_GRAD))
        lay = Layout(1, 2, 3, ScheduleKind.ONE_F_ONE_B, 1, p.micro_batch_size, p.microbatches, False, prefetch=depth)
        est = estimate(cfg.model, cfg.data.seq_len, p.micro_batch_size * p.microbatches * 2, cluster, lay)
        assert est is not None
        return program, est.crossing_bytes

    base_program, base_planned = sent(1)
    for depth in (2, 3, 5):
        program, planned = sent(depth)
        assert program < base_program
        assert planned / base_planned == pytest.approx(program / base_program, rel=1e-3)
    recompute = Layout(1, 2, 3, ScheduleKind.ONE_F_ONE_B, 1, p.micro_batch_size, p.microbatches, True, prefetch=5)
    assert estimate(cfg.model, cfg.data.seq_len, 2 * p.micro_batch_size * p.microbatches, cluster,
                    recompute).crossing_bytes == pytest.approx(
        estimate(cfg.model, cfg.data.seq_len, 2 * p.micro_batch_size * p.microbatches, cluster,
                 replace(recompute, prefetch=1)).crossing_bytes)  # with recompute nothing is kept


@pytest.mark.parametrize("argv, needle", [
    (["--zero3-prefetch", "2"], "--zero3-prefetch 2 applies with --zero3-layerwise"),
    (["--zero3-layerwise", "--zero3-prefetch-chunk"], "--zero3-prefetch-chunk prefetches a chunk kept gathered"),
])
def test_simulate_refuses_a_prefetch_flag_its_layout_does_not_read(argv, needle, capsys):
    """simulate's timing: the depth is read only layer by layer, the chunk what-if only kept
    gathered; each exited 0 unread. (train refuses --zero3-prefetch where ZeRO-3 keeps chunks gathered.)"""
    from one_line import assert_one_line, run_main

    assert_one_line(*run_main(["simulate", "--zero", "3", "--dp", "2", *argv, "--json"], capsys), needle)
