"""Interleaved 1F1B for every M (issue 28, item 6): rounds of unequal size where M is not a multiple
of max(1, M // P), proven by the checker, lowered and posted safely, compared with torch's order.
One process, no ranks started: the training against one process is in tests/test_pipeline.py."""

from types import SimpleNamespace

import pytest

from pipezero.config import GradReduce
from pipezero.config import ScheduleKind as K
from pipezero.schedules.actions import Action, Op, ChunkPlacement, Schedule
from pipezero.schedules.bucket_plan import uniform_plan
from pipezero.schedules.check import ScheduleError, simulate
from pipezero.schedules.posting import plans, verify
from pipezero.schedules.lowering import lower
from pipezero.schedules.program_check import check_program
from pipezero.schedules.registry import build_schedule

LAYOUTS = [(p, m, v) for p in (2, 3, 4) for v in (2, 3) for m in range(1, 3 * p + 2)]


def ideal_bubble(p: int, m: int, v: int) -> float:
    """Narayanan et al. 2021's interleaved bubble at F = B: (P-1) ramp slots over V*M chunk-steps."""
    return (p - 1) / (v * m + p - 1)


@pytest.mark.parametrize("p, m, v", LAYOUTS, ids=str)
def test_every_m_is_accepted_complete_deadlock_free_and_posts_safely(p, m, v):
    s = build_schedule(K.INTERLEAVED_1F1B, p, m, v)
    r = simulate(s)  # raises on an incomplete or deadlocking order
    verify(s, plans(s, r))  # the transfer posting order cannot deadlock on per-pair streams
    if m >= p:  # a round of at least P micro-batches keeps every rank busy after the ramp
        assert r.bubble == pytest.approx(ideal_bubble(p, m, v), abs=1e-12)


def test_rounds_of_p_2_m_5_are_3_then_2():
    """max(1, 5 // 2) = 2 rounds: the first takes the odd micro-batch, so the warm-up (sized by the
    first round, as Megatron and torch size it) covers every later, no larger, round."""
    s = build_schedule(K.INTERLEAVED_1F1B, 2, 5, 2)
    forwards = [str(a) for a in s.actions[0] if a.op is Op.F]
    assert forwards == ["0F0", "0F1", "0F2", "2F0", "2F1", "2F2", "0F3", "0F4", "2F3", "2F4"]
    backwards = [str(a) for a in s.actions[0] if a.op is Op.BW]
    assert backwards == ["2BW0", "2BW1", "2BW2", "0BW0", "0BW1", "0BW2", "2BW3", "2BW4", "0BW3", "0BW4"]


def torch_interleaved(p: int, m: int, v: int) -> Schedule:
    """torch 2.13's ScheduleInterleaved1F1B order in our notation, its round check bypassed (the
    fields its constructor sets, set by hand, with no process group)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    ref = object.__new__(ScheduleInterleaved1F1B)
    rounds = max(1, m // p)
    ref.pp_group_size, ref._n_microbatches, ref.n_local_stages = p, m, v
    ref.number_of_rounds, ref.microbatches_per_round = rounds, m // rounds
    op = {"FORWARD": Op.F, "FULL_BACKWARD": Op.BW}
    ranks = tuple(tuple(Action(a.stage_index, op[a.computation_type.name], a.microbatch_index)
                        for a in ref._calculate_single_rank_operations(r) if a is not None) for r in range(p))
    return Schedule("torch-interleaved-1f1b", p, m, v, ChunkPlacement.LOOP, ranks)


def test_torch_refuses_p_2_m_5_and_its_formula_there_is_no_schedule():
    """The issue says torch 2.13 runs P=2, M=5: it does not. Its constructor raises, and its order
    with the check bypassed gives chunk 0 a sixth micro-batch, which the checker rejects."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    stages = [SimpleNamespace(group_size=2, group_rank=0, num_stages=4, stage_index=c) for c in (0, 2)]
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        ScheduleInterleaved1F1B(stages, 5)
    with pytest.raises(ScheduleError, match="outside 0..4"):
        simulate(torch_interleaved(2, 5, 2))


def torch_accepts(p: int, m: int) -> bool:
    return m % max(1, m // p) == 0


REFUSED_BY_TORCH = [(p, m, v) for p, m, v in LAYOUTS if not torch_accepts(p, m)]


@pytest.mark.parametrize("p, m, v", REFUSED_BY_TORCH, ids=str)
def test_idle_and_memory_against_torchs_order_at_the_nearest_m_it_takes(p, m, v):
    """Where torch refuses M, compare with its orders at the nearest M either side that it takes:
    every rank idles exactly as long (the ramp is the same, only the steady state is longer), and
    holds V-1 more activations than at the M below, whose R rounds are one micro-batch shorter
    where ours are larger: the warm-up is sized by the first, larger round."""
    ours = simulate(build_schedule(K.INTERLEAVED_1F1B, p, m, v))
    below = max(x for x in range(1, m) if torch_accepts(p, x))
    above = min(x for x in range(m + 1, 2 * m) if torch_accepts(p, x))
    for other in (below, above):
        assert ours.idle == pytest.approx(simulate(torch_interleaved(p, other, v)).idle, abs=1e-9), other
    lower = simulate(torch_interleaved(p, below, v)).peak_activations
    assert ours.peak_activations == [x + v - 1 for x in lower]


@pytest.mark.parametrize("zero", range(4))
@pytest.mark.parametrize("d", [1, 2])
def test_p_2_m_5_lowers_at_every_zero_stage_and_passes_the_program_checker(zero, d):
    s = build_schedule(K.INTERLEAVED_1F1B, 2, 5, 2)
    for mode in GradReduce if zero >= 2 else [GradReduce.STEP]:
        check_program(lower(s, d, zero, mode, uniform_plan(s.n_chunks, 3, 1000, d)))
