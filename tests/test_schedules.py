"""Schedules are pure data: every generator is checked by the simulator without processes or torch."""

import dataclasses
import functools
import json

import pytest

from pipezero.cli import main
from pipezero.config import ScheduleKind as K
from pipezero.schedules.actions import Action, Op
from pipezero.schedules.check import CostModel, ScheduleError, SimResult, simulate
from pipezero.schedules.registry import build_schedule, default_virtual

V_OF = {kind: default_virtual(kind) for kind in K}


built = functools.lru_cache(maxsize=None)(build_schedule)  # schedules are frozen: one a layout is shared


@functools.lru_cache(maxsize=None)
def _played(kind: K, p: int, m: int, v: int, cost: CostModel) -> SimResult:
    return simulate(built(kind, p, m, v), cost)


def played(kind: K, p: int, m: int, v: int = 1, cost: CostModel | None = None) -> SimResult:
    """The simulation of `kind` at (P, M, V) under `cost`, once a process: the proof of every
    generator and the tests of the bubble and memory formulas below read the same plays (about
    half the module's time was simulating them again). Read only: never change what it returns.
    A layout the schedule refuses raises ValueError each time."""
    return _played(kind, p, m, v, cost or CostModel())


def m_values(p):
    """M from 1 to 4P: the edges and the interesting middle, without all 4P values per P."""
    return sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 1, 4 * p} - {0})


def layouts(pps=range(2, 17)):
    """(kind, P, M, V) of every layout a generator accepts, M from `m_values`, V the kind's default."""
    for kind in K:
        for p in pps:
            for m in m_values(p):
                v = V_OF.get(kind, 1)
                try:
                    built(kind, p, m, v)
                except ValueError:
                    continue
                yield kind, p, m, v


@pytest.mark.parametrize("pps, least", [
    (range(2, 9), 450),  # P up to 8: the fast lane
    pytest.param(range(9, 17), 550, marks=pytest.mark.distributed),  # full lane: twice the time of P <= 8
])
def test_every_generator_passes_the_checker(pps, least):
    count = 0
    for kind, p, m, v in layouts(pps):
        played(kind, p, m, v)  # raises on an incomplete, misplaced or deadlocking schedule
        count += 1
    assert count > least


# P up to 8 in the fast lane; 9 to 16 (six times the simulation) in the full lane
FAST_AND_FULL = [range(2, 9), pytest.param(range(9, 17), marks=pytest.mark.distributed)]


@pytest.mark.parametrize("pps", FAST_AND_FULL)
@pytest.mark.parametrize("kind", [K.GPIPE, K.ONE_F_ONE_B])
def test_gpipe_and_1f1b_bubble_formula(kind, pps):
    for p in pps:
        for m in m_values(p):
            r = played(kind, p, m)
            assert r.bubble == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)


@pytest.mark.parametrize("pps", FAST_AND_FULL)
def test_peak_activations_gpipe_m_and_1f1b_p_minus_rank(pps):
    for p in pps:
        for m in [x for x in m_values(p) if x >= p]:
            assert played(K.GPIPE, p, m).peak_activations == [m] * p
            assert played(K.ONE_F_ONE_B, p, m).peak_activations == [p - r for r in range(p)]


def test_interleaved_bubble_formula():
    for p in range(2, 9):
        for v in (2, 3, 4):
            for m in range(p, 4 * p + 1, p):
                r = played(K.INTERLEAVED_1F1B, p, m, v)
                assert r.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)


@pytest.mark.parametrize("cost", [(1, 1, 1), (1, 2, 1), (1, 1.5, 0.5), (2, 2, 1)])
def test_zb_h1_idle_and_memory(cost):
    """Qi et al. 2024, Table 2 / sec 2.1: ZB-H1 bubble (p-1)(T_F+T_B-T_W), peak memory p M_B (= 1F1B)."""
    f, b, w = cost
    for p in range(2, 13):
        for m in [x for x in m_values(p) if x >= p]:
            r = played(K.ZB_H1, p, m, cost=CostModel(f, b, w))
            assert r.idle == pytest.approx([(p - 1) * (f + b - w)] * p), (p, m)
            assert r.peak_activations[0] == p and max(r.peak_activations) == p
    one = played(K.ONE_F_ONE_B, 4, 8).idle[0]
    assert played(K.ZB_H1, 4, 8).idle[0] == pytest.approx(one / 3)


def steady_idle(s, cost=None):
    """Idle a step in steady state when steps run back to back with no barrier between them (the
    paper's optimizer post-validation): the period of three repeats minus two, less the work."""
    def repeat(k):
        acts = tuple(tuple(Action(a.chunk, a.op, a.mb + i * s.microbatches) for i in range(k) for a in r)
                     for r in s.actions)
        return dataclasses.replace(s, microbatches=s.microbatches * k, actions=acts)
    return simulate(repeat(3), cost).step_time - simulate(repeat(2), cost).step_time - 3 * s.microbatches


def test_zb_h2_memory_and_bubble():
    """Qi et al. 2024, Table 2 / sec 2.2: ZB-H2 peak memory (2p-1) M_B, bubble (p-1)(T_F+T_B-2T_W) = 0
    at equal costs with post-validation. Under our synchronous step the forward ramp (p-1)T_F stays."""
    for p in range(2, 9):
        for m in [x for x in m_values(p) if x >= 2 * p]:
            s = built(K.ZB_H2, p, m)
            r = played(K.ZB_H2, p, m)
            assert r.peak_activations[0] == 2 * p - 1 and max(r.peak_activations) == 2 * p - 1
            assert r.idle == pytest.approx([(p - 1) * 1.0] * p)
            assert steady_idle(s) == pytest.approx(0.0)
    assert steady_idle(build_schedule(K.ONE_F_ONE_B, 4, 16)) == pytest.approx(9.0)  # 1F1B keeps (p-1)(F+B+W)
    assert steady_idle(build_schedule(K.ZB_V, 4, 16, 2)) == pytest.approx(0.0)  # ZB-V: zero at F=B=W too


def test_zb_v_and_dualpipe_v_published_figures():
    """ZB-V (arXiv 2405.15362 / sail-sg comparison table at T_F=T_B=T_W): activation memory equal to
    1F1B's (2p half-size chunks = p stages) and zero bubble in steady state (asserted in
    test_zb_h2_memory_and_bubble); a synchronous step keeps the ramp of one chunk forward per rank,
    (p-1) T_F / 2. DualPipeV (DeepSeek DualPipe README table): activation per device PP+1 chunks with
    PP = 2p stages, asserted. Its bubble (PP/2-1)(F&B+B-3W), B a full backward, is (p-1)(F+2B-W) in
    input-gradient units without compute overlap = (p-1) x 1.0 here; our order idles (p-1) x 0.5,
    less than that bound, because nothing here forces the F&B pairs to run as one unit."""
    for p in range(2, 13):
        for m in [x for x in m_values(p) if x >= 2 * p]:
            zbv = played(K.ZB_V, p, m, 2)
            assert zbv.peak_activations == [2 * p] * p
            assert zbv.peak_activation_memory == pytest.approx([p] * p)  # = 1F1B's rank-0 peak
            assert zbv.idle == pytest.approx([(p - 1) * 0.5] * p)
            dpv = played(K.DUALPIPE_V, p, m, 2)
            assert dpv.peak_activations == [2 * p + 1] * p
            assert dpv.idle == pytest.approx([(p - 1) * 0.5] * p)


def v_half_idle(p: int) -> float:
    """V-Half's idle a rank at F = B = W (stage units) once M > P // 2: the fill and drain of its block.

    Its steady state idles nowhere (every six slots a rank runs one micro-batch's six passes), so
    the idle is the same whatever M, and the same on every rank (the step ends together, each rank
    busy 3M). Played, the fill and drain cost 7/4 a stage of the pipeline's depth, 7(P-1)/4, plus a
    quarter of the `gap` idle slots that keep even P's blocks apart (3 for even P, 0 for odd).
    1F1B idles 3(P-1): V-Half's is 7/12 of it plus at most 3/4."""
    return (7 * (p - 1) + (3 if p % 2 == 0 else 0)) / 4


def test_v_half_memory_is_half_of_1f1b_and_its_bubble_below():
    """V-Half (arXiv 2405.15362, sail-sg's comparison table at T_F=T_B=T_W): activation memory
    (P+2)//2 micro-batches of a stage against 1F1B's P, bubble rate ~P/2M against 1F1B's ~P/M.
    Asserted: the peak is exactly (P+2)//2 stages on every rank once M > P (never above it for any
    M), the idle is `v_half_idle` on every rank for M > P // 2, below 1F1B's wherever M >= 2."""
    for p in range(2, 9):
        for m in m_values(p):
            r = played(K.V_HALF, p, m, 2)
            one = played(K.ONE_F_ONE_B, p, m)
            assert max(r.peak_activation_memory) <= (p + 2) // 2 <= p / 2 + 1, (p, m)
            if m > p:
                assert r.peak_activation_memory == [(p + 2) // 2] * p, (p, m)
            if m > p // 2:
                assert r.idle == pytest.approx([v_half_idle(p)] * p), (p, m)
            if m >= 2:
                assert r.step_time < one.step_time, (p, m)
    # the paper's ~P/2M: P = 8, M = 32 plays 13 idle a rank over a step of 109 (1F1B: 21 over 117)
    r = simulate(build_schedule(K.V_HALF, 8, 32, 2))
    assert r.bubble == pytest.approx(13 / 109) and 8 / 64 - 0.01 < r.bubble < 8 / 64


def test_v_half_blocks_never_collide():
    """The four F and B passes of a rank's block sit on distinct slots modulo 6 for every P (the
    repeated blocks share no slot), and each block keeps its own dependencies: F down the V one
    rank per two slots, back up one per slot, B after its F and its successor's B."""
    from pipezero.schedules.generators import _v_half_block

    for p in range(1, 65):
        gap = 3 if p % 2 == 0 else 0
        blocks = [{(which, op): s for s, (which, op) in _v_half_block(p, r, gap).items()} for r in range(p)]
        for r, b in enumerate(blocks):
            assert len({s % 6 for s in b.values()}) == 4, (p, r)
            assert b[(1, Op.F)] > b[(0, Op.F)] and b[(1, Op.B)] > b[(1, Op.F)] and b[(0, Op.B)] > b[(1, Op.B)]
            if r + 1 < p:  # the next rank down
                nxt = blocks[r + 1]
                assert nxt[(0, Op.F)] > b[(0, Op.F)] and b[(1, Op.F)] > nxt[(1, Op.F)]
                assert nxt[(1, Op.B)] > b[(1, Op.B)] and b[(0, Op.B)] > nxt[(0, Op.B)]
        last = blocks[-1]
        assert last[(1, Op.F)] > last[(0, Op.F)] and last[(0, Op.B)] > last[(1, Op.B)]  # the V's turn


def test_layout_errors_name_allowed_values():
    with pytest.raises(ValueError, match="--virtual-stages 2"):
        build_schedule(K.ZB_V, 4, 8, 3)
    with pytest.raises(ValueError, match=">= 2 x --pp = 8"):
        build_schedule(K.DUALPIPE_V, 4, 7, 2)
    with pytest.raises(ValueError, match="--virtual-stages 2"):
        build_schedule(K.V_HALF, 4, 8, 1)


def _edit(s, rank, fn):
    acts = list(s.actions)
    acts[rank] = tuple(fn(list(acts[rank])))
    return dataclasses.replace(s, actions=tuple(acts))


def test_checker_rejects_missing_w():
    s = build_schedule(K.ZB_H1, 3, 4)
    broken = _edit(s, 1, lambda a: [x for x in a if x != Action(1, Op.W, 2)])
    with pytest.raises(ScheduleError, match=r"rank 1: chunk 1, micro-batch 2 has B x1, W x0"):
        simulate(broken)


def test_checker_rejects_b_before_its_f():
    s = build_schedule(K.ONE_F_ONE_B, 2, 2)

    def swap(a):
        i, j = a.index(Action(1, Op.F, 1)), a.index(Action(1, Op.BW, 1))
        a[i], a[j] = a[j], a[i]
        return a
    with pytest.raises(ScheduleError, match=r"rank 1: action 1BW1 waits for 1F1 on rank 1"):
        simulate(_edit(s, 1, swap))


def test_checker_rejects_deadlocking_cycle():
    s = build_schedule(K.GPIPE, 2, 2)
    # rank 0 insists on a backward before its second forward; rank 1 waits for that forward first.
    s = _edit(s, 0, lambda a: [Action(0, Op.F, 0), Action(0, Op.BW, 0), Action(0, Op.F, 1), Action(0, Op.BW, 1)])
    s = _edit(s, 1, lambda a: [Action(1, Op.F, 0), Action(1, Op.F, 1), Action(1, Op.BW, 1), Action(1, Op.BW, 0)])
    with pytest.raises(ScheduleError) as err:
        simulate(s)
    msg = str(err.value)
    assert "deadlocks" in msg and "rank 0: action 0BW0 waits for 1B0 on rank 1" in msg
    assert "rank 1: action 1F1 waits for 0F1 on rank 0" in msg
    # the grid points at the first stuck rank's action, and only there
    assert msg.count("ERROR HERE") == 1
    assert "rank 0:   0F0  0BW0   0F1  0BW1   <-- ERROR HERE (action #1: 0BW0)" in msg


def test_posting_plans_agree_between_ranks_and_cannot_deadlock_on_ordered_streams():
    """NCCL ignores tags and runs a rank pair's transfers on one stream in posting order. Every
    schedule's plan must (a) post a pair's transfers in the same order at both ends, (b) post each
    receive before the action that consumes it, (c) pass `verify` (no cycle among stream order,
    compute order and CPU waits), and (d) never hold more receive buffers than the rank's own
    peak activations."""
    from pipezero.schedules.posting import plans, receives, transfer_in, verify

    count = 0
    for kind in K:
        for p in (2, 3, 4, 8):
            for m in sorted({1, p, p + 1, 2 * p, 3 * p + 1}):
                try:
                    s = built(kind, p, m, V_OF.get(kind, 1))
                except ValueError:
                    continue
                sim = played(kind, p, m, V_OF.get(kind, 1))
                by_rank = plans(s, sim)
                verify(s, by_rank)
                peak = sim.peak_activations
                sent: dict = {}
                got: dict = {}
                for r in range(p):
                    posted = set()
                    held = most = 0
                    for i, posts in enumerate(by_rank[r]):
                        for q in posts:
                            (sent if q.send else got).setdefault((r, q.peer) if q.send else (q.peer, r), []).append(
                                q.transfer)
                            posted.add(q.transfer)
                        held += sum(not q.send for q in posts)
                        most = max(most, held)
                        if i < len(s.actions[r]) and receives(a := s.actions[r][i], s.rank_of_chunk, s.n_chunks, r):
                            assert transfer_in(a) in posted, (kind, p, m, r, a)
                            held -= 1
                    assert most <= peak[r], (kind, p, m, r, most, peak[r])
                assert sent == got, (kind, p, m)
                count += 1
    assert count > 100


def test_verify_rejects_orders_that_deadlock_on_ordered_streams():
    """The orders a naive runtime would use: each fails where a pair's transfers run in order."""
    from pipezero.schedules.posting import Post, plans, receives, source, transfer_in, transfer_out, verify

    def naive(s, recv_first: bool):
        """Receives posted at the start of the step (recv_first) or right before their consumer;
        sends right after their producer."""
        out = []
        for r, acts in enumerate(s.actions):
            posts = [[] for _ in range(len(acts) + 1)]
            for i, a in enumerate(acts):
                if receives(a, s.rank_of_chunk, s.n_chunks, r):
                    t = transfer_in(a)
                    posts[0 if recv_first else i].append(Post(False, t, source(t, s.rank_of_chunk)))
                t = transfer_out(a, s.n_chunks)
                if t is not None and s.rank_of_chunk[t[0]] != r:
                    posts[i + 1].append(Post(True, t, s.rank_of_chunk[t[0]]))
            out.append(posts)
        return out

    one_f = build_schedule(K.ONE_F_ONE_B, 2, 4)
    with pytest.raises(ScheduleError, match="rank 0: stuck before action 0BW0"):
        verify(one_f, naive(one_f, recv_first=True))  # a posted receive blocks the sends behind it
    with pytest.raises(ScheduleError, match="posting order deadlocks"):
        verify(one_f, naive(one_f, recv_first=False))  # 1F1B's steady state: both ends send first
    zbv = build_schedule(K.ZB_V, 2, 4, 2)
    with pytest.raises(ScheduleError, match="posting order deadlocks"):
        verify(zbv, naive(zbv, recv_first=False))  # V shape: consumed in another order than produced
    verify(one_f, plans(one_f))
    verify(zbv, plans(zbv))


def test_comm_time_lengthens_step():
    # GPipe: forward ramp, M forwards and M backwards on the last rank, backward ramp; each ramp
    # pays (P-1) hops: 3M + 3(P-1) + 2(P-1)c.
    assert simulate(build_schedule(K.GPIPE, 4, 8), CostModel(comm=0.5)).step_time == pytest.approx(24 + 9 + 3)
    # 1F1B's steady state waits on the round trip too, so it pays at least the ramps' hops.
    assert simulate(build_schedule(K.ONE_F_ONE_B, 4, 8), CostModel(comm=0.5)).step_time >= 33 + 3


def test_a_slow_boundary_costs_1f1b_a_round_trip_more_than_gpipe():
    """P=2, M=4, F = B = W = 1, one boundary of hop h (a link across nodes), worked out on paper:
    - GPipe's forwards stream through the link and its backwards stream back, so only the first
      micro-batch waits for its activation and the last for its gradient: 3M + 3 + 2h, one round trip.
    - 1F1B's rank 0 runs F0 F1 BW0 F2 BW1 F3 BW2 BW3: its BW0 waits for micro-batch 0's round trip
      through rank 1 (F0 +h, rank 1's F0 and BW0, +h), the F2 after it sends micro-batch 2 on a round
      trip of its own that BW2 waits for: two round trips in a row, 15 + 4h.
    - ZB-H1 has 1F1B's shape (F, B, F, B ...) with W filling the gaps: 13 + 4h for 1/2 <= h <= 1.
    So 1F1B is one round trip (2h) slower than GPipe: at h = 1, 19 against 17 and ZB-H1's 17."""
    def step(kind, hop):
        return simulate(build_schedule(kind, 2, 4), CostModel(hop=(hop,))).step_time

    h = 1.0
    assert step(K.GPIPE, h) == pytest.approx(15 + 2 * h)
    assert step(K.ONE_F_ONE_B, h) == pytest.approx(15 + 4 * h)
    assert step(K.ZB_H1, h) == pytest.approx(13 + 4 * h)
    assert step(K.ONE_F_ONE_B, h) - step(K.GPIPE, h) == pytest.approx(2 * h)  # one round trip more
    assert step(K.GPIPE, 0.0) == step(K.ONE_F_ONE_B, 0.0) == 15  # a free link: they tie


def test_a_slow_link_carries_one_transfer_at_a_time_each_way():
    """A hop longer than the compute between two sends queues: GPipe's four activations leave rank 0
    at 1, 2, 3, 4 but arrive h apart (1 + h ... 1 + 4h), so rank 1's last forward ends at 2 + 4h,
    its four BW (2 each) at 10 + 4h; the gradients (2 apart, h <= 2: no queue back) reach rank 0
    from 4 + 5h, whose last BW ends at 12 + 5h (1 <= h <= 2). As a plain delay the four would have
    crossed at once (15 + 2h). 1F1B sends one activation and one gradient at a time each way:
    15 + 4h still (h <= 3), so at h = 3 it beats GPipe (27 against 30); both directions carry
    at once (gradients back while activations go)."""
    def step(kind, hop):
        return simulate(build_schedule(kind, 2, 4), CostModel(hop=(hop,))).step_time

    for h in (1.5, 2.0):
        assert step(K.GPIPE, h) == pytest.approx(12 + 5 * h) and step(K.GPIPE, h) > 15 + 2 * h
        assert step(K.ONE_F_ONE_B, h) == pytest.approx(15 + 4 * h)
    assert step(K.GPIPE, 3.0) == pytest.approx(30) and step(K.ONE_F_ONE_B, 3.0) == pytest.approx(27)


@pytest.mark.parametrize("kind, pp, m", [(K.GPIPE, 4, 8), (K.ONE_F_ONE_B, 4, 8), (K.ZB_H1, 3, 7),
                                         (K.INTERLEAVED_1F1B, 2, 4), (K.ZB_V, 2, 4), (K.DUALPIPE_V, 4, 8)])
def test_a_uniform_hop_is_comm(kind, pp, m):
    """`comm` is the shorthand of the same hop at every boundary; a boundary inside one rank (the
    V's turn) costs nothing whatever its entry; a list that misses boundaries is refused."""
    s = build_schedule(kind, pp, m, V_OF.get(kind, 1))
    turns = [c for c in range(s.n_chunks - 1) if s.rank_of_chunk[c] == s.rank_of_chunk[c + 1]]
    hop = tuple(99.0 if c in turns else 0.5 for c in range(s.n_chunks - 1))
    by_comm, by_hop = simulate(s, CostModel(comm=0.5)), simulate(s, CostModel(hop=hop))
    assert by_hop.step_time == by_comm.step_time and by_hop.timeline == by_comm.timeline
    assert by_comm.step_time > simulate(s).step_time
    with pytest.raises(ValueError, match=f"CostModel.hop has 1 entries; .* has {s.n_chunks - 1} boundaries"):
        simulate(s, CostModel(hop=(0.5,)))


@pytest.mark.parametrize("kind, pp, v", [(K.GPIPE, 2, 1), (K.ONE_F_ONE_B, 4, 1), (K.ZB_V, 2, 2)])
def test_a_whole_program_waits_for_its_hops_as_the_schedule_does(kind, pp, v):
    """schedules/program_sim.py plays every replica's pipeline with check.simulate's links: with free
    collectives a compiled program (ZeRO-1, D=2) takes the schedule's step, slow hops and queues included."""
    from pipezero.cli.simulate_zero import preset_model
    from pipezero.config import ParallelConfig
    from pipezero.schedules.compile import compile_plan
    from pipezero.schedules.program_sim import simulate_program

    model, _ = preset_model("tiny", pp * v)
    plan = compile_plan(ParallelConfig(pp=pp, dp=2, zero=1, schedule=kind, microbatches=4, virtual_stages=v), model)
    s = plan.program.schedule
    hop = tuple(2.0 if c == 0 else 0.3 for c in range(s.n_chunks - 1))  # the first boundary slow enough to queue
    cost = CostModel(hop=hop)
    assert simulate_program(plan.program, cost).step_time == pytest.approx(simulate(s, cost).step_time)
    assert simulate(s, cost).step_time > simulate(s, CostModel(comm=0.3)).step_time


def test_simulate_cli_json_compare_and_png(tmp_path, capsys):
    assert main(["simulate", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble"] == pytest.approx(3 / 11) and out["peak_activations"] == [4, 3, 2, 1]
    assert out["step_time"] == pytest.approx(33)
    png = tmp_path / "t.png"
    assert main(["simulate", "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["simulate", "--compare", "--pp", "4", "--microbatches", "8", "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert set(both) == {k.value for k in K}
    assert main(["simulate", "--schedule", "dualpipe-v", "--pp", "4", "--microbatches", "7"]) == 2


def torch_order(cls, p: int, m: int, **fields) -> list[list[str]]:
    """Per-rank order of a torch.distributed.pipelining schedule class, computed with no process
    group (its fields set by hand), in our notation; OVERLAP_F_B pairs listed forward then backward."""
    names = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "BW"}

    def flat(a):
        if a.sub_actions:
            for sub in a.sub_actions:
                yield from flat(sub)
        else:
            yield f"{a.stage_index}{names[a.computation_type.name]}{a.microbatch_index}"

    ref = object.__new__(cls)
    ref.pp_group_size, ref._n_microbatches = p, m
    for k, v in fields.items():
        setattr(ref, k, v)
    return [[x for a in ref._calculate_single_rank_operations(r) if a is not None for x in flat(a)]
            for r in range(p)]


def ours(kind, p: int, m: int, v: int) -> list[list[str]]:
    return [[str(a) for a in acts] for acts in build_schedule(kind, p, m, v).actions]


def test_dualpipe_v_is_action_for_action_torch_schedule_dualpipe_v():
    """The issue asks for DualPipeV "as torch.distributed.pipelining's ScheduleDualPipeV": compare
    with its per-rank order for many P and M."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    for p in range(2, 7):
        for m in range(2 * p, 3 * p + 2):
            assert ours(K.DUALPIPE_V, p, m, 2) == torch_order(ScheduleDualPipeV, p, m, _num_stages=2 * p), (p, m)


def test_interleaved_1f1b_is_torchs_order_wherever_torch_takes_m():
    """torch's ScheduleInterleaved1F1B runs M not a multiple of P (R = max(1, M // P) rounds of
    M // R) where R divides M; there our order is its order action for action, so a peer's layout
    runs here as it does there. The M it refuses we run too (tests/test_interleaved.py)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    accepted = 0
    for p in range(2, 9):
        for v in (2, 3, 4):
            for m in range(1, 4 * p + 2):
                rounds = max(1, m // p)
                if m % rounds:
                    continue
                theirs = torch_order(ScheduleInterleaved1F1B, p, m, n_local_stages=v, number_of_rounds=rounds,
                                     microbatches_per_round=m // rounds)
                assert ours(K.INTERLEAVED_1F1B, p, m, v) == theirs, (p, m, v)
                accepted += m % p != 0
    assert accepted > 100  # most of them with M not a multiple of P


@pytest.mark.parametrize("pps", [
    range(2, 9),  # P up to 8 (torch's pairs among them): the fast lane
    pytest.param(range(9, 13), marks=pytest.mark.distributed),  # full lane: four times the time of P <= 8
])
def test_zb_v_below_2p_microbatches_is_sound_and_posts_safely(pps):
    """ZB-V with fewer than 2P micro-batches (torch runs (P, M) = (2, 2), (4, 3), (4, 4), (8, 8)):
    the generator's phases skip the micro-batches that do not exist; the checker proves every such
    schedule complete and deadlock-free, and the posting order passes `verify`."""
    from pipezero.schedules.posting import plans, verify

    for p in pps:
        for m in range(1, 2 * p):
            s = built(K.ZB_V, p, m, 2)
            r = played(K.ZB_V, p, m, 2)
            verify(s, plans(s, r))
            assert max(r.peak_activations) <= 2 * p
    for p, m in ((2, 2), (4, 3), (4, 4), (8, 8)):
        assert sum(len(a) for a in build_schedule(K.ZB_V, p, m, 2).actions) == 3 * 2 * p * m


def test_one_registry_row_per_schedule_read_by_cli_and_simulator(capsys):
    from pipezero.schedules.registry import SCHEDULES, SPLIT_BACKWARD, default_virtual

    assert list(SCHEDULES) == list(K)
    for kind, info in SCHEDULES.items():
        schedule = build_schedule(kind, 2, 4, default_virtual(kind))
        assert schedule.virtual == default_virtual(kind)
        has_w = any(a.op is Op.W for rank in schedule.actions for a in rank)
        assert has_w == (kind in SPLIT_BACKWARD) == info.split_backward, kind
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also at hyphens
    assert all(f"{kind.value}:{''.join(info.summary.split())}" in shown for kind, info in SCHEDULES.items())
    main(["simulate", "--compare", "--pp", "2", "--microbatches", "4", "--json"])
    assert sorted(json.loads(capsys.readouterr().out)) == sorted(k.value for k in SCHEDULES)
