"""One rank's part of a job, built: its place in the mesh, its model chunks, ZeRO over their
parameters, and its lowered program with the executor that plays it.

Everything here happens before the first step and in the same order on every rank: process groups
are created collectively, and the schedule is proven (schedules/proven.py: complete, deadlock-free,
its posting order free of cycles) before any transfer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from pipezero.config import DType, GradQuant, ParallelConfig, Partition, SecondaryShard, TrainConfig, WeightQuant
from pipezero.errors import ConfigError
from pipezero.freeze import apply_freeze
from pipezero.models import ModelSpec, build_chunk, compile_blocks, spec_of
from pipezero.models.chunk import place_hollow
from pipezero.models.llama_spec import LlamaSpec
from pipezero.parallel.device import PeakMemory, synchronizer
from pipezero.parallel.hierarchical import Hierarchy, build_hierarchy, split_by_node
from pipezero.parallel.mesh import Groups, Mesh, build_groups
from pipezero.parallel.partition import partition
from pipezero.runtime.executor import Executor
from pipezero.runtime.flight import FlightRecord
from pipezero.runtime.p2p import P2P
from pipezero.schedules.actions import Schedule
from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.check import SimResult
from pipezero.schedules.program import Instr, lower
from pipezero.schedules.program_check import check_placement
from pipezero.schedules.proven import ProvenSchedule, proven_layout
from pipezero.schedules.zero_rules import RULES
from pipezero.settings import check_end_chunks, check_hierarchical
from pipezero.telemetry.trace import Tracer
from pipezero.zero import layerwise, updates
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
    program: tuple[Instr, ...]  # this rank's lowered program for one step (schedules/program.py)


def tied_copies(spec: ModelSpec, schedule: Schedule, mesh: Mesh,
                named: dict[int, list[tuple[str, torch.nn.Parameter]]]) -> TiedCopies | None:
    """Tied embeddings whose two ends live in different chunks (pp > 1): which copies this rank
    holds and the group that sums their gradients (a collective call on every rank)."""
    names = spec.tied_names()
    if names is None or schedule.n_chunks == 1:
        return None
    apart = schedule.rank_of_chunk[0] != schedule.rank_of_chunk[schedule.n_chunks - 1]
    group = tie_group(mesh) if apart else None
    local, head = find_tied({n: q for ps in named.values() for n, q in ps}, names)
    return TiedCopies(local, head, group) if local else None


def memory_cuts(cfg: TrainConfig, spec: ModelSpec, device: torch.device) -> list[int] | None:
    """The run's explicit cuts; under `--partition memory` the ones whose largest predicted peak is
    least (sim/memory_partition.py), computed from the run's settings alone so every rank, and the
    prediction in summary.json, cut alike."""
    p = cfg.parallel
    if p.partition is not Partition.MEMORY or p.stage_layers is not None:
        return p.stage_layers
    if type(spec) is not LlamaSpec:
        raise ConfigError(f"--partition memory with the model {type(spec).__name__}: the memory model knows the "
                          f"built-in decoder's layers only; use --partition params or cost, or --stage-layers")
    from pipezero.sim.memory_partition import resolve

    return resolve(cfg, device.type == "cuda").parallel.stage_layers


def build_stage(cfg: TrainConfig, rank: int, tracer: Tracer | None = None,
                device: torch.device = torch.device("cpu"), spec: ModelSpec | None = None) -> Stage:
    """This rank's part of the job. `spec` is the model (models/spec.py); None: the built-in
    Llama (or Hugging Face family) that cfg.model describes."""
    p = cfg.parallel
    spec = spec or spec_of(cfg.model)
    tracer = tracer or Tracer(rank, cfg.run.trace, sync=synchronizer(device), keep_steps=cfg.run.trace_steps)
    mesh = Mesh(p.pp, p.dp, rank, p.placement)
    proven = proven_layout(p.schedule, p.pp, p.microbatches, p.virtual_stages)  # before any transfer
    schedule, predicted = proven.schedule, proven.predicted
    bounds = partition(spec, schedule.n_chunks, p.partition, cfg.data.seq_len, memory_cuts(cfg, spec, device))
    check_end_chunks([b - a for a, b in bounds])
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
    keep = p.zero3_keep_gathered if p.zero3_keep_gathered is not None else p.pp > 1
    named = named_by_chunk(chunks)
    zero = ZeroDP(named, shared_params(chunks), p.zero, p.dp, mesh.dp_rank, groups.dp, cfg.optim,
                  p.grad_reduce, p.bucket_mb, p.timeout_s, rank, keep_gathered=keep, tracer=tracer,
                  tied=tied_copies(spec, schedule, mesh, named), comm_dtype=wire, device=device,
                  overlap_gather=p.overlap_gather, source=source, hierarchy=hierarchy,
                  in_flight=p.buckets_in_flight, node=node, **wires(p))
    zero.comm.flight = flight
    if zero.layerwise:
        layerwise.install(zero.sharded, chunks)
    elif zero.defers_gathers:
        updates.install(zero, chunks)  # each layer waits for its own updated weights
    program = rank_program(proven, mesh, zero, cfg)
    executor = Executor(chunks, schedule.n_chunks, p2p, cfg.run.dtype, zero, p.recompute, tracer=tracer, flight=flight)
    return Stage(mesh, groups, schedule, predicted, bounds, chunks, executor, zero, tracer, PeakMemory(device), spec,
                 program)


def built_buckets(zero: ZeroDP, n_chunks: int) -> BucketPlan:
    """The buckets ZeRO built on this rank, as a plan (other ranks' chunks have none here), with
    those holding a tied embedding's copy."""
    held = frozenset((c, k) for c, bs in zero.buckets.items() for k, b in enumerate(bs) if b.tied)
    tied_numel = zero.tied.local[0].numel() if held and zero.tied is not None else 0
    return BucketPlan(zero.dp, tuple(tuple(b.padded for b in zero.buckets.get(c, [])) for c in range(n_chunks)),
                      held, tied_numel)


def rank_program(proven: ProvenSchedule, mesh: Mesh, zero: ZeroDP, cfg: TrainConfig) -> tuple[Instr, ...]:
    """This rank's lowered program, over the buckets ZeRO actually built (other ranks' chunks are
    left without buckets: this rank plays only its own program), its placement proved: one
    OPTIM_STEP after everything, every bucket reduced after its last gradient, ZeRO-3 compute only
    on gathered weights. That dp groups agree and no waits cycle follows from the lowering itself
    (every rank lowers the same data) and is proved by tests/test_lowering.py, not at every start."""
    s = proven.schedule
    program = lower(s, mesh.dp, cfg.parallel.zero, cfg.parallel.grad_reduce, built_buckets(zero, s.n_chunks),
                    keep_gathered=not zero.layerwise, posts=proven.posts)
    mine = program.global_rank(mesh.pp_rank, mesh.dp_rank)
    check_placement(program, mine)
    return program.ranks[mine]


def wires(p: ParallelConfig) -> dict[str, Wire | None]:
    """ZeroDP's `weights` and `grads`: how --quantize-weights and --quantize-grads send each."""
    bits = {"int8": Bits.INT8, "int4": Bits.INT4}

    def wire(q: WeightQuant | GradQuant) -> Wire | None:
        return Wire(bits[q.value], p.quant_block) if q.value in bits else None
    return {"weights": wire(p.quantize_weights), "grads": wire(p.quantize_grads)}


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
    split = {(len(m), len(ms)) for g in mesh.dp_groups() for ms in [split_by_node(g, per_node)] for m in ms}
    if len(split) != 1 or min(next(iter(split))) < 2:
        raise ConfigError(f"--secondary-shard node with {per_node} ranks a node: each stage's replicas must sit on 2 "
                          f"or more nodes with the same number (2 or more) on each, found (ranks a node, nodes) "
                          f"{sorted(split)}; choose --placement or --dp so they do, or drop it")
    return build_hierarchy(mesh.dp_groups(), per_node, timedelta(seconds=p.timeout_s))


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
    try:
        return build_hierarchy(mesh.dp_groups(), per_node, timedelta(seconds=p.timeout_s))
    except ValueError as e:
        raise ConfigError(f"--hierarchical with {per_node} ranks a node: {e}; choose --placement so each "
                          f"stage's replicas are spread evenly over the nodes") from None
