"""What makes the planner fast must not change what it answers (bench/planner_speed.py checks whole
requests byte for byte): the caches shared between layouts (bucket plans, decoder shapes, D
paddings, compiled programs and their walk views) keep layouts that differ only in D or the ZeRO
stage apart; the walk's replay of alike reduction runs and backwards equals playing each
instruction; a walk stopped at the memory limit says so exactly where the whole walk would."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipezero.config import DataConfig, GradReduce, ModelConfig, Packing, ParallelConfig, ScheduleKind as K, TrainConfig
from pipezero.models.presets import apply_preset
from pipezero.schedules.program import DataParallel, chunk_markers, hoisted, reducing_backwards, walk_view
from pipezero.planner.layouts import Cluster, Layout
from pipezero.memory.model import build_plan, every_rank, layout_memory, walk
from pipezero.planner.search import GIB, estimate


def small_cfg(**par) -> TrainConfig:
    base = dict(pp=2, dp=2, zero=2, schedule=K.ONE_F_ONE_B, microbatches=4, micro_batch_size=2)
    base.update(par)
    return TrainConfig(model=apply_preset(ModelConfig(), "small"), parallel=ParallelConfig(**base),
                       data=DataConfig(seq_len=64, packing=Packing.CONCAT))


def test_layouts_differing_only_in_d_or_zero_get_their_own_peaks():
    """Cached bucket plans and programs are keyed by all they depend on: D pads the buckets and
    shards the states, the ZeRO stage changes the program; each matches a walk with nothing
    cached before it (a fresh plan, walked every rank)."""
    model = apply_preset(ModelConfig(), "small")
    peaks = {}
    for dp, zero in ((2, 1), (4, 1), (2, 3), (4, 3)):
        lay = Layout(2, dp, zero, K.ONE_F_ONE_B, 1, 2, 4, False, GradReduce.STEP)
        got = layout_memory(model, 64, lay, False, False, 25.0)
        whole = max(every_rank(build_plan(small_cfg(dp=dp, zero=zero, bucket_mb=25.0), False)),
                    key=lambda r: r.peak_bytes)
        assert (got.peak_bytes, got.categories, got.at) == (whole.peak_bytes, whole.categories, whole.at)
        peaks[(dp, zero)] = got.peak_bytes
    assert len(set(peaks.values())) == 4
    assert peaks[(4, 1)] < peaks[(2, 1)] and peaks[(4, 3)] < peaks[(2, 3)]  # sharded states over more ranks


@pytest.mark.parametrize("zero,mode,kind,v", [(2, GradReduce.MICROBATCH, K.ONE_F_ONE_B, 1),
                                              (3, GradReduce.MICROBATCH, K.ZB_V, 2),
                                              (2, GradReduce.STEP, K.INTERLEAVED_1F1B, 2),
                                              (0, GradReduce.STEP, K.ZB_H1, 1)])
def test_replayed_reductions_equal_playing_each(zero, mode, kind, v):
    """A walk that keeps its timeline plays every reduction one by one; without, alike runs from
    alike state are replayed: the same peak, at the same instruction, with the same categories."""
    plan = build_plan(small_cfg(zero=zero, grad_reduce=mode, schedule=kind, virtual_stages=v, microbatches=8,
                                bucket_mb=0.5), False)
    for r in range(len(plan.program.ranks)):
        fast, slow = walk(plan, r), walk(plan, r, keep_timeline=True)
        assert (fast.peak_bytes, fast.at, fast.categories) == (slow.peak_bytes, slow.at, slow.categories)
        assert max(t for _, t in slow.totals) == fast.peak_bytes


def test_walk_view_is_the_chunk_markers():
    """`walk_view` makes `chunk_markers` and `reducing_backwards` in one pass without copying: the
    same instructions, a hoisted reduction keeping its moment, the same reducing positions; its
    runs cover exactly the reductions."""
    for par in (dict(pp=1, dp=4, zero=3, grad_reduce=GradReduce.MICROBATCH),  # layer by layer
                dict(pp=2, dp=2, zero=2, grad_reduce=GradReduce.MICROBATCH, bucket_mb=0.5)):
        prog = build_plan(small_cfg(**par), False).program
        for rank in prog.ranks:
            marked, reducing, runs = walk_view(rank)
            want = chunk_markers(rank)
            plain = [replace(i, at=None) if isinstance(i, DataParallel) else i for i in marked]
            assert [str(i) for i in plain] == [str(i) for i in want] and reducing == reducing_backwards(want)
            covered = {j for start, (end, _) in runs.items() for j in range(start, end)}
            assert covered == {j for j, i in enumerate(want) if isinstance(i, DataParallel)
                               and i.kind.value == "REDUCE_GRAD"}
            assert len(hoisted(rank)) <= len(marked) + len(rank)


def test_an_estimate_cut_short_is_a_miss_exactly_where_the_whole_one_is():
    """With a limit, `estimate` stops the walks once over it and answers None: only where the whole
    estimate is over the limit (also for limits a hair either side of a layout's own figure), and
    else it is the whole estimate (the planner compares that with the limit as before)."""
    model = apply_preset(ModelConfig(), "small")
    cluster = Cluster(gpus=4, gpu_memory_gib=80)
    lays = [Layout(2, 2, z, K.ONE_F_ONE_B, 1, 2, 4, rc) for z in (0, 3) for rc in (False, True)]
    for lay in lays:
        whole = estimate(model, 256, 16, cluster, lay)
        for limit in (whole.memory_gib * (1 - 1e-12), whole.memory_gib, whole.memory_gib * 1.5,
                      whole.memory_gib / 2, (whole.memory_gib * GIB - 1) / GIB):
            cut = estimate(model, 256, 16, cluster, lay, limit)
            assert cut == whole if cut is not None else whole.memory_gib > limit
            if whole.memory_gib > limit * (1 + 1e-6):  # clearly over: cut short
                assert cut is None
