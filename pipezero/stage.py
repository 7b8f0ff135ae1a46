"""One rank's part of a job, built: its place in the mesh, its model chunks, ZeRO over their
parameters, and its program with the executor that plays it.

Everything here happens before the first step and in the same order on every rank: the plan is
compiled (schedules/compile.py: the schedule proven complete, deadlock-free and its posting order
free of cycles, the buckets planned tensor by tensor, every rank's program lowered) before any
transfer, from the model's shapes alone; ZeRO then lays its buffers out as the plan says, and the
executor plays this rank's program. Process groups are created collectively.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch

from pipezero.config import (DType, Offload, ParallelConfig, Partition, SecondaryShard, TrainConfig,
                             Zero3Unit)
from pipezero.errors import ConfigError
from pipezero.freeze import apply_freeze
from pipezero.models import ModelSpec, build_chunk, compile_blocks, spec_of
from pipezero.models.chunk import StageChunk, place_hollow
from pipezero.models.meta import shapes_only
from pipezero.models.parts import checked_parts
from pipezero.models.llama_spec import LlamaSpec
from pipezero.parallel.device import PeakMemory, synchronizer
from pipezero.parallel.hierarchical import Hierarchy, build_hierarchy, split_by_node
from pipezero.parallel.mesh import Groups, Mesh, build_groups
from pipezero.parallel.partition import partition
from pipezero.parallel.process_group import staged_rank
from pipezero.parallel.staging import transport_for
from pipezero.runtime.executor import Executor
from pipezero.runtime.flight import FlightRecord
from pipezero.runtime.p2p import P2P
from pipezero.runtime.weight_grad import splittable
from pipezero.schedules.actions import Schedule
from pipezero.schedules.check import SimResult
from pipezero.schedules.compile import CompiledPlan, compile_plan, wires_of
from pipezero.schedules.forward_only import EvalInstr
from pipezero.schedules.model_shapes import ChunkShapes, LayerTensors, ModelShapes, TensorShape, layer_of
from pipezero.schedules.program import Instr, defers_update_waits
from pipezero.schedules.program_check import check_placement
from pipezero.schedules.wire import CODE_BITS, WireFormat, Wires
from pipezero.schedules.zero_rules import RULES
from pipezero.settings import check_end_chunks, check_hierarchical
from pipezero.memory.model import prefetch_choice
from pipezero.telemetry.trace import Tracer
from pipezero.zero import layerwise, weight_waits
from pipezero.zero.buckets import named_by_chunk, shared_params
from pipezero.zero.compressed import Wire
from pipezero.zero.quantize import Bits
from pipezero.zero.sharded import ZeroDP
from pipezero.zero.tied import TiedCopies, find_tied, tie_group


@dataclass
class Stage:
    """What one rank holds: its mesh position, schedule, chunks, and the executor that runs them."""

    mesh: Mesh
    groups: Groups
    schedule: Schedule
    predicted: SimResult
    bounds: list[tuple[int, int]]  # [start, stop) layers of every chunk, in model order
    chunks: dict[int, torch.nn.Module]
    executor: Executor
    zero: ZeroDP
    tracer: Tracer
    peaks: PeakMemory
    spec: ModelSpec  # the model the chunks are slices of
    plan: CompiledPlan  # every rank's program and the buckets, compiled once (schedules/compile.py)
    program: tuple[Instr, ...]  # this rank's program for one step (schedules/program.py)
    # every process group this rank is in that the stage made (pp, dp, the tied pair, --hierarchical's
    # and --secondary-shard's subgroups): destroyed when the run is over (engine.release)
    subgroups: tuple[Any, ...] = ()

    def evaluation(self, microbatches: int) -> tuple[EvalInstr, ...]:
        """This rank's held-out evaluation program (schedules/forward_only.py)."""
        return self.plan.evaluation(microbatches)[self.plan.program.global_rank(self.mesh.pp_rank, self.mesh.dp_rank)]

    def sample(self, tokens: int) -> tuple[EvalInstr, ...]:
        """This rank's text-sample program of `tokens` tokens (schedules/forward_only.py)."""
        return self.plan.sample(tokens)[self.plan.program.global_rank(self.mesh.pp_rank, self.mesh.dp_rank)]


def tied_copies(spec: ModelSpec, schedule: Schedule, mesh: Mesh,
                named: dict[int, list[tuple[str, torch.nn.Parameter]]]) -> tuple[TiedCopies | None, Any]:
    """Tied embeddings whose two ends live in different chunks (pp > 1): which copies this rank
    holds and the group that sums their gradients (a collective call on every rank), and that group
    (made even where this rank's copies are frozen: None or this rank's pair)."""
    names = spec.tied_names()
    if names is None or schedule.n_chunks == 1:
        return None, None
    apart = schedule.rank_of_chunk[0] != schedule.rank_of_chunk[schedule.n_chunks - 1]
    group = tie_group(mesh) if apart else None
    local, head = find_tied({n: q for ps in named.values() for n, q in ps}, names)
    return (TiedCopies(local, head, group) if local else None), group


def memory_cuts(cfg: TrainConfig, spec: ModelSpec, device: torch.device) -> list[int] | None:
    """The run's explicit cuts; under `--partition memory` the ones whose largest predicted peak is
    least (memory/partition.py), computed from the run's settings alone so every rank, and the
    prediction in summary.json, cut alike."""
    p = cfg.parallel
    if p.partition is not Partition.MEMORY or p.stage_layers is not None:
        return p.stage_layers
    if type(spec) is not LlamaSpec:
        raise ConfigError(f"--partition memory with the model {type(spec).__name__}: the memory model knows the "
                          f"built-in decoder's layers only; use --partition params or cost, or --stage-layers")
    from pipezero.memory.partition import resolve

    return resolve(cfg, device.type == "cuda").parallel.stage_layers


def model_shapes(spec: ModelSpec, bounds: list[tuple[int, int]], freeze: str | None,
                 parts: bool = False) -> ModelShapes:
    """What the plan needs of the model (schedules/model_shapes.py): every chunk built on the meta
    device (no memory), frozen as the run freezes it, its trainable tensors listed as ZeRO lists
    them (zero/buckets.py `named_by_chunk`: a weight tied inside a chunk once), the tensors each
    layer borrows from another, whether split backward's W can run from B's stash, and with
    `parts` (--zero3-unit sublayer) the parts the spec names (only then is its layer_parts read)."""
    with shapes_only():
        chunks = {c: StageChunk(spec, a, b, 0, init=False) for c, (a, b) in enumerate(bounds)}
    apply_freeze(chunks, spec, freeze)
    named = named_by_chunk(chunks)
    out = []
    for c, chunk in chunks.items():
        name_of = {q: n for n, q in named[c]}  # tensors hash by identity
        by_layer: dict[int, list[TensorShape]] = {}  # grouped once: a scan a layer was layers x tensors
        for n, q in named[c]:
            by_layer.setdefault(layer_of(n), []).append(TensorShape(n, tuple(q.shape)))
        layers = []
        for k, module in chunk.layers.items():
            i = int(k)
            own = tuple(by_layer.get(i, ()))
            borrows = tuple(dict.fromkeys(name_of[q] for q in module.parameters()
                                          if q in name_of and layer_of(name_of[q]) != i))
            if own or borrows:
                named_parts = checked_parts(spec, module, i, own) if parts and not borrows else ()
                layers.append(LayerTensors(i, own, borrows, named_parts))
        splits = c > 0 and all(splittable(m) for m in chunk.modules()
                               if next(m.parameters(recurse=False), None) is not None)
        out.append(ChunkShapes(tuple(layers), splits, bounds[c][1]))
    names = spec.tied_names()
    trainable = {n for ps in named.values() for n, _ in ps}
    tied = names if names and len(bounds) > 1 and set(names) <= trainable else None
    return ModelShapes(tuple(out), tied)


def plan_of(cfg: TrainConfig, spec: ModelSpec, device: torch.device = torch.device("cpu"),
            mesh: Mesh | None = None) -> tuple[CompiledPlan, list[tuple[int, int]]]:
    """The run's plan (schedules/compile.py) and the layers [start, stop) of every chunk: the same on
    every rank, and in `pipezero verify` before any rank starts. `mesh`: only this rank's program
    (a rank plays its own; the others' are the same data, compiled where they run). ScheduleError
    says why a layout's schedule is refused."""
    p = cfg.parallel
    bounds = partition(spec, p.pp * p.virtual_stages, p.partition, cfg.data.seq_len, memory_cuts(cfg, spec, device))
    check_end_chunks([b - a for a, b in bounds])
    mine = {} if mesh is None else {"pp_ranks": (mesh.pp_rank,), "replicas": (mesh.dp_rank,)}
    p = replace(p, zero3_prefetch=prefetch_choice(cfg, device.type == "cuda").depth)  # `auto`: the same on every rank
    split = p.zero3_unit is Zero3Unit.SUBLAYER  # validated: only where ZeRO-3 gathers layer by layer
    return compile_plan(p, model_shapes(spec, bounds, cfg.optim.freeze, split),
                        wires=wires_of(p, cfg.run.dtype is DType.BF16), **mine), bounds


def build_stage(cfg: TrainConfig, rank: int, tracer: Tracer | None = None,
                device: torch.device = torch.device("cpu"), spec: ModelSpec | None = None) -> Stage:
    """This rank's part of the job. `spec` is the model (models/spec.py); None: the built-in
    Llama (or Hugging Face family) that cfg.model describes."""
    p = cfg.parallel
    spec = spec or spec_of(cfg.model)
    tracer = tracer or Tracer(rank, cfg.run.trace, sync=synchronizer(device), keep_steps=cfg.run.trace_steps)
    mesh = Mesh(p.pp, p.dp, rank, p.placement)
    plan, bounds = plan_of(cfg, spec, device, mesh)  # before any transfer
    schedule, predicted = plan.schedule, plan.predicted
    # ZeRO-3 from a folder: chunks stay on the meta device, and each rank reads only its shards
    shards = cfg.model.pretrained is not None and RULES[p.zero].sharded_params
    chunks = {c: build_chunk(spec, *bounds[c], cfg.run.seed, "meta" if shards else device)
              for c in schedule.chunks(mesh.pp_rank)}
    apply_freeze(chunks, spec, cfg.optim.freeze)  # before ZeRO: buckets take trainable tensors only
    source = None
    if cfg.model.pretrained is not None:  # this rank's layers only, tensor by tensor
        from pipezero.models.hf_weights import FlatReader, load_chunk

        for chunk in chunks.values():
            if shards:
                place_hollow(chunk, device)  # trainable tensors: zero bytes, read by ZeRO as shards
            load_chunk(chunk, cfg.model, frozen_only=shards)
        source = FlatReader(cfg.model) if shards else None
    if cfg.run.compile:
        for chunk in chunks.values():
            compile_blocks(chunk)
    groups = build_groups(mesh)
    hierarchy = two_level(cfg, mesh, device)
    node = secondary_node(cfg, mesh)
    rank_of_chunk = {c: mesh.global_rank(r, mesh.dp_rank) for c, r in schedule.rank_of_chunk.items()}
    wire = torch.bfloat16 if cfg.run.dtype is DType.BF16 else torch.float32  # communication dtype
    flight = FlightRecord(rank, mesh.pp_rank, step_of=tracer)  # where this rank is in its program (doctor.py)
    p2p = P2P(rank, rank_of_chunk, (p.micro_batch_size, cfg.data.seq_len, spec.dim), p.timeout_s,
              dtype=wire, boundary=wire, device=device, tracer=tracer, flight=flight)  # bf16: a bf16 residual stream
    named = named_by_chunk(chunks)
    tied, tie = tied_copies(spec, schedule, mesh, named)
    zero = ZeroDP(named, shared_params(chunks), p.zero, p.dp, mesh.dp_rank, groups.dp, cfg.optim,
                  {c: plan.layouts(c) for c in chunks}, p.grad_reduce, p.timeout_s, rank,
                  keep_gathered=not plan.layerwise, tracer=tracer,
                  tied=tied, comm_dtype=wire, device=device,
                  source=source, hierarchy=hierarchy,
                  node=node, offload=p.offload is Offload.OPTIMIZER, **sent_as(plan.wires))
    zero.comm.flight = flight
    p2p.record = zero.comm.played  # one record of what the rank plays: transfers and collectives in their order
    p2p.program_rank = {mesh.global_rank(r, mesh.dp_rank): plan.program.global_rank(r, mesh.dp_rank)
                        for r in range(p.pp)}
    transport = transport_for(device, staged_rank(cfg, device.type))  # ranks sharing a GPU: through host buffers
    p2p.transport = zero.comm.transport = transport
    if zero.tied is not None:
        zero.tied.transport = transport
    if zero.layerwise:
        layerwise.install(zero, chunks, {c: plan.units(c) for c in chunks})
    program = rank_program(plan, mesh, zero)
    if defers_update_waits(program):  # the moments of the program's waits for updated weights
        weight_waits.install(zero, chunks, {c: plan.buckets.reads(c) for c in chunks})
    executor = Executor(chunks, schedule.n_chunks, p2p, cfg.run.dtype, zero, p.recompute, tracer=tracer, flight=flight)
    made = [groups.pp, groups.dp, tie] + [g for h in (hierarchy, node) if h is not None for g in (h.intra, h.inter)]
    return Stage(mesh, groups, schedule, predicted, bounds, chunks, executor, zero, tracer, PeakMemory(device), spec,
                 plan, program, tuple(g for g in made if g is not None))


def rank_program(plan: CompiledPlan, mesh: Mesh, zero: ZeroDP) -> tuple[Instr, ...]:
    """This rank's program, its placement proved: one OPTIM_STEP after everything, every bucket
    reduced after its last gradient, ZeRO-3 compute only on gathered weights. That dp groups agree
    and no waits cycle follows from the lowering itself (every rank compiles the same data) and is
    proved by tests/test_lowering.py, not at every start. The buckets ZeRO built must hold what the
    plan's do: the tied embedding's copies where the plan holds them back for TIED_SUM, a tensor
    used twice where the plan reduces after the backward."""
    mine = plan.program.global_rank(mesh.pp_rank, mesh.dp_rank)
    check_placement(plan.program, mine)
    for what, built, planned in (("the tied embedding's copies", lambda b: b.tied, plan.buckets.held),
                                 ("a tensor used twice", lambda b: any(q in zero.shared for q in b.params),
                                  plan.buckets.shared)):
        ours = {(c, k) for c, bs in zero.buckets.items() for k, b in enumerate(bs) if built(b)}
        theirs = {(c, k) for c, k in planned if c in zero.buckets}
        if ours != theirs:
            raise RuntimeError(f"rank {mesh.rank}: ZeRO holds {what} in buckets {sorted(ours)}, the plan in "
                               f"{sorted(theirs)}")
    return plan.program.ranks[mine]


def sent_as(w: Wires) -> dict[str, Wire | None]:
    """ZeroDP's `weights` and `grads`: the plan's quantized formats (schedules/compile.py `wires_of`,
    the one place the flags are read), as zero/compressed.py sends them; None: the run's float type."""
    def wire(f: WireFormat) -> Wire | None:
        return Wire(Bits(CODE_BITS[f.name]), f.block) if f.quantized else None
    return {"weights": wire(w.gathers), "grads": wire(w.grads)}


def ranks_per_node(p: ParallelConfig) -> int:
    return p.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", p.world_size))


def secondary_node(cfg: TrainConfig, mesh: Mesh) -> Hierarchy | None:
    """With --secondary-shard node, this rank's dp group split by node into subgroups of its own
    (not --hierarchical's: those run on another thread, and two threads must not share a group).
    Refused on every rank alike, before any subgroup exists, where it would save nothing."""
    p = cfg.parallel
    if p.secondary_shard is SecondaryShard.NONE or p.dp == 1:
        return None
    per_node = ranks_per_node(p)
    if problem := secondary_split_problem(p, per_node):
        raise ConfigError(problem)
    return build_hierarchy(mesh.dp_groups(), per_node, timedelta(seconds=p.timeout_s))


def secondary_split_problem(p: ParallelConfig, per_node: int) -> str | None:
    """Why --secondary-shard node cannot split this layout's dp groups over nodes of `per_node`
    ranks, or None. Pure (no process group), so a launcher says it once before any rank starts:
    found only by the ranks, `--nproc 2` on one node would print it twice under torchrun's report."""
    if p.secondary_shard is SecondaryShard.NONE or p.dp == 1:
        return None
    groups = Mesh(p.pp, p.dp, 0, p.placement).dp_groups()
    split = {(len(m), len(ms)) for g in groups for ms in [split_by_node(g, per_node)] for m in ms}
    if split == {(p.dp, 1)}:
        return (f"--secondary-shard node with every replica of a stage on one node ({per_node} ranks a node): it "
                f"keeps a node's copy split over its ranks, so it needs a stage's replicas on 2 or more nodes "
                f"(pipezero cluster --nodes 2 or more, torchrun or srun across nodes); drop it on one node")
    if len(split) != 1 or min(next(iter(split))) < 2:
        return (f"--secondary-shard node with {per_node} ranks a node: each stage's replicas must sit on 2 or more "
                f"nodes with the same number (2 or more) on each, found (ranks a node, nodes) {sorted(split)}; "
                f"choose --placement or --dp so they do, or drop it")
    return None


def hierarchical_split_problem(p: ParallelConfig, per_node: int) -> str | None:
    """Why --hierarchical cannot split this layout's dp groups over nodes of `per_node` ranks, or
    None. Pure, like `secondary_split_problem`: a launcher says it once before any rank starts.
    With every replica of a stage on one node the first level (inside the node) is the whole
    reduction and there is no second: the flag would change nothing but the thread it runs on."""
    if not p.hierarchical or p.dp == 1:
        return None
    groups = Mesh(p.pp, p.dp, 0, p.placement).dp_groups()
    split = {(len(m), len(ms)) for g in groups for ms in [split_by_node(g, per_node)] for m in ms}
    if split == {(p.dp, 1)}:
        return (f"--hierarchical with every replica of a stage on one node ({per_node} ranks a node): its reductions "
                f"inside the node are then the whole reduction, with nothing left to send across nodes, so it "
                f"changes nothing; it needs a stage's replicas on 2 or more nodes (pipezero cluster --nodes 2 or "
                f"more, torchrun across nodes, or parallel.ranks_per_node); drop it on one node")
    if len({n for n, _ in split}) != 1:
        return (f"--hierarchical with {per_node} ranks a node: each stage's replicas must sit on their nodes in equal "
                f"numbers, found (ranks a node, nodes) {sorted(split)}; choose --placement or --dp so they do, or "
                f"drop it")
    return None


def two_level(cfg: TrainConfig, mesh: Mesh, device: torch.device) -> Hierarchy | None:
    """With --hierarchical, this rank's dp group split by node for two-level gradient reductions
    (every rank creates every subgroup; a layout whose groups do not split evenly is refused on
    every rank alike, before any subgroup exists). Nodes are torchrun's: LOCAL_WORLD_SIZE ranks each,
    unless parallel.ranks_per_node says otherwise."""
    p = cfg.parallel
    if not p.hierarchical or p.dp == 1:
        return None
    check_hierarchical(p.hierarchical, device.type)
    per_node = ranks_per_node(p)
    if problem := hierarchical_split_problem(p, per_node):
        raise ConfigError(problem)
    try:
        return build_hierarchy(mesh.dp_groups(), per_node, timedelta(seconds=p.timeout_s))
    except ValueError as e:
        raise ConfigError(f"--hierarchical with {per_node} ranks a node: {e}; choose --placement so each "
                          f"stage's replicas are spread evenly over the nodes") from None
