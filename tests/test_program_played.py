"""The runtime plays the data-parallel collectives its lowered program lists, as the program says.

Each rank records what it plays (zero/coordinator.py `played`: each start of a bucket's collective
with its bytes, wire type and group, and each wait for a reduction, named as the program names
them) and tests/training.py `train_cases` holds every step's record against `expected` of the
rank's program (schedules/played.py) for every run of every layout test; this test runs the
layouts below for one step each and checks that the records are not empty. Point-to-point
transfers need no such record: the executor posts them by playing the program's SEND and RECV
instructions in order (runtime/executor.py `run`).

Covered: every schedule with ZeRO 0-3 at P=2 D=2 (with --offload optimizer and two micro-batches'
activations offloaded: their host copies and steps held to the program too), the stages that move the most at P=4 D=1 and P=1
D=4, both placements, `--hierarchical`, per-micro-batch reductions and a tied embedding (TIED_SUM,
then the reductions of the buckets holding its copies, before the step). Layer-by-layer ZeRO-3
(the default at P=1, asked for at P=2): its gathers sit inside the compute instructions and are
held to the program like any other, under fused and split backward (W from B's stash, and W of the
first chunk running autograd again), the V placement, --recompute (the forward run again inside each
backward, its layers gathered again as the program lists them), a head tied to the embedding in
one chunk (it borrows the embedding's bucket) or across chunks, and frozen layers; and with each
layer's gather started 2 or 3 layers ahead (--zero3-prefetch); and with a block's attention and MLP
gathered and reduced apart (--zero3-unit sublayer). Every case's weights after its step, its loss
and gradient norm equal one process's.
"""

from __future__ import annotations

import pytest

from pipezero.config import ScheduleKind as K
from ranks import run_ranks
from training import assert_same_training, train_cases


def cases() -> list[dict]:
    out = []
    # every schedule x ZeRO stage offloaded: its collectives in the program's order as plain (the other
    # layout tests hold plain runs' records), and its host copies and host steps, and its activation
    # copies, where the program places them
    offloaded = {"parallel.offload": "optimizer", "parallel.offload_activations": 2}
    for kind in K:
        for zero in (0, 1, 2, 3):
            out.append({"pp": 2, "dp": 2, "kind": kind, "m": 4, "parallel.zero": zero, **offloaded})
    out += [{"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": z, "parallel.grad_reduce": "microbatch"}
            for z in (2, 3)]
    out += [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": z, "parallel.placement": "pp-inner"}
            for z in (1, 3)]
    out += [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": 1, "parallel.overlap_gather": o}
            for o in (True, False)]
    # the in-flight bound is the program's: two reductions left in flight, split and fused backward
    out += [{"pp": 2, "dp": 2, "kind": kind, "m": 4, "parallel.zero": 2, "parallel.buckets_in_flight": 2,
             "parallel.bucket_mb": 0.02} for kind in (K.ZB_H1, K.ONE_F_ONE_B)]
    two = {"parallel.hierarchical": True, "parallel.ranks_per_node": 2}
    out += [{"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": z, **two} for z in (0, 1, 2, 3)]
    out += [{"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 0},  # (keep_gathered: ZeRO-3's only)
            {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 3, "parallel.zero3_keep_gathered": True}]
    out += [{"pp": 2, "dp": 2, "kind": K.ZB_V, "m": 4, "parallel.zero": 2, "parallel.placement": "pp-inner", **two}]
    out += [{"pp": 4, "dp": 1, "kind": kind, "m": 8, "parallel.zero": 0} for kind in (K.ONE_F_ONE_B, K.ZB_V)]
    # a tied embedding: summed between the ends (or on the V's turn rank), then its buckets reduced
    tied = {"model.tie_embeddings": True}
    out += [{"pp": 2, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 4, "parallel.zero": z, **tied} for z in (0, 1, 2, 3)]
    out += [{"pp": 2, "dp": 2, "kind": K.ZB_V, "m": 4, "parallel.zero": 2, **tied},
            {"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.zero": 1, "parallel.placement": "pp-inner", **tied},
            {"pp": 4, "dp": 1, "kind": K.INTERLEAVED_1F1B, "m": 8, "parallel.zero": 0, **tied}]
    # ZeRO-3 layer by layer: the gathers inside each action, one layer ahead
    lw = {"parallel.zero": 3, "parallel.zero3_keep_gathered": False}
    out += [{"pp": 2, "dp": 2, "kind": kind, "m": 4, **lw} for kind in (K.ONE_F_ONE_B, K.ZB_H1, K.ZB_V,
                                                                         K.INTERLEAVED_1F1B)]
    out += [{"pp": 2, "dp": 2, "kind": K.ZB_H1, "m": 4, "parallel.recompute": True, **lw},
            {"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.recompute": True, **lw},
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
    return [{"pp": 1, "dp": 4, "kind": K.ONE_F_ONE_B, "m": 2, **lw, "parallel.zero3_prefetch": d} for d in (2, 3)] + [
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
@pytest.mark.slow(55)
def test_the_runtime_starts_the_programs_collectives_in_its_order(text_dir, tmp_path):
    todo = cases()
    assert {c["kind"] for c in todo} == set(K)
    one_step = {"run.max_steps": 1}
    results = run_ranks(train_cases, 4, str(text_dir), str(tmp_path), [{**c, **one_step} for c in todo],
                        timeout=600)  # train_cases raises where a rank started other than its program lists
    first = [r["started"] for r in results[0]]  # rank 0's, case by case
    # the comparison had something to compare: reductions everywhere, each waited for, gathers at
    # ZeRO-1-3 with D > 1
    assert all(any(s.startswith("REDUCE_GRAD") for s in started) for started in first)
    assert all(sorted(w for w in r["waited"] if w.startswith("REDUCE_GRAD"))
               == sorted(s for s in r["started"] if s.startswith("REDUCE_GRAD")) for r in results[0])
    assert all(any(w.startswith("UNSHARD") for w in r["waited"]) for c, r in zip(todo, results[0])
               if c["parallel.zero"] == 3 and c["dp"] > 1)  # every gather is waited for too
    assert all(any(s.startswith("UNSHARD") for s in started) for c, started in zip(todo, first)
               if c["parallel.zero"] and c["dp"] > 1)
    assert all(any(s.startswith("TIED_SUM") for s in started) for c, started in zip(todo, first)
               if c.get("model.tie_embeddings") and c["pp"] > 1)  # rank 0 holds the embedding in every tied case
    for c, started in zip(todo, first):  # an offloaded step copies and steps every bucket on the host
        if c.get("parallel.offload") == "optimizer":
            copied = sorted(s[len("OFFLOAD_GRAD"):] for s in started if s.startswith("OFFLOAD_GRAD"))
            assert copied and copied == sorted(s[len("HOST_STEP"):] for s in started if s.startswith("HOST_STEP")), c
    # and every layout, offloaded or not, trains what one process trains (each schedule x ZeRO stage
    # offloaded is compared here and nowhere else)
    assert_same_training(results, str(text_dir), tmp_path)
