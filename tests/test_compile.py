"""The one compile step (schedules/compile.py) and the runtime that plays what it placed, in one process.

The plan's view of the built-in decoder (models/presets.py `layer_tensors`, what simulate, plan and
the memory model compile from) is the model a run builds (stage.model_shapes, on the meta
device), so every command groups the same buckets; ZeRO lays its buffers out from the plan's
layouts and refuses a model that differs; layer by layer, the hooks fire only what the program
placed, and a program that places a gather at a moment the action never reaches fails loudly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipezero.config import ModelConfig, OptimConfig, ParallelConfig, Zero3Unit
from pipezero.config import ScheduleKind as K
from pipezero.models import apply_preset, build_chunk, spec_of
from pipezero.models.presets import decoder_shapes
from pipezero.schedules.actions import Action, Op
from pipezero.schedules.compile import compile_plan
from pipezero.schedules.layer_plan import Moment, Trigger
from pipezero.schedules.program import Collective, Compute, DataParallel, Kind
from pipezero.stage import model_shapes
from pipezero.zero.buckets import build_buckets, named_by_chunk


def tiny(**kw) -> ModelConfig:
    return dataclasses.replace(apply_preset(ModelConfig(), "tiny"), **{"n_layers": 3, "dim": 32, "n_heads": 4,
                                                                       "vocab_size": 64, **kw})


@pytest.mark.parametrize("kw", [{}, {"tie_embeddings": True}, {"n_kv_heads": 2},
                                {"qkv_bias": True, "out_bias": True, "mlp_bias": True, "tie_embeddings": True}])
@pytest.mark.parametrize("bounds", [[(0, 5)], [(0, 2), (2, 5)], [(0, 1), (1, 3), (3, 4), (4, 5)]])
def test_the_plans_decoder_is_the_model_a_run_builds(kw, bounds):
    """The planner's decoder names its blocks' parts; a run reads them only for --zero3-unit sublayer."""
    cfg = tiny(**kw)
    planned = decoder_shapes(cfg, bounds)
    assert planned == model_shapes(spec_of(cfg), bounds, None, parts=True)
    whole = [[dataclasses.replace(x, parts=()) for x in c.layers] for c in planned.chunks]
    assert whole == [list(c.layers) for c in model_shapes(spec_of(cfg), bounds, None).chunks]


def test_a_head_tied_in_one_chunk_borrows_the_embedding_and_apart_holds_a_copy():
    cfg = tiny(tie_embeddings=True)
    one = decoder_shapes(cfg, [(0, 5)])
    head = one.chunks[0].layers[-1]
    assert head.borrows == ("layers.0.weight",) and [t.name for t in head.tensors] == ["layers.4.norm.weight"]
    assert one.tied is None
    apart = decoder_shapes(cfg, [(0, 2), (2, 5)])
    assert apart.tied == ("layers.0.weight", "layers.4.proj.weight") and not apart.chunks[1].layers[-1].borrows
    frozen = model_shapes(spec_of(cfg), [(0, 2), (2, 5)], r"layers\.0\.")  # a tied pair freezes together
    assert frozen.tied is None and all(t.name != "layers.4.proj.weight" for t in frozen.chunks[1].tensors)


def test_zero_builds_the_plans_buckets_and_refuses_another_model():
    cfg = tiny()
    chunk = build_chunk(cfg, 0, 5, seed=0)
    named = named_by_chunk({0: chunk})[0]
    p = ParallelConfig(pp=1, dp=2, zero=2, microbatches=2, bucket_mb=0.01)
    plan = compile_plan(p, decoder_shapes(cfg, [(0, 5)]))
    buckets = build_buckets(plan.layouts(0), named, 2, 0)
    assert [b.padded for b in buckets] == list(plan.buckets.buckets(0)) and len(buckets) > 2
    assert [b.names for b in buckets] == [[t.name for t in lay.tensors] for lay in plan.layouts(0)]
    assert buckets[0].names[0] == "layers.4.proj.weight"  # reverse model order: the head's last tensor first
    with pytest.raises(ValueError, match=r"trainable parameters \['layers\.0\.weight', .*\] are in no bucket"):
        build_buckets(plan.layouts(0)[:-1], named, 2, 0)
    wider = compile_plan(p, decoder_shapes(tiny(dim=64), [(0, 5)]))
    with pytest.raises(ValueError, match=r"the plan puts layers\.4\.proj\.weight \[64, 64\] in a bucket; the model "
                                         r"has \[64, 32\]"):
        build_buckets(wider.layouts(0), named, 2, 0)


def layer_by_layer(cfg: ModelConfig, unit: Zero3Unit = Zero3Unit.LAYER):
    """One process, one chunk, ZeRO-3 layer by layer on one data-parallel rank, as stage.py builds it."""
    from pipezero.zero import layerwise
    from pipezero.zero.buckets import shared_params
    from pipezero.zero.sharded import ZeroDP

    plan = compile_plan(ParallelConfig(pp=1, dp=1, zero=3, microbatches=1, zero3_unit=unit),
                        decoder_shapes(cfg, [(0, 5)]))
    assert plan.layerwise
    chunks = {0: build_chunk(cfg, 0, 5, seed=0)}
    zero = ZeroDP(named_by_chunk(chunks), shared_params(chunks), 3, 1, 0, None, OptimConfig(), {0: plan.layouts(0)},
                  keep_gathered=False)
    layerwise.install(zero, chunks, {0: plan.units(0)})
    return plan, chunks[0], zero


def test_layer_by_layer_hooks_fire_what_the_program_placed_and_decide_nothing():
    cfg = tiny(tie_embeddings=True)
    plan, chunk, zero = layer_by_layer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    f = next(i for i in plan.program.ranks[0] if isinstance(i, Compute) and i.kind is Kind.F)
    zero.comm.new_step()
    zero.begin_compute(f)
    chunk(tokens)
    zero.end_compute(f)
    listed = [f"UNSHARD(0.{d.bucket})" for d in f.during if d.kind is Kind.UNSHARD]
    assert zero.comm.issued == listed and len(listed) == 6  # five layers, the embedding again for the tied head
    assert zero.sharded.gathered_bytes() == 0  # nothing outlives the action
    # outside any program nothing is gathered: the first layer computes on its shard, and says so
    zero.comm.new_step()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"a forward outside any program, layer 0 computes "
                                                              r"with bucket 0\.4 .*never gathered"):
        chunk(tokens)
    assert zero.comm.issued == []
    # a program that places nothing: the first layer computes on its shard, and says so
    zero.begin_compute(Compute(f.action))
    with pytest.raises(RuntimeError, match=r"0F0, layer 0 computes with bucket 0\.4 .*never gathered"):
        chunk(tokens)
    zero.armed = None


def test_sublayer_units_gather_and_reduce_a_blocks_attention_and_mlp_apart():
    """--zero3-unit sublayer: a bucket a block's part (its attention with its norm, its MLP with its
    norm); the hooks fire exactly what the program placed in a forward and a reducing backward, at
    most two parts' weights are present at a block's part, and the loss and gradients are those of
    whole-layer units."""
    cfg = tiny()
    whole, wchunk, wzero = layer_by_layer(cfg)
    plan, chunk, zero = layer_by_layer(cfg, Zero3Unit.SUBLAYER)
    layouts = plan.layouts(0)
    assert len(layouts) == len(whole.layouts(0)) + cfg.n_layers
    modules = [{t.name.split(".")[2] for t in lay.tensors} for lay in layouts]
    assert modules[:3] == [{"norm", "proj"}, {"mlp_norm", "mlp"}, {"attn_norm", "attn"}]  # last unit first
    assert [(u.index, u.part) for u, _ in plan.units(0)][:4] == [(0, 0), (1, 0), (1, 1), (2, 0)]
    assert plan.units(0)[1][1] == ("attn_norm", "attn") and plan.units(0)[0][1] == ()
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    grads, losses = [], []
    for p, ch, z in ((whole, wchunk, wzero), (plan, chunk, zero)):
        f, bw = (next(i for i in p.program.ranks[0] if isinstance(i, Compute) and i.kind is k) for k in (Kind.F, Kind.BW))
        z.begin_step()
        for ins in (f, bw):
            z.begin_compute(ins)
            if ins is f:
                losses.append(ch(tokens).float().square().mean())
            else:
                z.before_backward(0)
                losses[-1].backward()
            z.end_compute(ins)
            placed = [f"{d.kind.name}(0.{d.bucket})" for d in ins.during if d.kind in (Kind.UNSHARD, Kind.REDUCE_GRAD)]
            assert [x for x in z.comm.issued if x.startswith(("UNSHARD", "REDUCE_GRAD"))] == placed
            z.comm.played.clear()
        z.comm.drain()
        grads.append({n: b.shard_grad[o:o + q.numel()] for b in z.all_buckets()
                      for n, o, q in zip(b.names, b.offsets, b.params)})
    assert torch.equal(losses[0], losses[1]) and grads[0].keys() == grads[1].keys()
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    block = sum(lay.numel for lay in whole.layouts(0)[1:2])
    assert zero.sharded.peak < wzero.sharded.peak and zero.sharded.peak <= 4 * block  # fp32 bytes: one block + a part
    assert sum(int(d.kind is Kind.UNSHARD) for d in f.during) == 2 + 2 * cfg.n_layers


def test_a_collective_placed_at_a_moment_the_action_never_reaches_is_an_error():
    cfg = tiny()
    plan, chunk, zero = layer_by_layer(cfg)
    f = next(i for i in plan.program.ranks[0] if isinstance(i, Compute) and i.kind is Kind.F)
    stray = DataParallel(Kind.RESHARD, 0, 0, Collective.LOCAL, 0, at=Trigger(Moment.BACKWARD, 4))
    bad = Compute(f.action, (*f.during, stray))
    zero.begin_compute(bad)
    chunk(torch.randint(0, cfg.vocab_size, (2, 8)))
    with pytest.raises(RuntimeError, match=r"0F0: the program placed RESHARD\(0\.0\)@bwd 4 at bwd 4, a moment this "
                                           r"action never reached"):
        zero.end_compute(bad)


def test_layer_by_layer_lists_each_actions_gathers_where_its_layers_run():
    """zb-h1 at P=2: F gathers forward, one layer ahead; BW and the first chunk's W (autograd again)
    gather backward with each bucket's reduction inside; a later chunk's W (from B's stash) and the
    first chunk's B (no input gradient) read no weights."""
    p = ParallelConfig(pp=2, dp=2, zero=3, schedule=K.ZB_H1, microbatches=2, zero3_keep_gathered=False)
    plan = compile_plan(p, decoder_shapes(tiny(), [(0, 3), (3, 5)]))
    listed = {str(i.action): i.describe() for i in plan.program.ranks[0] if isinstance(i, Compute)}
    assert listed["0F0"] == ("0F0[UNSHARD(0.2, wait)@fwd 0 UNSHARD(0.1)@fwd 0 RESHARD(0.2)@fwd-end 0 "
                             "WAIT(0.1)@fwd 1 UNSHARD(0.0)@fwd 1 RESHARD(0.1)@fwd-end 1 WAIT(0.0)@fwd 2 "
                             "RESHARD(0.0)@fwd-end 2]")
    assert listed["0B0"] == "0B0"
    assert listed["0W1"].startswith("0W1[UNSHARD(0.0, wait)@bwd 2 UNSHARD(0.1)@bwd 2 RESHARD(0.0)@bwd 1")
    later = {str(i.action): i.describe() for i in plan.program.ranks[2] if isinstance(i, Compute)}
    assert later["1W1"] == "1W1" and later["1B0"].startswith("1B0[UNSHARD(1.0, wait)@bwd 4")
    assert Action(1, Op.W, 1) in plan.schedule.actions[1]


def test_with_recompute_a_blocks_backward_gathers_what_its_forward_run_again_uses():
    """--recompute reruns each block's forward inside its own backward (runtime/recompute.py), inside
    the block module's call: a whole block's hooks do not fire again, so its gathers are a plain
    backward's (its bucket, gathered at its `bwd`, serves the rerun). A block's parts (--zero3-unit
    sublayer) are hooked on sub-modules the rerun calls: after the MLP's `bwd` (the first saved
    tensor the block's backward needs is the MLP's) the rerun's attention uses the gather the MLP's
    `bwd` prefetched and keeps it for its own backward (its `fwd-end` releases nothing), and the
    rerun's MLP prefetches nothing past the block. W has no stash with recompute: it runs autograd
    again."""
    shapes = decoder_shapes(tiny(), [(0, 3), (3, 5)])
    p = ParallelConfig(pp=2, dp=2, zero=3, schedule=K.ZB_H1, microbatches=2, zero3_keep_gathered=False)

    def computes(**how) -> dict[str, str]:
        plan = compile_plan(dataclasses.replace(p, **how), shapes)
        return {str(i.action): i.describe() for i in plan.program.ranks[2] if isinstance(i, Compute)}

    plain, again = computes(), computes(recompute=True)
    assert again["1B0"] == plain["1B0"] == ("1B0[UNSHARD(1.0, wait)@bwd 4 UNSHARD(1.1)@bwd 4 RESHARD(1.0)@bwd 3 "
                                            "WAIT(1.1)@bwd 3 RESHARD(1.1)@end]")
    assert plain["1W0"] == "1W0" and again["1W0"] == again["1B0"].replace("1B0", "1W0")
    parts = computes(recompute=True, zero3_unit=Zero3Unit.SUBLAYER)["1B0"]
    # buckets of chunk 1, last unit first: 0 the head, 1 block 3's MLP, 2 block 3's attention
    assert parts == ("1B0[UNSHARD(1.0, wait)@bwd 4 UNSHARD(1.1)@bwd 4 RESHARD(1.0)@bwd 3.1 WAIT(1.1)@bwd 3.1 "
                     "UNSHARD(1.2)@bwd 3.1 WAIT(1.2)@fwd 3 RESHARD(1.1)@bwd 3 RESHARD(1.2)@end]")


def test_a_layer_reading_a_gather_before_its_wait_is_an_error_naming_bucket_layer_and_instruction():
    """The runtime waits for a gather only where the program's WAIT says. Layer by layer: an F whose
    WAIT for a prefetched layer is taken out raises as that layer computes. ZeRO-1 with
    --overlap-gather: with the step's gathers of updated weights in flight, a forward whose program
    places no WAIT raises at its first layer, and a program that ends with one in flight raises at its
    end; the F as compiled waits for each bucket at its first reading layer, recorded there."""
    from pipezero.schedules.played import expected
    from pipezero.zero import weight_waits
    from pipezero.zero.buckets import shared_params
    from pipezero.zero.sharded import ZeroDP

    cfg = tiny()
    tokens = torch.randint(0, cfg.vocab_size, (2, 8))
    plan, chunk, zero = layer_by_layer(cfg)
    f = next(i for i in plan.program.ranks[0] if isinstance(i, Compute) and i.kind is Kind.F)
    w = next(d for d in f.during if d.kind is Kind.WAIT)
    zero.enter(3)
    zero.begin_compute(Compute(f.action, tuple(d for d in f.during if d is not w)))
    with pytest.raises(RuntimeError, match=rf"0F0 \(#3\), layer {w.at.index} computes with bucket 0\.{w.bucket} "
                                           rf"\(.*\) before its program waits for its gather \(no WAIT\(0\.{w.bucket}\)"):
        chunk(tokens)

    plan = compile_plan(ParallelConfig(pp=1, dp=1, zero=1, microbatches=1), decoder_shapes(cfg, [(0, 5)]))
    chunks = {0: build_chunk(cfg, 0, 5, seed=0)}
    zero = ZeroDP(named_by_chunk(chunks), shared_params(chunks), 1, 1, 0, None, OptimConfig(), {0: plan.layouts(0)})
    weight_waits.install(zero, chunks, {0: plan.buckets.reads(0)})
    program = plan.program.ranks[0]
    step = next(k for k, i in enumerate(program) if i.kind is Kind.OPTIM_STEP)

    def gathers_started() -> None:  # the UNSHARDs after the step, none of which blocks
        for k in range(step + 1, len(program)):
            zero.enter(k)
            zero.play(program[k])
        zero.comm.new_step()

    f = program[0]
    assert isinstance(f, Compute) and f.kind is Kind.F and all(d.kind is Kind.WAIT for d in f.during)
    gathers_started()
    zero.enter(0)
    zero.begin_compute(Compute(f.action))  # its WAITs taken out
    first = f.during[0]
    with pytest.raises(RuntimeError, match=rf"0F0 \(#0\), layer {first.at.index} computes with bucket "
                                           rf"0\.{first.bucket} \(.*\) before its program waits for its updated "
                                           rf"weights \(no WAIT\(0\.{first.bucket}\) at or before fwd 0\)"):
        chunks[0](tokens)
    zero.armed = None
    with pytest.raises(RuntimeError, match=rf"OPTIM_STEP: the gather of bucket 0\.{first.bucket} \(.*\) is still in "
                                           rf"flight: its program never waits for it \(no WAIT\(0\.{first.bucket}\)\)"):
        zero.end_program("OPTIM_STEP")
    zero.comm.settle()
    gathers_started()
    zero.enter(0)
    zero.begin_compute(f)
    chunk_out = chunks[0](tokens)
    zero.end_compute(f)
    zero.end_program("OPTIM_STEP")  # every gather waited for
    assert chunk_out.shape[:2] == tokens.shape
    waits = [(p.name, p.place) for p in zero.comm.played if p.event.value == "wait"]
    assert waits == [(e.name, e.place) for e in expected(program, plan.buckets) if e.event.value == "wait"][:len(waits)]
    assert waits and [p for _, p in waits] == [f"#0@{d.at}" for d in f.during]
