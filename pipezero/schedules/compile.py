"""The plan, compiled once: from the layout, the model's trainable tensors and the bucket size, every
rank's whole program for one optimizer step. No torch.

`compile_plan` is the only place a program is made. It proves the schedule (schedules/proven.py:
complete, deadlock-free, its posting order free of cycles), groups each chunk's tensors into
buckets (schedules/bucket_plan.py: which tensor in which bucket, at which offset), and lowers the
schedule over them (schedules/lowering.py): compute, every transfer, every ZeRO collective with the
moment that fires it, the tied embedding's sum and the optimizer step. `train` builds its ZeRO
buffers from the plan's bucket layouts and plays its rank's program; `verify`, `simulate`,
`plan`, the memory model, the tracer's labels and the hang doctor read the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import lru_cache

from pipezero.config import GradReduce, Offload, ParallelConfig, ScheduleKind, SecondaryShard, Zero3Unit
from pipezero.schedules.actions import Schedule
from pipezero.schedules.bucket_plan import BucketLayout, BucketPlan, LayerUse, plan_buckets
from pipezero.schedules.check import SimResult
from pipezero.schedules.forward_only import Forward, lower_evaluation, lower_sample
from pipezero.schedules.model_shapes import ModelShapes
from pipezero.schedules.program import Program, defers_update_waits
from pipezero.schedules.lowering import lower
from pipezero.schedules.proven import ProvenSchedule, prove, proven_layout
from pipezero.schedules.wire import Wires
from pipezero.schedules.zero_rules import RULES


@dataclass(frozen=True)
class CompiledPlan:
    proven: ProvenSchedule
    program: Program  # every global rank's instructions (`ranks[pp_rank * dp + dp_rank]`), its buckets
    model: ModelShapes
    recompute: bool
    wires: Wires  # each kind of collective's format on the wire: the program prices it, the runtime sends it
    depth: int = 1  # layer by layer: layers a gather starts ahead of its use (--zero3-prefetch)
    # forward-only programs by (kind, passes), made once a plan as its step's program is
    _forward: dict[tuple[str, int], tuple[Forward, ...]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def schedule(self) -> Schedule:
        return self.proven.schedule

    @property
    def predicted(self) -> SimResult:
        return self.proven.predicted

    @property
    def buckets(self) -> BucketPlan:
        return self.program.buckets

    @property
    def layerwise(self) -> bool:
        return self.program.layerwise

    def layouts(self, chunk: int) -> tuple[BucketLayout, ...]:
        """Chunk `chunk`'s buckets, bucket 0 first: the tensors zero/buckets.py lays out in each."""
        return self.buckets.layouts[chunk]

    def units(self, chunk: int) -> tuple[tuple[LayerUse, tuple[str, ...]], ...]:
        """Layer by layer: the chunk's units in model order (bucket plan `layers`), each with the
        sub-modules of its part, first to last (() : the whole layer), where the runtime's hooks
        report its moments (zero/layerwise.py)."""
        parts = {x.index: x.parts for x in self.model.chunks[chunk].layers}
        return tuple((u, parts[u.index][u.part] if self.buckets.sublayer and parts[u.index] else ())
                     for u in self.buckets.layers(chunk))

    def evaluation(self, microbatches: int) -> tuple[Forward, ...]:
        """Every rank's held-out evaluation program over `microbatches` micro-batches a replica
        (schedules/forward_only.py)."""
        return self._forward_only(lower_evaluation, "evaluation", microbatches)

    def sample(self, tokens: int) -> tuple[Forward, ...]:
        """Every rank's text-sample program of `tokens` tokens (one pipeline rank: schedules/forward_only.py)."""
        return self._forward_only(lower_sample, "sample", tokens)

    def _forward_only(self, lower: Callable[..., tuple[Forward, ...]], what: str, passes: int) -> tuple[Forward, ...]:
        if (what, passes) not in self._forward:
            self._forward[(what, passes)] = lower(
                self.schedule, self.program.dp, self.buckets, passes,
                sharded_params=RULES[self.program.zero].sharded_params, layerwise=self.layerwise,
                gathers=self.wires.gathers, depth=self.depth,
                update_waits=any(defers_update_waits(r) for r in self.program.ranks))
        return self._forward[(what, passes)]


def wires_of(p: ParallelConfig, bf16: bool) -> Wires:
    """A run's formats on the wire: its communication type (`bf16`: the run's dtype), quantized where
    --quantize-grads or --quantize-weights say (zero/compressed.py sends exactly these)."""
    return Wires.of(bf16, p.quantize_grads.value, p.quantize_weights.value, p.quant_block)


def layerwise(p: ParallelConfig) -> bool:
    """ZeRO-3 gathers layer by layer: asked for, or by default with one pipeline rank (a stage then
    runs its micro-batches one after another and nothing hides a whole chunk's gather)."""
    keep = p.zero3_keep_gathered if p.zero3_keep_gathered is not None else p.pp > 1
    return RULES[p.zero].sharded_params and not keep


def compile_plan(p: ParallelConfig, model: ModelShapes, *, wires: Wires = Wires(), prefetch: bool = False,
                 pp_ranks: Collection[int] | None = None, replicas: Collection[int] | None = None,
                 schedule: Schedule | None = None) -> CompiledPlan:
    """Every rank's program for layout `p` over `model`'s tensors (one ChunkShapes a chunk of the
    layout). `wires`: the collectives' formats on the wire (`wires_of` the run's); `prefetch`: ZeRO-3 kept gathered, a what-if one action ahead (layer by
    layer, `p.zero3_prefetch` is the depth, resolved from `auto` before: planner/prefetch.py);
    `pp_ranks`, `replicas`: only these pipeline and data-parallel ranks' programs (the memory
    model walks a few; simulate counts one replica's instructions before it compiles them all);
    `schedule`: a schedule built by the caller (simulate builds each kind it compares), proven
    here; else the layout's, proven once a process. ScheduleError says why a schedule is refused."""
    key = (p.schedule, p.pp, p.microbatches, p.virtual_stages)
    proven = prove(schedule) if schedule is not None else proven_of(*key)
    if len(model.chunks) != proven.schedule.n_chunks:
        raise ValueError(f"the model is cut into {len(model.chunks)} chunks; the layout has {proven.schedule.n_chunks}")
    lw = layerwise(p)
    if not isinstance(p.zero3_prefetch, int):
        raise ValueError(f"zero3_prefetch {p.zero3_prefetch!r}: resolve it to a depth first (planner/prefetch.py "
                         f"prefetch_depth)")
    depth = p.zero3_prefetch if lw else 1
    buckets = plan_buckets(model, p.bucket_mb, p.dp, layerwise=lw, sublayer=p.zero3_unit is Zero3Unit.SUBLAYER)
    # recomputation changes only layer-by-layer programs: the planner's candidates with and without share the rest
    node_shares = p.secondary_shard is SecondaryShard.NODE and p.dp > 1 and RULES[p.zero].sharded_params
    how = (p.dp, p.zero, p.grad_reduce, buckets, not lw, prefetch, p.recompute and lw, depth, p.buckets_in_flight,
           p.overlap_gather, node_shares, p.offload is Offload.OPTIMIZER, p.offload_activations, wires,
           tuple(sorted(pp_ranks)) if pp_ranks is not None else None,
           tuple(sorted(replicas)) if replicas is not None else None)
    program = _lower(proven, *how) if schedule is not None else _lowered(key, *how)
    return CompiledPlan(proven, program, model, p.recompute, wires, depth)


@lru_cache(maxsize=1024)
def proven_of(kind: ScheduleKind, pp: int, m: int, v: int) -> ProvenSchedule:
    """A layout's proven schedule (schedules/proven.py), made once a process: the planner and the
    memory partition compile many candidates sharing one."""
    return proven_layout(kind, pp, m, v)


@lru_cache(maxsize=4096)
def _lowered(key: tuple[ScheduleKind, int, int, int], *how: object) -> Program:
    """The lowering of a layout's proven schedule, cached: the planner's candidates share programs."""
    return _lower(proven_of(*key), *how)  # type: ignore[arg-type]


def _lower(proven: ProvenSchedule, dp: int, zero: int, mode: GradReduce, buckets: BucketPlan, keep: bool,
           prefetch: bool, recompute: bool, depth: int, in_flight: int, overlap_gather: bool, node_shares: bool,
           offload: bool, offload_activations: int, wires: Wires, pp_ranks: tuple[int, ...] | None, replicas: tuple[int, ...] | None) -> Program:
    return lower(proven.schedule, dp, zero, mode, buckets, keep_gathered=keep, prefetch=prefetch, recompute=recompute,
                 depth=depth, in_flight=in_flight, overlap_gather=overlap_gather, node_shares=node_shares,
                 offload=offload, offload_activations=offload_activations, wires=wires, posts=proven.posts, pp_ranks=pp_ranks,
                 replicas=replicas)
