"""`pipezero simulate --zero`: compile a schedule with ZeRO's collectives for a model preset, prove the
program, and time it twice, with and without its data-parallel traffic, so the table shows what the
gathers and reductions add to the step and to the bubble.

The model only sizes the buckets: the preset's tensors (models/presets.py), cut into chunks the way
`train` cuts them by default (uniform), grouped as a run groups them (the one compile step,
schedules/compile.py). Time stays
in the simulator's unit (F of one stage = 1): `--dp-comm` says how long one rank's link takes to
carry one average stage's parameters, which fixes the bandwidth in bytes per unit.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pipezero.config import GradReduce, ModelConfig, Offload, ParallelConfig, Partition, ScheduleKind, Zero3Unit
from pipezero.schedules.actions import Schedule
from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.check import CostModel
from pipezero.schedules.compile import compile_plan
from pipezero.schedules.model_shapes import ModelShapes
from pipezero.schedules.program import Collective, DataParallel, Kind, OptimStep, Program, flat
from pipezero.schedules.program_check import check_program
from pipezero.schedules.program_sim import CommCost, ProgramResult, simulate_program
from pipezero.schedules.wire import Wires
from pipezero.schedules.zero_rules import RULES


@dataclass(frozen=True)
class ZeroOptions:
    zero: int
    dp: int
    grad_reduce: GradReduce
    preset: str
    bucket_mb: float
    dp_comm: float  # time for one link to carry one average stage's parameters, in F units
    layerwise: bool  # ZeRO-3 layer by layer instead of a chunk kept gathered
    prefetch: bool  # ZeRO-3 kept gathered: gather one action ahead (a what-if; the runtime does not)
    wire_bytes: int  # 2 with bf16 communication, else 4
    optim: float  # the optimizer update's compute time
    wires: Wires = Wires()  # the collectives' formats: the wire type, or --quantize-grads / --quantize-weights
    depth: int = 1  # ZeRO-3 layer by layer: layers a gather starts ahead of its use (--zero3-prefetch)
    unit: Zero3Unit = Zero3Unit.LAYER  # ZeRO-3 layer by layer: a layer, or a block's part (--zero3-unit)
    offload: Offload = Offload.NONE  # --offload optimizer: the program's host copies and host steps
    activations: int = 0  # --offload-activations: micro-batches a rank's program moves to the host

    @property
    def sharded_params(self) -> bool:
        return RULES[self.zero].sharded_params

    @property
    def zero3_layerwise(self) -> bool:
        """ZeRO-3 gathers layer by layer (the flag means nothing below stage 3)."""
        return self.sharded_params and self.layerwise

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ZeroOptions:
        """`simulate`'s flags."""
        depth = args.zero3_prefetch if args.zero3_prefetch is not None else 1
        wires = Wires.of(args.dtype == "bf16", args.quantize_grads, args.quantize_weights, args.quant_block)
        return cls(args.zero, args.dp, GradReduce(args.grad_reduce), args.preset, args.bucket_mb, args.dp_comm,
                   args.zero3_layerwise, args.zero3_prefetch_chunk, 2 if args.dtype == "bf16" else 4,
                   args.optim_cost, wires, depth, Zero3Unit(getattr(args, "zero3_unit", None) or "layer"),
                   Offload(getattr(args, "offload", None) or "none"), getattr(args, "offload_activations", None) or 0)


def preset_model(preset: str, n_chunks: int, seq_len: int = 1024) -> tuple[ModelShapes, int]:
    """`preset`'s tensors cut uniformly into `n_chunks` chunks, and its parameter count."""
    from pipezero.models.presets import apply_preset, decoder_shapes, param_count
    from pipezero.parallel.partition import partition

    cfg = apply_preset(ModelConfig(), preset)
    return decoder_shapes(cfg, partition(cfg, n_chunks, Partition.UNIFORM, seq_len)), param_count(cfg)


def traffic(prog: Program, rank: int) -> int:
    """Bytes the rank sends in its collectives over a ring (ZeroDP.bytes_sent's accounting on NCCL and
    for quantized traffic; gloo's own reduce-scatter sends twice its share)."""
    d = prog.dp
    total = 0.0
    for i in flat(prog.ranks[rank]):
        if isinstance(i, DataParallel) and i.collective not in (Collective.LOCAL, Collective.HOST):
            total += i.nbytes * (2 if i.collective is Collective.ALL_REDUCE else 1) * (d - 1) / d
    return int(total)


@dataclass(frozen=True)
class Lowered:
    """A schedule lowered with ZeRO's collectives, before it is proved and played (the costly part,
    about 10-40 us an instruction: cmd_simulate_zero counts them first)."""

    prog: Program
    buckets: BucketPlan
    stage_bytes: float  # one average stage's parameters on the wire

    @property
    def instructions(self) -> int:
        return sum(len(flat(r)) for r in self.prog.ranks)


def lower_zero(s: Schedule, opt: ZeroOptions, replicas: tuple[int, ...] | None = None) -> Lowered:
    """Schedule `s` compiled with `opt`'s ZeRO over the preset's tensors (schedules/compile.py);
    `replicas`: only these data-parallel ranks' programs."""
    model, params = preset_model(opt.preset, s.n_chunks)
    p = ParallelConfig(pp=s.pp, dp=opt.dp, zero=opt.zero, schedule=ScheduleKind(s.name), microbatches=s.microbatches,
                       virtual_stages=s.virtual, grad_reduce=opt.grad_reduce, bucket_mb=opt.bucket_mb,
                       zero3_keep_gathered=not opt.layerwise, zero3_prefetch=opt.depth, zero3_unit=opt.unit,
                       offload=opt.offload, offload_activations=opt.activations)
    plan = compile_plan(p, model, wires=opt.wires, prefetch=opt.prefetch, replicas=replicas, schedule=s)
    return Lowered(plan.program, plan.buckets, params / s.pp * opt.wire_bytes)


def run_program(low: Lowered, cost: CostModel, opt: ZeroOptions) -> tuple[ProgramResult, dict]:
    """Prove and time a lowered program under `opt`; its play and the JSON-ready figures."""
    prog, buckets = low.prog, low.buckets
    check_program(prog)
    bandwidth = low.stage_bytes / opt.dp_comm if opt.dp_comm > 0 else float("inf")
    res = simulate_program(prog, cost, CommCost(bandwidth=bandwidth, optim=opt.optim))
    free = simulate_program(prog, cost, CommCost(optim=opt.optim))
    counts = {k.value: sum(1 for i in flat(prog.ranks[0]) if i.kind is k)
              for k in (Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD)}
    counts[Kind.OPTIM_STEP.value] = sum(1 for i in prog.ranks[0] if isinstance(i, OptimStep))
    figures = {"zero": opt.zero, "dp": opt.dp, "grad_reduce": opt.grad_reduce.value, "preset": opt.preset,
               "zero3_layerwise": opt.zero3_layerwise, "zero3_prefetch_chunk": opt.sharded_params and opt.prefetch,
               "zero3_prefetch": opt.depth if opt.zero3_layerwise else None,
               "zero3_unit": opt.unit.value if opt.zero3_layerwise else None,
               "buckets_per_chunk":
               [len(b) for b in buckets.numels], "dp_comm": opt.dp_comm,
               "step_time_no_zero_traffic": free.step_time, "bubble_no_zero_traffic": free.bubble,
               "step_time": res.step_time, "bubble": res.bubble, "comm_busy": res.comm_busy,
               "bytes_sent": [traffic(prog, r) for r in range(len(prog.ranks))], "rank0_instructions": counts}
    return res, figures


def draw(prog: Program, res: ProgramResult, title: str, path: str) -> None:
    """Replica 0's ranks, compute above and collectives below each (the other replicas play alike)."""
    from pipezero.telemetry.plot import draw_program_timeline

    mine = {prog.global_rank(p, 0): p for p in range(prog.schedule.pp)}
    compute = [(mine[sp.rank], sp.kind.value, sp.mb, sp.start, sp.end) for sp in res.timeline
               if sp.rank in mine and sp.lane == "compute"]
    comm = [(mine[sp.rank], sp.kind.value, sp.start, sp.end) for sp in res.timeline
            if sp.rank in mine and sp.lane == "comm" and sp.end > sp.start]
    draw_program_timeline(compute, comm, prog.schedule.pp, title, path)
