"""The runtime plays the data-parallel collectives its lowered program lists, as the program says.

Each rank records what it plays (zero/coordinator.py `played`: each start of a bucket's collective
with its bytes, wire type and group, each wait for a reduction or a gather, each release, and each
transfer to or from another rank posted and waited for, named as the program names them) and
tests/training.py `train_cases` holds every step's, evaluation's and text sample's record against
`expected` of the rank's program (schedules/played.py; the evaluation's and the sample's are
forward-only programs, schedules/forward_only.py) for every run of every layout test; this test runs
the layouts below for one step each and checks that the records are not empty.

Covered: every schedule with ZeRO 0-3 at P=2 D=2 (with --offload optimizer and two micro-batches'
activations offloaded: their host copies and steps held to the program too), the stages that move the most at P=4 D=1 and P=1
D=4, both placements, `--hierarchical`, per-micro-batch reductions and a tied embedding (TIED_SUM,
then the reductions of the buckets holding its copies, before the step). The layouts that
tests/test_zero.py and tests/test_pipeline.py train as they would be here (`held_elsewhere`; a
one-process test below holds that they are there) are held to the program there, on every one of
their steps, with the same checks of what was played (training.py `assert_played`). Layer-by-layer ZeRO-3
(the default at P=1, asked for at P=2): its gathers sit inside the compute instructions and are
held to the program like any other, under fused and split backward (W from B's stash, and W of the
first chunk running autograd again), the V placement, --recompute (the forward run again inside each
backward, its layers gathered again as the program lists them), a head tied to the embedding in
one chunk (it borrows the embedding's bucket) or across chunks, and frozen layers; and with each
layer's gather started 2 or 3 layers ahead (--zero3-prefetch); and with a block's attention and MLP
gathered and reduced apart (--zero3-unit sublayer). The text sample (one pipeline rank) is held to
its program kept gathered and layer by layer (with --recompute, and gathers 2 and 3 layers ahead).
Every case's weights after its step, its loss and gradient norm equal one process's.
"""

from __future__ import annotations

import pytest

from pipezero.config import ScheduleKind as K
from pipezero.schedules.wire import FP32
from ranks import run_ranks
from training import assert_played, assert_same_training, layouts, train_cases


def held_elsewhere() -> list[dict]:
    """The layouts this test leaves to tests/test_zero.py and tests/test_pipeline.py, which train them
    for several steps, each step held to the program, and compare them with one process."""
    two = {"parallel.hierarchical": True, "parallel.ranks_per_node": 2}
    lw = {"parallel.zero": 3, "parallel.zero3_keep_gathered": False}
    return ([{"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": z, **two} for z in (0, 1, 2, 3)]
            + [{"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 0}]
            + [{"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": z, "parallel.grad_reduce": "microbatch"}
               for z in (2, 3)]
            + [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": z, "model.tie_embeddings": True}
               for z in (0, 1, 2, 3)]
            + [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, **lw}]
            + [{"pp": 4, "dp": 1, "kind": kind, "m": 8, "parallel.zero": 0} for kind in (K.ONE_F_ONE_B, K.ZB_V)])


def cases() -> list[dict]:
    out = []
    # every schedule x ZeRO stage offloaded: its collectives in the program's order as plain (the other
    # layout tests hold plain runs' records), and its host copies and host steps, and its activation
    # copies, where the program places them
    offloaded = {"parallel.offload": "optimizer", "parallel.offload_activations": 2}
    for kind in K:
        for zero in (0, 1, 2, 3):
            out.append({"pp": 2, "dp": 2, "kind": kind, "m": 4, "parallel.zero": zero, **offloaded})
    out += [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": z, "parallel.placement": "pp-inner"}
            for z in (1, 3)]
    out += [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": 1, "parallel.overlap_gather": o}
            for o in (True, False)]
    # a checkpoint between steps waits for the gathers the step left in flight, a reader outside the
    # programs the record names: the next step's WAITs find them landed
    out += [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": 1, "parallel.overlap_gather": True,
             "run.checkpoint_every": 1, "run.max_steps": 3}]
    # the in-flight bound is the program's: two reductions left in flight, split and fused backward
    out += [{"pp": 2, "dp": 2, "kind": kind, "m": 4, "parallel.zero": 2, "parallel.buckets_in_flight": 2,
             "parallel.bucket_mb": 0.02} for kind in (K.ZB_H1, K.ONE_F_ONE_B)]
    two = {"parallel.hierarchical": True, "parallel.ranks_per_node": 2}
    # the text sample (one pipeline rank) is a program too: kept gathered around it, or layer by layer
    sample = {"run.sample_tokens": 3}
    out += [{"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 3, "parallel.zero3_keep_gathered": True,
             **sample}]
    out += [{"pp": 2, "dp": 2, "kind": K.ZB_V, "m": 4, "parallel.zero": 2, "parallel.placement": "pp-inner", **two}]
    # a tied embedding: summed between the ends (or on the V's turn rank), then its buckets reduced
    tied = {"model.tie_embeddings": True}
    out += [{"pp": 2, "dp": 2, "kind": K.ZB_V, "m": 4, "parallel.zero": 2, **tied},
            {"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": 1, "parallel.placement": "pp-inner", **tied},
            {"pp": 4, "dp": 1, "kind": K.INTERLEAVED_1F1B, "m": 8, "parallel.zero": 0, **tied}]
    # ZeRO-3 layer by layer: the gathers inside each action, one layer ahead
    lw = {"parallel.zero": 3, "parallel.zero3_keep_gathered": False}
    out += [{"pp": 2, "dp": 2, "kind": kind, "m": 4, **lw} for kind in (K.ZB_H1, K.ZB_V, K.INTERLEAVED_1F1B)]
    out += [{"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.recompute": True, **lw},
            {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.recompute": True, **lw, **sample},
            {"pp": 2, "dp": 2, "kind": K.ZB_V, "m": 4, **lw, **tied},
            {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, **lw, **tied},
            {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "optim.freeze": r"layers\.(1|4)\.", **lw, **tied}]
    out += prefetch_cases()
    return out


def prefetch_cases() -> list[dict]:
    """ZeRO-3 layer by layer with each layer's gather started 2 or 3 layers ahead (--zero3-prefetch):
    several gathers in flight at once, waited for where their layer computes, under fused and split
    backward, --recompute and a tied head."""
    lw = {"parallel.zero": 3, "parallel.zero3_keep_gathered": False}
    return [{"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, **lw, "parallel.zero3_prefetch": d,
             "run.sample_tokens": 3} for d in (2, 3)] + [
        {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.recompute": True, **lw, "parallel.zero3_prefetch": 2},
        {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "model.tie_embeddings": True, **lw,
         "parallel.zero3_prefetch": 3},
        {"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, **lw, "parallel.zero3_prefetch": 2}] + sublayer_cases()


def sublayer_cases() -> list[dict]:
    """A block's attention and MLP gathered, released and reduced apart (--zero3-unit sublayer):
    under fused backward with --recompute, split backward (B through the parts, W from B's stash
    and the first chunk's W by autograd again) and with frozen parts."""
    lw = {"parallel.zero": 3, "parallel.zero3_keep_gathered": False, "parallel.zero3_unit": "sublayer"}
    return [{"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.recompute": True, **lw},
            # the first chunk ends inside a block: recomputation stops inside its MLP part
            {"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.recompute": True, **lw},
            {"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, **lw, "parallel.zero3_prefetch": 2},
            {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "optim.freeze": r"layers\.2\.mlp|layers\.3\.attn",
             **lw, "parallel.zero3_prefetch": 3}]


@pytest.mark.distributed
@pytest.mark.slow(46)
def test_the_runtime_starts_the_programs_collectives_in_its_order(text_dir, tmp_path):
    todo = cases()
    assert {c["kind"] for c in todo} == set(K)
    one_step = {"run.max_steps": 1}
    results = run_ranks(train_cases, 4, str(text_dir), str(tmp_path), [{**one_step, **c} for c in todo],
                        timeout=600)  # train_cases raises where a rank started other than its program lists
    assert_played(todo, results[0])
    # and every layout, offloaded or not, trains what one process trains (each schedule x ZeRO stage
    # offloaded is compared here and nowhere else)
    assert_same_training(results, str(text_dir), tmp_path)


def test_the_layouts_left_to_the_layout_tests_are_there():
    """Each layout `held_elsewhere` is one the ZeRO and pipeline layout tests run (the same settings
    once defaults are filled in), so leaving it out here loses none of its checks."""
    import enum

    import test_zero
    from pipezero.config import ParallelConfig

    default = ParallelConfig()

    def settings(case: dict) -> dict:  # without the keys that name the default's value
        def given(key: str, value) -> bool:
            if not key.startswith("parallel."):
                return True
            was = getattr(default, key.removeprefix("parallel."))
            return value != (was.value if isinstance(was, enum.Enum) else was)
        return {k: v for k, v in case.items() if given(k, v)}

    there = [settings(c) for c in test_zero.zero_cases(4, 1) + test_zero.zero_cases(2, 2)
             + test_zero.hierarchical_cases() + layouts(4, 1)]
    for case in held_elsewhere():
        assert settings(case) in there, case


def test_the_record_holds_transfers_and_the_loss_sum_where_the_program_places_them():
    """One process, the rules alone: an evaluation's receive is posted where its RECV stands and
    waited for as the F reading it starts, its sends waited for at LOSS_SUM before the world's
    all-reduce starts; a step's sends are waited for at OPTIM_STEP before its reductions; a record
    that posts every receive first, or leaves out LOSS_SUM, departs from the program."""
    from pipezero.config import GradReduce
    from pipezero.schedules.bucket_plan import uniform_plan
    from pipezero.schedules.forward_only import lower_evaluation
    from pipezero.schedules.lowering import lower
    from pipezero.schedules.played import departure, expected
    from pipezero.schedules.program import OptimStep
    from pipezero.schedules.registry import build_schedule

    s = build_schedule(K.ONE_F_ONE_B, 2, 2, 1)
    plan = uniform_plan(2, 2, 100, 1)
    last, first = (lower_evaluation(s, 1, plan, 2, sharded_params=False, layerwise=False, gathers=FP32)[r]
                   for r in (1, 0))
    pairs = [(e.event.value, e.name) for e in expected(last, plan)]
    assert pairs == [("start", "RECV(act 1:0 from 0)"), ("wait", "RECV(act 1:0 from 0)"),
                     ("start", "RECV(act 1:1 from 0)"), ("wait", "RECV(act 1:1 from 0)"), ("start", "LOSS_SUM")]
    assert [e.group for e in expected(last, plan) if e.event.value == "start"] == ["pp", "pp", "world"]
    assert [(e.event.value, e.name) for e in expected(first, plan)] == [
        ("start", "SEND(act 1:0 to 1)"), ("start", "SEND(act 1:1 to 1)"), ("wait", "SEND(act 1:0 to 1)"),
        ("wait", "SEND(act 1:1 to 1)"), ("start", "LOSS_SUM")]
    assert departure(pairs, expected(last, plan)) == ("", frozenset())
    ahead = [pairs[0], pairs[2], pairs[1], pairs[3], pairs[4]]
    assert departure(ahead, expected(last, plan))[0] == \
        "event 1: played start RECV(act 1:1 from 0) where the program says wait RECV(act 1:0 from 0)"
    assert departure(pairs[:-1], expected(last, plan))[0] == "the program's start LOSS_SUM was never played"
    step = lower(s, 2, 2, GradReduce.STEP, uniform_plan(2, 2, 100, 2)).ranks[0]
    events = [(e.event.value, e.name) for e in expected(step, uniform_plan(2, 2, 100, 2))]
    at = next(k for k, i in enumerate(events) if i == ("wait", "SEND(act 1:1 to 2)"))
    assert events[at - 1] == ("wait", "SEND(act 1:0 to 2)") and events[at + 1][1].startswith("REDUCE_GRAD")
    assert any(isinstance(i, OptimStep) for i in step)

def test_each_start_is_expected_in_its_format_and_the_bytes_that_format_sends():
    """One process: a run's formats come from its flags (int8 weights, int4 gradients, bf16 elsewhere,
    the masters gathered after a ZeRO-1/2 step in fp32 unless quantized), and the program prices each
    start in its format's bytes, codes and one fp32 scale a block for a quantized message; a kept
    gathered chunk's UNSHARD is expected bucket by bucket, each its own message."""
    from pipezero.config import GradQuant, GradReduce, ParallelConfig, WeightQuant
    from pipezero.schedules.bucket_plan import uniform_plan
    from pipezero.schedules.compile import wires_of
    from pipezero.schedules.lowering import lower
    from pipezero.schedules.played import expected
    from pipezero.schedules.registry import build_schedule
    from pipezero.schedules.wire import BF16, WireFormat

    p = ParallelConfig(quantize_weights=WeightQuant.INT8, quantize_grads=GradQuant.INT4, quant_block=64)
    wires = wires_of(p, bf16=True)
    int8, int4 = WireFormat("int8", 64), WireFormat("int4", 64)
    assert (wires.gathers, wires.grads, wires.updates) == (int8, int4, int8)
    assert (wires_of(ParallelConfig(), bf16=True).updates, wires_of(ParallelConfig(), bf16=True).grads) == (FP32, BF16)
    assert (int8.bytes(100), int4.bytes(100)) == (128 + 2 * 4, 64 + 2 * 4)  # two blocks of 64, padded

    s = build_schedule(K.ONE_F_ONE_B, 2, 2, 1)
    plan = uniform_plan(2, 3, 1000, 2)
    starts = [e for e in expected(lower(s, 2, 3, GradReduce.STEP, plan, wires=wires).ranks[0], plan)
              if e.event.value == "start" and not e.name.startswith(("SEND", "RECV"))]
    sizes = plan.buckets(0)
    assert [(e.name, e.wire, e.nbytes) for e in starts if e.name.startswith("UNSHARD")] == \
        [(f"UNSHARD(0.{k})", "int8", int8.bytes(n)) for k, n in enumerate(sizes)]
    assert sorted((e.name, e.wire, e.nbytes) for e in starts if e.name.startswith("REDUCE_GRAD")) == \
        sorted((f"REDUCE_GRAD(0.{k})", "int4", int4.bytes(n)) for k, n in enumerate(sizes))
    assert (starts[-1].name, starts[-1].wire, starts[-1].nbytes) == ("OPTIM_STEP", "fp64", 16)



def test_the_record_holds_each_wait_at_the_place_the_program_gives_it():
    """One process, the rules alone: every wait for a gather or a reduction is expected at the
    instruction that waits (`#i`, inside compute instruction i `#i@moment`): a prefetched layer's at its
    WAIT's moment, ZeRO-1's updated weights at the next program's WAITs in its first forward. A record
    whose wait happened elsewhere (the runtime waiting on its own as a layer computes, outside the
    WAIT: no moment) departs, naming both places; a program after the step that never waits for the
    gathers the step left in flight departs, naming the gather."""
    from pipezero.config import GradReduce
    from pipezero.schedules.bucket_plan import uniform_plan
    from pipezero.schedules.forward_only import lower_evaluation
    from pipezero.schedules.lowering import lower
    from pipezero.schedules.played import departure, expected
    from pipezero.schedules.registry import build_schedule

    s = build_schedule(K.ONE_F_ONE_B, 2, 2, 1)
    plan = uniform_plan(2, 3, 100, 2)
    layerwise = lower(s, 2, 3, GradReduce.STEP, plan, keep_gathered=False, depth=2).ranks[0]
    want = expected(layerwise, plan)
    record = [(e.event.value, e.name, e.place) for e in want]
    assert departure(record, want) == ("", frozenset())
    assert ("wait", "UNSHARD(0.1)", "#0@fwd 1") in record and ("wait", "UNSHARD(0.2)", "#0@fwd 0") in record
    at = record.index(("wait", "UNSHARD(0.1)", "#0@fwd 1"))
    moved = record[:at] + [("wait", "UNSHARD(0.1)", "#0")] + record[at + 1:]
    assert departure(moved, want)[0] == f"event {at}: wait UNSHARD(0.1) played at #0, where the program places it " \
                                        f"at #0@fwd 1"

    overlap = lower(s, 2, 1, GradReduce.STEP, plan, overlap_gather=True).ranks[0]
    step = expected(overlap, plan)
    problem, carried = departure([(e.event.value, e.name, e.place) for e in step], step)
    assert problem == "" and carried == {"UNSHARD(0.0)", "UNSHARD(0.1)", "UNSHARD(0.2)"}
    assert [(e.name, e.place) for e in step[:3]] == [("UNSHARD(0.2)", "#0@fwd 0"), ("UNSHARD(0.1)", "#0@fwd 1"),
                                                     ("UNSHARD(0.0)", "#0@fwd 2")]
    waiting = lower_evaluation(s, 2, plan, 1, sharded_params=False, layerwise=False, gathers=FP32,
                               update_waits=True)[0]
    blind = lower_evaluation(s, 2, plan, 1, sharded_params=False, layerwise=False, gathers=FP32)[0]
    for program, problem in ((waiting, ""), (blind, "UNSHARD(0.0), left in flight by the program before, was never "
                                                    "waited for")):
        events = expected(program, plan)
        assert departure([(e.event.value, e.name, e.place) for e in events], events, carried)[0] == problem


def test_the_record_holds_the_steps_world_all_reduce_at_optim_step():
    """One process, the rules alone: OPTIM_STEP's all-reduce of (norm^2, loss) starts after the
    step's sends and reductions are waited for, in the world group, 16 bytes, at OPTIM_STEP's own
    place: an optimizer step the caller plays after the program (no instruction under way) departs,
    naming both places, even where every event comes in the same order."""
    from pipezero.config import GradReduce
    from pipezero.schedules.bucket_plan import uniform_plan
    from pipezero.schedules.lowering import lower
    from pipezero.schedules.played import departure, expected
    from pipezero.schedules.program import OptimStep
    from pipezero.schedules.registry import build_schedule

    s = build_schedule(K.ONE_F_ONE_B, 1, 2, 1)
    plan = uniform_plan(1, 2, 100, 1)
    program = lower(s, 1, 3, GradReduce.STEP, plan, keep_gathered=False).ranks[0]
    at = next(k for k, i in enumerate(program) if isinstance(i, OptimStep))
    want = expected(program, plan)
    starts = [e for e in want if e.event.value == "start" and e.name == "OPTIM_STEP"]
    assert [(e.nbytes, e.group, e.place) for e in starts] == [(16, "world", f"#{at}")]
    assert want[-1] == starts[0]  # nothing after it at ZeRO-3 one replica: only its place tells it apart
    record = [(e.event.value, e.name, e.place) for e in want]
    assert departure(record, want) == ("", frozenset())
    outside = record[:-1] + [("start", "OPTIM_STEP", "")]
    assert departure(outside, want)[0] == \
        f"event {len(record) - 1}: start OPTIM_STEP played at no instruction, where the program places it at #{at}"


def test_only_named_readers_wait_outside_the_programs_for_the_gathers_a_program_left():
    """One process, the rules alone: ZeRO-1's updated weights gathered in flight past the step
    (--overlap-gather) are waited for by the next program's WAITs; a checkpoint between them may wait
    first (its waits head the next record, named), and the WAITs then find them landed. A WAIT that
    finds a carried gather landed with no named reader before it, or a wait outside the programs by
    anyone else, or by a reader that cannot stand at that boundary, departs."""
    from pipezero.config import GradReduce
    from pipezero.schedules.bucket_plan import uniform_plan
    from pipezero.schedules.lowering import lower
    from pipezero.schedules.played import departure, expected
    from pipezero.schedules.registry import build_schedule

    s = build_schedule(K.ONE_F_ONE_B, 2, 2, 1)
    plan = uniform_plan(2, 3, 100, 2)
    program = lower(s, 2, 1, GradReduce.STEP, plan, overlap_gather=True).ranks[0]
    want = expected(program, plan)
    _, carried = departure([(e.event.value, e.name, e.place) for e in want], want)
    assert carried == {"UNSHARD(0.0)", "UNSHARD(0.1)", "UNSHARD(0.2)"}
    played = [(e.event.value, e.name, e.place, e.event.value == "wait" and e.name in carried) for e in want]
    read = [("wait", n, "outside: checkpoint") for n in sorted(carried)]
    assert departure(read + played, want, carried)[0] == ""
    first = next(k for k, p in enumerate(played) if p[3])
    assert departure(played, want, carried)[0] == \
        f"event {first}: wait {played[first][1]} found its gather landed, where the program before left it in " \
        f"flight: something outside the programs waited for it"
    stranger = [("wait", "UNSHARD(0.0)", "outside: summary")]
    assert departure(stranger + played, want, carried)[0].startswith(
        "before the program: wait UNSHARD(0.0) by summary outside every program")
    assert departure(read + played, want, frozenset())[0].startswith("before the program: wait UNSHARD(0.0) by "
                                                                    "checkpoint")
    # a named reader only where it may stand: a snapshot's gathers (gather_all) come after every
    # program, so a program headed by them (a gather_all back before the evaluation) departs
    snapshot = [("wait", n, "outside: snapshot") for n in sorted(carried)]
    assert departure(snapshot + played, want, carried)[0] == ""  # any named reader, with no boundary given
    assert departure(snapshot + played, want, carried, ("checkpoint", "memory profile"))[0] == \
        "before the program: wait UNSHARD(0.0) by snapshot outside every program (only checkpoint, memory profile " \
        "wait there, for gathers a program left in flight)"
