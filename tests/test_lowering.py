"""The lowered program (schedules/lowering.py): every schedule lowers at every ZeRO stage, the checker
proves it and rejects broken ones, and the simulator times its collectives. Pure data, no torch."""

import json
from collections import Counter
from dataclasses import replace

import pytest

from pipezero.config import GradReduce
from pipezero.config import ScheduleKind as K
from pipezero.schedules.actions import Action, Op
from pipezero.schedules.bucket_plan import group_tensors, plan_buckets, uniform_plan
from pipezero.schedules.model_shapes import ModelShapes, TensorShape
from pipezero.schedules.check import CostModel, ScheduleError, simulate
from pipezero.schedules.program import Collective, Compute, DataParallel, Kind, PointToPoint, Program, flat, hoisted
from pipezero.schedules.lowering import lower
from pipezero.schedules.program_check import check_program
from pipezero.schedules.program_sim import CommCost, simulate_program
from pipezero.schedules.registry import SCHEDULES, build_schedule
from pipezero.schedules.wire import BF16, FP32, WireFormat, Wires

BUCKETS = 3  # buckets a chunk in the uniform plans below


def schedule(kind: K, p: int, m: int | None = None):
    return build_schedule(kind, p, m or 2 * p, SCHEDULES[kind].default_virtual)


def lowered(kind: K, p: int, d: int, zero: int, mode: GradReduce = GradReduce.STEP, keep: bool = True,
            m: int | None = None) -> Program:
    s = schedule(kind, p, m)
    return lower(s, d, zero, mode, uniform_plan(s.n_chunks, BUCKETS, 1000, d), keep_gathered=keep)


def count(prog: Program, rank: int, kind: Kind, chunk: int | None = None) -> int:
    """Instructions of `kind` on `rank`, those inside compute instructions included."""
    return sum(1 for i in flat(prog.ranks[rank])
               if i.kind is kind and (chunk is None or getattr(i, "chunk", None) == chunk))


# --grad-reduce only changes stages that shard gradients (2, 3): at 0 and 1 each `step` case also
# holds that the `microbatch` program is the same one, rather than checking it again
CASES = [(k, p, d, z, g) for k in K for p in (2, 4) for d in (1, 2) for z in range(4) for g in GradReduce
         if z >= 2 or g is GradReduce.STEP]


@pytest.mark.parametrize("kind, p, d, zero, mode", CASES, ids=lambda x: getattr(x, "value", str(x)))
def test_every_schedule_and_stage_lowers_and_passes_the_checker(kind, p, d, zero, mode):
    for keep in (True, False) if zero == 3 else (True,):
        prog = lowered(kind, p, d, zero, mode, keep)
        check_program(prog)
        assert len(prog.ranks) == p * d
        for r in range(p * d):
            assert count(prog, r, Kind.OPTIM_STEP) == 1
    if zero < 2:
        assert lowered(kind, p, d, zero, GradReduce.MICROBATCH).ranks == prog.ranks


def test_zero3_keep_gathered_one_unshard_and_reshard_per_chunk():
    prog = lowered(K.INTERLEAVED_1F1B, 2, 2, 3)
    for r in range(4):
        for c in prog.schedule.chunks(prog.coords(r)[0]):
            assert count(prog, r, Kind.UNSHARD, c) == 1 and count(prog, r, Kind.RESHARD, c) == 1
            instrs = prog.ranks[r]
            first_f = next(k for k, i in enumerate(instrs) if isinstance(i, Compute) and i.action.chunk == c)
            assert instrs[first_f - 1].kind is Kind.UNSHARD  # gathered on demand: no prefetch at run time


def test_zero3_layerwise_lists_every_layers_gathers_inside_the_actions_that_read_it():
    """Layer by layer, each action that runs autograd (or the forward) through the chunk gathers
    each of its layers once, inside it, at a moment of that action, and releases them all; a W from
    B's stash and the first chunk's B (no input gradient) read no weights and list nothing."""
    prog = lowered(K.ZB_H1, 2, 2, 3, keep=False, m=4)
    for r in range(4):
        assert not any(i.kind in (Kind.UNSHARD, Kind.RESHARD) for i in prog.ranks[r])  # only inside compute
        for i in prog.ranks[r]:
            if not isinstance(i, Compute):
                continue
            a = i.action
            reads = a.op.value in ("F", "BW") or (a.op.value == "B") == (a.chunk > 0)
            gathered = [d.bucket for d in i.during if d.kind is Kind.UNSHARD]
            released = [d.bucket for d in i.during if d.kind is Kind.RESHARD]
            assert sorted(gathered) == sorted(released) == (list(range(BUCKETS)) if reads else []), i.describe()
            assert all(d.at is not None for d in i.during)
            # the first layer's gather is waited for at once, the next ones prefetched a layer ahead
            assert [d.blocking for d in i.during if d.kind is Kind.UNSHARD] == ([True] + [False] * (BUCKETS - 1)
                                                                                if reads else [])


@pytest.mark.parametrize("zero", [2, 3])
def test_microbatch_mode_reduces_every_bucket_after_every_backward(zero):
    m = 6
    prog = lowered(K.ZB_H1, 2, 2, zero, GradReduce.MICROBATCH, m=m)
    for r in range(4):
        c = prog.schedule.chunks(prog.coords(r)[0])[0]
        assert count(prog, r, Kind.REDUCE_GRAD, c) == m * BUCKETS
        reds = [i for i in flat(prog.ranks[r]) if i.kind is Kind.REDUCE_GRAD]
        assert {i.collective for i in reds} == {Collective.REDUCE_SCATTER}
        assert sum(i.blocking for i in reds) == m  # drained after each backward


@pytest.mark.parametrize("zero, coll", [(0, Collective.ALL_REDUCE), (1, Collective.REDUCE_SCATTER),
                                        (2, Collective.REDUCE_SCATTER), (3, Collective.REDUCE_SCATTER)])
def test_step_mode_reduces_each_bucket_once_after_the_last_weight_gradient(zero, coll):
    prog = lowered(K.ONE_F_ONE_B, 4, 2, zero, GradReduce.STEP)
    for r in range(8):
        instrs = hoisted(prog.ranks[r])  # a fused backward's reductions right after it
        reds = [k for k, i in enumerate(instrs) if i.kind is Kind.REDUCE_GRAD]
        assert len(reds) == BUCKETS and all(instrs[k].collective is coll for k in reds)
        last_bw = max(k for k, i in enumerate(instrs) if i.kind is Kind.BW)
        assert min(reds) == last_bw + 1
        gathers_after_step = count(prog, r, Kind.UNSHARD) if zero in (1, 2) else 0
        assert gathers_after_step == (BUCKETS if zero in (1, 2) else 0)


def test_zero1_and_2_gather_updated_shards_in_fp32_after_the_step():
    s = schedule(K.ONE_F_ONE_B, 2)
    prog = lower(s, 2, 2, GradReduce.STEP, uniform_plan(2, 1, 1000, 2), wires=Wires.of(bf16=True))
    tail = prog.ranks[0][-2:]
    assert tail[0].kind is Kind.OPTIM_STEP
    assert tail[1].kind is Kind.UNSHARD and tail[1].nbytes == 4000 and tail[1].blocking and tail[1].wire is FP32
    reductions = [i for i in flat(prog.ranks[0]) if i.kind is Kind.REDUCE_GRAD]
    assert [(i.nbytes, i.wire) for i in reductions] == [(2000, BF16)]  # bf16 on the wire


def test_swapped_reductions_on_one_dp_rank_are_rejected_naming_ranks_and_position():
    prog = lowered(K.ONE_F_ONE_B, 2, 2, 2)
    instrs = hoisted(prog.ranks[1])
    a, b = (k for k, i in enumerate(instrs) if i.kind is Kind.REDUCE_GRAD and i.bucket in (0, 1))
    instrs[a], instrs[b] = instrs[b], instrs[a]
    bad = replace(prog, ranks=(tuple(hoisted(prog.ranks[0])), tuple(instrs), *prog.ranks[2:]))
    with pytest.raises(ScheduleError, match=r"ranks \[0, 1\]\): rank 1 and rank 0 differ at collective #0: "
                                            r"rank 0 issues REDUCE_GRAD\(0\.0\), rank 1 issues REDUCE_GRAD\(0\.1\)"):
        check_program(bad)


def test_checker_rejects_missing_transfer_compute_on_a_shard_and_late_gradients():
    prog = lowered(K.ONE_F_ONE_B, 2, 2, 3)
    drop_recv = tuple(i for i in prog.ranks[2] if i.kind is not Kind.RECV)
    with pytest.raises(ScheduleError, match="rank 2 .*missing"):
        check_program(replace(prog, ranks=(*prog.ranks[:2], drop_recv, prog.ranks[3])))
    no_gather = tuple(tuple(i for i in prog.ranks[r] if i.kind is not Kind.UNSHARD) for r in (0, 1))
    with pytest.raises(ScheduleError, match="runs on chunk 0's shard"):  # on both: the dp group agrees
        check_program(replace(prog, ranks=(*no_gather, *prog.ranks[2:])))
    step0 = lowered(K.ONE_F_ONE_B, 2, 1, 0)
    instrs = hoisted(step0.ranks[0])
    k = next(k for k, i in enumerate(instrs) if i.kind is Kind.REDUCE_GRAD)
    instrs.insert(2, instrs.pop(k))  # bucket 0 reduced before the backward that fills it
    with pytest.raises(ScheduleError, match="after chunk 0's last REDUCE_GRAD of bucket 0"):
        check_program(replace(step0, ranks=(tuple(instrs), step0.ranks[1])))


@pytest.mark.parametrize("kind", list(K))
def test_free_communication_times_the_program_exactly_as_the_schedule(kind):
    cost = CostModel(1.0, 1.5, 0.7, comm=0.25)
    s = schedule(kind, 4)
    base = simulate(s, cost)
    for zero in range(4):
        prog = lower(s, 2, zero, GradReduce.MICROBATCH, uniform_plan(s.n_chunks, 2, 999, 2))
        res = simulate_program(prog, cost, CommCost(bandwidth=float("inf")))
        assert res.step_time == base.step_time and res.bubble == pytest.approx(base.bubble, abs=1e-12)
        compute = sorted((sp.rank // 2, sp.label, sp.start, sp.end) for sp in res.timeline
                         if sp.lane == "compute" and sp.rank % 2 == 0)
        assert compute == sorted((e.rank, str(e.action), e.start, e.end) for e in base.timeline)


def test_collectives_cost_bytes_over_bandwidth_and_gate_compute():
    s = schedule(K.ONE_F_ONE_B, 2, 2)
    prog = lower(s, 2, 3, GradReduce.STEP, uniform_plan(2, 1, 1000, 2))  # 4000 bytes a chunk
    res = simulate_program(prog, comm=CommCost(bandwidth=1000.0))
    gathers = [sp for sp in res.timeline if sp.kind is Kind.UNSHARD and sp.rank == 0]
    assert [(sp.start, sp.end) for sp in gathers] == [(0.0, 2.0)]  # 4000 x (2-1)/2 / 1000
    first_f = min(sp.start for sp in res.timeline if sp.rank == 0 and sp.kind is Kind.F)
    assert first_f == 2.0  # F waits for its chunk's gather
    assert res.step_time > simulate(s).step_time and res.comm_busy[0] > 0


def test_buckets_group_tensors_in_reverse_model_order():
    """The one grouping rule (zero/buckets.py lays its flat buffers out from it): tensors in reverse
    model order, a bucket closed once it holds the limit, tensors inside in that order too."""
    t = [TensorShape("layers.0.a", (5,)), TensorShape("layers.1.b", (3,)), TensorShape("layers.1.c", (2, 2))]
    close_at_7 = group_tensors(t, bucket_mb=7 * 4 / 2**20)
    assert [[x.name for x in b.tensors] for b in close_at_7] == [["layers.1.c", "layers.1.b"], ["layers.0.a"]]
    assert [b.offsets for b in close_at_7] == [(0, 4), (0,)] and [b.numel for b in close_at_7] == [7, 5]
    assert [b.numel for b in group_tensors(t, float("inf"))] == [12]
    by_layer = group_tensors(t, float("inf"), layerwise=True)
    assert [[x.name for x in b.tensors] for b in by_layer] == [["layers.1.c", "layers.1.b"], ["layers.0.a"]]
    plan = plan_buckets(ModelShapes.of_counts([[5, 3], [7]]), bucket_mb=float("inf"), dp=2)
    assert plan.numels == ((8,), (8,))  # padded to a multiple of D
    assert plan_buckets(ModelShapes.of_counts([[5, 3]]), 1.0, dp=2, layerwise=True).numels == ((4, 6),)
    assert Counter(uniform_plan(3, 2, 5, 4).numels) == Counter({(8, 8): 3})


def test_simulate_cli_with_zero_reports_both_bubbles_and_draws_the_collectives(tmp_path, capsys):
    from pipezero.cli import main

    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    png = tmp_path / "z3.png"
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--zero", "3", "--dp", "2",
                 "--preset", "tiny", "--json", "--png", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bubble_no_zero_traffic"] == pytest.approx(plain["bubble"])
    assert out["step_time_no_zero_traffic"] == pytest.approx(plain["step_time"])
    assert out["step_time"] > plain["step_time"] and out["rank0_instructions"]["UNSHARD"] == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["simulate", "--compare", "--pp", "2", "--microbatches", "4", "--zero", "2", "--dp", "2",
                 "--grad-reduce", "microbatch", "--preset", "tiny", "--dp-comm", "0"]) == 0
    table = capsys.readouterr().out
    assert "bubble + ZeRO" in table and "dualpipe-v" in table


def test_zero3_prefetch_gathers_one_action_ahead_and_hides_the_second_chunks_gather():
    s = schedule(K.INTERLEAVED_1F1B, 4, 8)
    plan = uniform_plan(s.n_chunks, 2, 1000, 2)
    ahead = lower(s, 2, 3, GradReduce.STEP, plan, prefetch=True)
    check_program(ahead)
    instrs = ahead.ranks[0]
    k = next(k for k, i in enumerate(instrs) if i.kind is Kind.UNSHARD and i.chunk == 4)
    assert not instrs[k].blocking and instrs[k + 1].kind is Kind.F and instrs[k + 1].action.chunk == 0
    comm = CommCost(bandwidth=1000.0)
    on_demand = simulate_program(lower(s, 2, 3, GradReduce.STEP, plan), comm=comm)
    assert simulate_program(ahead, comm=comm).step_time < on_demand.step_time


def test_simulate_cli_listing_prints_every_ranks_program(capsys):
    from pipezero.cli import main

    assert main(["simulate", "--pp", "2", "--microbatches", "3", "--zero", "3", "--dp", "2", "--preset", "tiny",
                 "--listing"]) == 0
    out = capsys.readouterr().out
    assert "1f1b rank 3 (pp 1, dp 1): RECV(act 1:0 from 1) UNSHARD(1, wait) 1F0" in out
    assert out.count("OPTIM_STEP") == 4


@pytest.mark.parametrize("argv, needle", [
    (["--dp", "0"], "--dp = 0: expected an integer >= 1"),
    (["--dp-comm", "-1"], "--dp-comm = -1.0: expected a number >= 0"),
    (["--preset", "nope"], "unknown preset 'nope'"),
])
def test_bad_zero_simulate_input_is_one_line(argv, needle, capsys):
    from pipezero.cli import main

    assert main(["simulate", "--zero", "2", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err


@pytest.mark.parametrize("mode", list(GradReduce))
def test_a_fused_backward_that_reduces_starts_each_buckets_reduction_inside_it(mode):
    """A BW the program follows with reductions (with `step` each chunk's last W or BW of the step,
    with `microbatch` (ZeRO-2) every one) holds each bucket's REDUCE_GRAD at the moment autograd
    completes it, in bucket order; a W's follow it (W writes its gradients
    outside autograd's accumulation); a B reduces nothing. ZeRO-2 drains after each backward's
    reductions with `microbatch` only (with `step`, at OPTIM_STEP)."""
    prog = lowered(K.ZB_H1, 2, 2, 2, mode)
    for rank in range(len(prog.ranks)):
        instrs = prog.ranks[rank]
        backwards = [k for k, x in enumerate(instrs) if isinstance(x, Compute) and x.kind in (Kind.W, Kind.BW)]
        last = {instrs[k].action.chunk: k for k in backwards}
        want = set(backwards) if mode is GradReduce.MICROBATCH else set(last.values())
        for k in backwards:
            x = instrs[k]
            inside = [d for d in x.during if d.kind is Kind.REDUCE_GRAD]
            after = []
            for d in instrs[k + 1:]:
                if d.kind is not Kind.REDUCE_GRAD:
                    break
                after.append(d)
            reduced = inside or after
            assert bool(reduced) == (k in want), x.describe()
            if not reduced:
                continue
            assert [d.bucket for d in reduced] == list(range(BUCKETS))
            assert [d.blocking for d in reduced] == [False] * (BUCKETS - 1) + [mode is GradReduce.MICROBATCH]
            if x.kind is Kind.BW:
                assert not after and [str(d.at) for d in inside] == [f"grads {b}" for b in range(BUCKETS)]
            else:
                assert not inside
        assert not any(d.kind is Kind.REDUCE_GRAD for x in instrs if isinstance(x, Compute) and x.kind is Kind.B
                       for d in x.during)


@pytest.mark.parametrize("kind", list(K), ids=lambda k: k.value)
def test_a_tied_embedding_is_summed_then_reduced_before_the_step(kind):
    """With the embedding tied to the head across chunks, the ranks holding the copies sum them
    (TIED_SUM) and reduce the buckets holding them just before OPTIM_STEP, never in the backward;
    every ZeRO stage's program passes the checker, whose joint play meets the two ends."""
    from pipezero.schedules.program import OptimStep

    s = schedule(kind, 2)
    layers = ModelShapes.of_counts([[1000] * 3 for _ in range(s.n_chunks)], tied=True)
    for zero in range(4):
        plan = plan_buckets(layers, 0.001, 2)  # one bucket a layer
        assert plan.held == {(0, 2), (s.n_chunks - 1, 0)}
        prog = lower(s, 2, zero, GradReduce.MICROBATCH, plan)
        check_program(prog)
        ends = {s.rank_of_chunk[0], s.rank_of_chunk[s.n_chunks - 1]}
        for rank, instrs in enumerate(prog.ranks):
            names = [str(i) for i in instrs]
            step = next(k for k, i in enumerate(instrs) if isinstance(i, OptimStep))
            sums = [k for k, i in enumerate(instrs) if i.kind is Kind.TIED_SUM]
            held = [k for k, i in enumerate(instrs) if i.kind is Kind.REDUCE_GRAD and (i.chunk, i.bucket) in plan.held]
            if prog.coords(rank)[0] not in ends:
                assert not sums and not held, names
                continue
            assert len(sums) == 1 and held and sums[0] < min(held) and max(held) < step, names
            assert len(held) == len({(instrs[k].chunk, instrs[k].bucket) for k in held})  # once, not per backward
    # one end skipping its TIED_SUM leaves the other waiting: the joint play says so
    broken = list(prog.ranks)
    last = prog.global_rank(s.rank_of_chunk[s.n_chunks - 1], 0)
    if last != prog.global_rank(s.rank_of_chunk[0], 0):
        broken[last] = tuple(i for i in broken[last] if i.kind is not Kind.TIED_SUM)
        with pytest.raises(ScheduleError, match="deadlocks"):
            simulate_program(replace(prog, ranks=tuple(broken)))


@pytest.mark.parametrize("zero", range(4))
def test_the_in_flight_bound_is_an_instruction_the_lowering_places(zero):
    """Where a reduction lands in a shard (ZeRO 1-3) every REDUCE_GRAD that does not block carries the
    bound on reductions left in flight (--buckets-in-flight); a blocking one, and ZeRO-0's
    all-reduces, carry none. The runtime, the memory walk and the simulator read it there."""
    s = schedule(K.ZB_H1, 2)
    for in_flight in (1, 3):
        prog = lower(s, 2, zero, GradReduce.MICROBATCH, uniform_plan(s.n_chunks, BUCKETS, 1000, 2),
                     in_flight=in_flight)
        reductions = [i for r in prog.ranks for i in flat(r) if i.kind is Kind.REDUCE_GRAD]
        assert reductions
        for i in reductions:
            assert i.bound == (in_flight if zero and not i.blocking else None), i
    with pytest.raises(ValueError, match="in_flight"):
        lower(s, 2, 2, GradReduce.STEP, uniform_plan(s.n_chunks, BUCKETS, 1000, 2), in_flight=0)


def test_the_simulator_and_the_memory_walk_read_the_bound_from_the_program():
    """A tighter bound than the program's stalls the simulated backward where the link is slow, and a
    looser one lets the memory walk keep more full gradient buckets alive: both follow the number the
    program carries, not a rule of their own."""
    from pipezero.settings import build_config
    from pipezero.memory.model import predict

    s = schedule(K.INTERLEAVED_1F1B, 2)  # a chunk's reductions start while the other chunk's backwards run
    link = CommCost(bandwidth=1e5)  # a bucket's reduction about a tenth of a forward
    times = [simulate_program(lower(s, 2, 2, GradReduce.STEP, uniform_plan(s.n_chunks, 8, 10_000, 2),
                                    in_flight=n), comm=link).step_time for n in (1, 8)]
    assert times[0] > times[1] * 1.05
    base = {"model.preset": "small", "data.seq_len": "64", "parallel.micro_batch_size": "2", "run.device": "cpu",
            "parallel.pp": "2", "parallel.dp": "2", "parallel.zero": "2", "parallel.microbatches": "2",
            "parallel.bucket_mb": "0.05", "parallel.grad_reduce": "microbatch"}
    peaks = [predict(build_config(None, {**base, "parallel.buckets_in_flight": str(n)}))[0] for n in (1, 4)]
    assert peaks[1].categories["grads"] > peaks[0].categories["grads"]
    assert peaks[1].categories["collectives"] > peaks[0].categories["collectives"]


def test_hpz_takes_a_buckets_later_gathers_from_the_node_where_the_lowering_says():
    """hpZ, layer by layer: each bucket's first gather of the step crosses the nodes (the group of the
    stage's replicas, priced at the gather's width); every later one is the program's `node` gather
    of the fp32 shares the first one left (4 bytes an element). Without hpZ every gather is `dp`."""
    from pipezero.schedules.program import Group

    s = schedule(K.ONE_F_ONE_B, 1, 2)
    plan = uniform_plan(s.n_chunks, BUCKETS, 1000, 4)
    for node in (False, True):
        int8 = WireFormat("int8", 256)
        prog = lower(s, 4, 3, GradReduce.STEP, plan, keep_gathered=False, node_shares=node,
                     wires=Wires(gathers=int8, updates=int8))
        gathers = [i for i in flat(prog.ranks[0]) if i.kind is Kind.UNSHARD]
        first = {}
        for i in gathers:
            first.setdefault(i.bucket, i)
        assert all(i.group is Group.DP for i in first.values())
        later = [i for i in gathers if first[i.bucket] is not i]
        assert later  # the backward gathers each layer again
        assert all(i.group is (Group.NODE if node else Group.DP) for i in later)
        assert all((i.nbytes, i.wire) == ((plan.buckets(0)[i.bucket] * 4, FP32) if node else
                                          (int8.bytes(plan.buckets(0)[i.bucket]), int8)) for i in later)
        assert (", node)" in prog.listing(0)) is node


@pytest.mark.parametrize("kind, p, v", [(K.ONE_F_ONE_B, 2, 1), (K.ZB_V, 2, 2), (K.INTERLEAVED_1F1B, 2, 2)])
def test_the_evaluation_is_a_program_every_pair_of_ranks_agrees_on(kind, p, v):
    """Forward only, micro-batch by micro-batch through each rank's chunks in model order: every
    chunk runs each micro-batch once; each SEND has its RECV on the peer, in the same order between
    each pair of ranks (no tags travel); kept-gathered ZeRO-3 gathers each chunk once and releases it
    at the end; layer by layer each F carries its own gathers; every program ends in LOSS_SUM."""
    from pipezero.schedules.forward_only import LossSum, lower_evaluation

    s = build_schedule(kind, p, 2 * p, v)
    d, m = 2, 3
    plan = uniform_plan(s.n_chunks, BUCKETS, 1000, d)
    for sharded, layerwise in ((False, False), (True, False), (True, True)):
        progs = lower_evaluation(s, d, plan, m, sharded_params=sharded, layerwise=layerwise, gathers=FP32)
        assert len(progs) == p * d and all(isinstance(r[-1], LossSum) for r in progs)
        forwards = sorted((i.action.chunk, i.action.mb) for r in progs[::d] for i in r if isinstance(i, Compute))
        assert forwards == sorted((c, mb) for c in range(s.n_chunks) for mb in range(m))
        for a in range(p * d):
            for b in range(p * d):
                sends = [i.transfer for i in progs[a] if isinstance(i, PointToPoint) and i.send and i.peer == b]
                recvs = [i.transfer for i in progs[b] if isinstance(i, PointToPoint) and not i.send and i.peer == a]
                assert sends == recvs, (a, b)
        gathers = [i for r in progs for i in flat([x for x in r if not isinstance(x, LossSum)])
                   if isinstance(i, DataParallel) and i.kind is Kind.UNSHARD]
        if not sharded:
            assert not gathers
        elif not layerwise:
            assert all(i.bucket is None and i.blocking for i in gathers)
            assert len(gathers) == p * d * v  # each chunk of each rank once
        else:
            assert gathers and all(i.bucket is not None for i in gathers)


@pytest.mark.parametrize("kind, p, v", [(K.ONE_F_ONE_B, 2, 1), (K.ZB_V, 2, 2), (K.INTERLEAVED_1F1B, 2, 2),
                                        (K.GPIPE, 4, 1)])
def test_the_evaluation_is_proven_as_a_step_is(kind, p, v):
    """Every layout's evaluation passes the forward-only checker at every ZeRO mode: complete,
    transfers agreeing pair by pair, the ranks of each dp group issuing the same collectives, and
    the joint play of all ranks (LOSS_SUM a rendezvous of the world) finishing."""
    from pipezero.schedules.forward_only import check_forward_only, lower_evaluation

    s = build_schedule(kind, p, 2 * p, v)
    d, m = 2, 3
    plan = uniform_plan(s.n_chunks, BUCKETS, 1000, d)
    for sharded, layerwise in ((False, False), (True, False), (True, True)):
        for depth in (1, 2) if layerwise else (1,):
            progs = lower_evaluation(s, d, plan, m, sharded_params=sharded, layerwise=layerwise, gathers=FP32,
                                     depth=depth)
            check_forward_only(s, d, plan, progs, m)


def test_the_forward_only_checker_refuses_what_would_miss_or_hang():
    """A forward missing, two receives swapped (the pair's orders differ: NCCL would pair them
    wrongly), one rank of a dp group without its gather, and forwards in an order that waits in a
    cycle (the V placement's rank 0 running chunk 3 before chunk 0) are each refused, named."""
    from pipezero.schedules.forward_only import check_forward_only, lower_evaluation

    s = build_schedule(K.ZB_V, 2, 4, 2)
    d, m = 2, 3
    plan = uniform_plan(s.n_chunks, BUCKETS, 1000, d)
    progs = lower_evaluation(s, d, plan, m, sharded_params=True, layerwise=False, gathers=FP32)

    def refused(rank: int, changed: list, match: str) -> None:
        ranks = list(progs)
        ranks[rank] = tuple(changed)
        with pytest.raises(ScheduleError, match=match):
            check_forward_only(s, d, plan, ranks, m)

    last = progs[2]  # pp 1, dp 0: chunks 1 and 2
    refused(2, [i for i in last if not (isinstance(i, Compute) and i.action.chunk == 2 and i.action.mb == 1)],
            r"replica 0: forwards differ .* missing \(chunk, pass\) \[\(2, 1\)\]")
    recvs = [k for k, i in enumerate(last) if isinstance(i, PointToPoint) and not i.send]
    swapped = list(last)
    swapped[recvs[0]], swapped[recvs[1]] = last[recvs[1]], last[recvs[0]]
    refused(2, swapped, r"rank 0 sends .* to rank 2, which receives")
    refused(1, progs[1][1:], r"dp group of pp rank 0 \(ranks \[0, 1\]\): rank 1 and rank 0 differ at collective #0")
    first = list(progs[0])
    f0, f3 = (next(k for k, i in enumerate(first) if isinstance(i, Compute) and i.action == a)
              for a in (Action(0, Op.F, 0), Action(3, Op.F, 0)))
    first[f0], first[f3] = first[f3], first[f0]
    refused(0, first, r"program deadlocks")


def test_the_text_sample_is_a_program_of_one_forward_a_token():
    """One pipeline rank: a forward a token on replica 0, or layer by layer on every replica (each
    its own gathers and releases inside it); kept-gathered ZeRO-3's replicas all gather around the
    sample and release after it; each proven by the forward-only checker; two pipeline ranks are
    refused (the drawn token would have to travel back to the first chunk)."""
    from pipezero.schedules.forward_only import check_forward_only, lower_sample

    s = build_schedule(K.ONE_F_ONE_B, 1, 2, 1)
    d, tokens = 4, 5
    plan = uniform_plan(1, BUCKETS, 1000, d)
    for sharded, layerwise in ((False, False), (True, False), (True, True)):
        progs = lower_sample(s, d, plan, tokens, sharded_params=sharded, layerwise=layerwise, gathers=FP32)
        check_forward_only(s, d, plan, progs, tokens, range(d) if layerwise else [0])
        sampling = [r for r in range(d) if any(isinstance(i, Compute) for i in progs[r])]
        assert sampling == (list(range(d)) if layerwise else [0])
        # which replicas sample is the program's: the checker holds it to that
        with pytest.raises(ScheduleError, match=r"replica 1: forwards differ from every chunk on every pass once"):
            check_forward_only(s, d, plan, progs, tokens, [0] if layerwise else None)
        assert [i.action for i in progs[0] if isinstance(i, Compute)] == [Action(0, Op.F, t) for t in range(tokens)]
        assert not any(isinstance(i, PointToPoint) for r in progs for i in r)
        kinds = [[i.kind for i in r if isinstance(i, DataParallel)] for r in progs]
        assert kinds == ([[Kind.UNSHARD, Kind.RESHARD]] * d if sharded and not layerwise else [[]] * d)
        inside = [x for i in progs[0] if isinstance(i, Compute) for x in i.during]
        assert bool(inside) is layerwise and all(x.kind in (Kind.UNSHARD, Kind.WAIT, Kind.RESHARD) for x in inside)
    with pytest.raises(ValueError, match="one pipeline rank, not 2"):
        lower_sample(build_schedule(K.ONE_F_ONE_B, 2, 2, 1), 1, uniform_plan(2, BUCKETS, 1000, 1), 3,
                     sharded_params=False, layerwise=False, gathers=FP32)


def _without(prog: Program, rank: int, drop) -> Program:
    """`prog` with the instructions `drop` picks removed from rank `rank` (inside compute too)."""
    instrs = tuple(replace(i, during=tuple(d for d in i.during if not drop(d))) if isinstance(i, Compute) else i
                   for i in prog.ranks[rank] if not drop(i))
    return replace(prog, ranks=prog.ranks[:rank] + (instrs,) + prog.ranks[rank + 1:])


@pytest.mark.parametrize("kind", [K.ONE_F_ONE_B, K.ZB_H1, K.INTERLEAVED_1F1B])
def test_every_gather_that_does_not_block_is_waited_for_where_the_program_places_its_wait(kind):
    """The waits are instructions. Layer by layer (2 layers ahead) each gather started without waiting
    has one WAIT in the same action, at the moment its layer computes (its `fwd` or `bwd`), never
    before it starts; ZeRO-1 with --overlap-gather waits for each updated bucket in the chunk's first
    F, at the `fwd` of the first layer reading it (bucket plan `reads`), in the order the step started
    them, and no other compute waits (without --overlap-gather none does: the last gather blocks). The
    evaluation's first forward waits alike. A program without one of them, or with one after its
    layer's use, is refused by the checker, naming the bucket."""
    from pipezero.schedules.forward_only import check_forward_only, lower_evaluation
    from pipezero.schedules.layer_plan import Moment, Trigger

    s = schedule(kind, 2)
    plan = uniform_plan(s.n_chunks, BUCKETS, 1000, 2)
    layerwise = lower(s, 2, 3, GradReduce.STEP, plan, keep_gathered=False, depth=2)
    check_program(layerwise)
    for r in range(len(layerwise.ranks)):
        for ins in (i for i in layerwise.ranks[r] if isinstance(i, Compute)):
            started = [d.bucket for d in ins.during if d.kind is Kind.UNSHARD and not d.blocking]
            waits = [d for d in ins.during if d.kind is Kind.WAIT]
            assert sorted(d.bucket for d in waits) == sorted(started), ins.describe()
            for w in waits:
                use = {u.bucket: u for u in plan.layers(w.chunk)}[w.bucket]
                assert (w.at.moment, w.at.index) in ((Moment.FORWARD, use.index), (Moment.BACKWARD, use.index)), \
                    ins.describe()
                assert ins.during.index(w) > next(k for k, d in enumerate(ins.during)
                                                  if d.kind is Kind.UNSHARD and d.bucket == w.bucket)
    first = next(i for i in layerwise.ranks[0] if isinstance(i, Compute) and any(d.kind is Kind.WAIT for d in i.during))
    w = next(d for d in first.during if d.kind is Kind.WAIT)
    with pytest.raises(ScheduleError, match=rf"computes with bucket {w.bucket}, whose gather no WAIT before it waits"):
        check_program(_without(layerwise, 0, lambda d: d is w))

    overlap = lower(s, 2, 1, GradReduce.STEP, plan, overlap_gather=True)
    check_program(overlap)
    for r in range(len(overlap.ranks)):
        instrs = overlap.ranks[r]
        firsts = {c: next(i for i in instrs if isinstance(i, Compute) and i.action.chunk == c)
                  for c in s.chunks(overlap.coords(r)[0])}
        for c, f in firsts.items():
            assert f.action.op is Op.F
            reads = plan.reads(c)
            want = [DataParallel(Kind.WAIT, c, k, Collective.LOCAL, 0,
                                 at=Trigger(Moment.FORWARD, next(i for i, ks in reads.items() if k in ks)))
                    for k in reversed(range(BUCKETS))]
            assert list(f.during) == want
            gathers = [i.bucket for i in instrs[instrs.index(next(i for i in instrs if i.kind is Kind.OPTIM_STEP)):]
                       if i.kind is Kind.UNSHARD and i.chunk == c]
            assert [d.bucket for d in f.during] == gathers  # waited for in the order the step started them
        assert sum(1 for i in flat(instrs) if i.kind is Kind.WAIT) == BUCKETS * len(firsts)
    assert not any(i.kind is Kind.WAIT for r in lower(s, 2, 1, GradReduce.STEP, plan).ranks for i in flat(r))
    f = next(i for i in overlap.ranks[0] if isinstance(i, Compute))
    late, early = f.during[-1], f.during[0]
    with pytest.raises(ScheduleError, match=rf"0F0 \(#0\): layer {late.at.index} computes with bucket "
                                            rf"{late.chunk}\.{late.bucket} before any WAIT"):
        check_program(_without(overlap, 0, lambda d: d is late))
    moved = replace(early, at=late.at)  # after the layer that first reads it has run
    swapped = tuple(replace(i, during=(*i.during[1:], moved)) if i is f else i for i in overlap.ranks[0])
    with pytest.raises(ScheduleError, match=rf"layer {early.at.index} computes with bucket {early.chunk}\.{early.bucket} "
                                            rf"before any WAIT"):
        check_program(replace(overlap, ranks=(swapped,) + overlap.ranks[1:]))
    evaluation = lower_evaluation(s, 2, plan, 2, sharded_params=False, layerwise=False, gathers=FP32,
                                  update_waits=True)
    check_forward_only(s, 2, plan, evaluation, 2)
    assert next(i for i in evaluation[0] if isinstance(i, Compute)).during == f.during
