"""ZeRO over the data-parallel ranks of one pipeline stage: the program's collectives, played.

The lowered program (schedules/program.py) says where each collective goes: UNSHARD and RESHARD of
ZeRO-3's parameters, one REDUCE_GRAD a bucket after the backward that completes its gradients, and
which of them the rank waits on. The executor hands each instruction to `play`; around compute it
also says when a backward starts (and whether reductions follow it) and ends. What each stage keeps
and moves is schedules/zero_rules.py, the collectives themselves zero/coordinator.py, ZeRO-3's parameters
zero/gathering.py, the update zero/update.py; the state lives on the buckets (zero/buckets.py).

- Reductions: in a fused backward that reduces (a chunk's last of the step, or every one with
  grad-reduce `microbatch` at stages 2-3) the program places each bucket's REDUCE_GRAD at the
  moment autograd has produced all of its gradients (`grads k`); a post-accumulate hook counts them
  and reports that moment, which plays the instruction, overlapping the rest of that backward.
  Buckets holding a parameter used twice are reduced by the REDUCE_GRADs after the backward; those
  of a tied embedding's copies by the REDUCE_GRADs the program places before the step, after its
  TIED_SUM has summed the copies. At stages 2-3 gradient buckets are
  allocated when their first gradient appears and at most the program's `bound` of full buckets
  (and the one being filled) wait on a reduce-scatter at once, so the full gradient never exists
  all at once.
- --offload optimizer (zero/offload.py): OFFLOAD_GRAD copies a bucket's reduced gradient to the
  host once its reduction has landed (waiting for it where the program left it in flight); OPTIM_STEP
  then only decides and clips, and each HOST_STEP after it steps one bucket's AdamW on the host and
  copies its weights back. The executor's activation copies are noted in the same record (`note_copy`).
- Every collective inside an action is armed by the executor (`begin_compute`) and fired at its
  moment (`moment`); one left over when the action ends is an error, never a collective skipped.
- Waits for gathers are the program's WAIT instructions (`_wait`), at the moments it places them:
  a layer that computes with a bucket whose gather is still in flight, a release of one, or a
  program that ends with one in flight (`end_program`) is an error naming the bucket, the layer
  and the instruction. ZeRO-1/2's gathers of updated weights under --overlap-gather are waited for
  by the next program's WAITs, at the moments zero/weight_waits.py's hooks report; `settle` is left
  only to what reads full weights outside any program.
- Stage 3: parameters are gathered and released by zero/gathering.py, kept for a chunk's whole step
  (`keep_gathered`, default when P > 1) or layer by layer. Layer by layer, the program's gathers
  and releases sit inside each compute instruction with the moment that fires them: the executor
  arms them for the action (`begin_compute`), zero/layerwise.py's hooks report the moments
  (`moment`), and this object plays what the program placed there, in order; an instruction left
  over when the action ends is an error, not a gather skipped.

The buckets themselves are the plan's (schedules/bucket_plan.py via the compiled plan's layouts):
which tensor lies in which bucket at which offset is decided there, once; zero/buckets.py only
builds them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipezero.config import GradReduce, OptimConfig
from pipezero.nonfinite import StepOutcome
from pipezero.parallel.hierarchical import Hierarchy
from pipezero.schedules.bucket_plan import BucketLayout
from pipezero.schedules.layer_plan import END, START, Moment, Trigger
from pipezero.schedules.program import Compute, DataParallel, Group, Kind
from pipezero.schedules.played import OUTSIDE_READERS
from pipezero.schedules.zero_rules import RULES, Rules
from pipezero.telemetry.trace import Tracer
from pipezero.zero.adamw import ShardedAdamW
from pipezero.zero.buckets import Bucket, FlatSource, build_buckets, in_order
from pipezero.zero.compressed import Wire
from pipezero.zero.coordinator import Coordinator
from pipezero.zero.gathering import ShardedParams
from pipezero.zero.tied import TiedCopies
from pipezero.zero.offload import HostOptimizer
from pipezero.zero.update import clip_and_update, global_norm


@dataclass
class ZeroDP:
    chunk_params: dict[int, list[tuple[str, nn.Parameter]]]
    shared: set[nn.Parameter]  # parameters used more than once in a chunk (tied embeddings)
    stage: int
    dp: int
    dp_rank: int
    dp_group: Any  # None when dp == 1
    optim: OptimConfig
    layouts: dict[int, tuple[BucketLayout, ...]]  # the plan's buckets of each chunk (compiled plan `layouts`)
    grad_reduce: GradReduce = GradReduce.STEP
    timeout_s: float = 300.0
    rank: int = 0
    keep_gathered: bool = True  # stage 3: a chunk stays gathered for its step (else layer by layer)
    tied: TiedCopies | None = None  # embedding/head copies in different chunks, summed before reducing
    tracer: Tracer = field(default_factory=Tracer)
    comm_dtype: torch.dtype = torch.float32  # bf16 halves gradient and ZeRO-3 parameter traffic
    device: torch.device = torch.device("cpu")  # where a rank with nothing to train still reduces the norm
    hierarchy: Hierarchy | None = None  # --hierarchical: two-level gradient reductions
    source: FlatSource | None = None  # stage 3 from a pretrained folder: master shards read from here
    weights: Wire | None = None  # --quantize-weights: parameter gathers travel quantized (zero/compressed.py)
    grads: Wire | None = None  # --quantize-grads: gradient reductions travel quantized
    node: Hierarchy | None = None  # --secondary-shard node: ZeRO-3's gathers after a step's first stay in the node
    offload: bool = False  # --offload optimizer: AdamW's state and step on the host (zero/offload.py)
    buckets: dict[int, list[Bucket]] = field(init=False)
    index: dict[Bucket, int] = field(init=False)  # a bucket's place in its chunk (buckets hash by identity)
    rules: Rules = field(init=False)
    comm: Coordinator = field(init=False)
    opt: ShardedAdamW = field(init=False)
    sharded: ShardedParams | None = field(init=False)  # stage 3's parameters
    host: HostOptimizer | None = field(init=False)  # --offload optimizer
    armed: list[DataParallel] | None = field(init=False, default=None)  # layer by layer: the action's, still to fire
    armed_for: str = field(init=False, default="a forward outside any program")  # the action they belong to
    playing: int | None = field(init=False, default=None)  # index of the program's instruction under way

    @property
    def layerwise(self) -> bool:
        return self.rules.sharded_params and not self.keep_gathered


    def __post_init__(self) -> None:
        self.rules = RULES[self.stage]
        if self.source is not None and not self.rules.sharded_params:
            raise ValueError(f"ZeRO-{self.stage} keeps full parameters: only ZeRO-3 reads its shards from a source")
        self.buckets = {c: build_buckets(self.layouts[c], named, self.dp, self.dp_rank, self.source)
                        for c, named in self.chunk_params.items()}
        on_gpu = self.device.type == "cuda" or any(b.device.type == "cuda" for b in self.all_buckets())
        self.index = {b: k for bs in self.buckets.values() for k, b in enumerate(bs)}
        self.comm = Coordinator(self.rules, self.dp, self.dp_group, self.timeout_s, self.rank, self.tracer,
                                self.comm_dtype, on_gpu, self.hierarchy, self.weights, self.grads,
                                self.node)
        me = weakref.ref(self)
        tied = self.tied.local if self.tied else []
        for c, bs in self.buckets.items():
            for k, b in enumerate(bs):
                b.label, b.tied = f"{c}.{k}", any(b.holds(q) for q in tied)
                if b.tied or any(q in self.shared for q in b.params):
                    continue  # a parameter used twice accumulates twice: reduce after the backward
                for q in b.params:
                    # A weak reference: a hook stored on a tensor is invisible to the garbage
                    # collector, so a strong one would keep this object and every buffer alive
                    # after the stage is dropped (seen: +1.5 GB per rebuilt `base` stage).
                    q.register_post_accumulate_grad_hook(lambda q, b=b: me()._grad_ready(b, q))
        self.opt = ShardedAdamW(self.optim)
        sizes = [b.padded if self.rules.updates_whole else b.shard_size for b in self.all_buckets()]
        decay = [b.decay_ranges(whole=self.rules.updates_whole) for b in self.all_buckets()]
        self.sharded = ShardedParams(self.buckets, self.comm, self.layerwise) if self.rules.sharded_params else None
        # after the masters exist (ZeRO-3 cuts them from the full weights in ShardedParams)
        self.host = HostOptimizer(self.all_buckets(), self.rules, self.opt, self.device) if self.offload else None
        if self.host is not None:
            self.host.states_on_host(sizes, decay)
        else:
            for b, size, ranges in zip(self.all_buckets(), sizes, decay):
                self.opt.add_shard(size, ranges, b.device)

    def all_buckets(self) -> list[Bucket]:
        return in_order(self.buckets)

    @property
    def bytes_sent(self) -> int:
        return self.comm.bytes_sent

    @property
    def step_no(self) -> int:
        return self.tracer.step

    # --- executor hooks ----------------------------------------------------------------------
    def begin_step(self) -> None:
        self.comm.new_step()
        for b in self.all_buckets():
            if b.grad is not None:
                b.grad.zero_()
            b.shard_grad = None  # allocated at the first reduction: not held through the step

    def before_backward(self, chunk: int) -> None:
        """A W or BW of `chunk` starts. Kept gathered at stage 3, the program's UNSHARD before the
        chunk's first forward gathered it for the step: a chunk not gathered here is an error, never
        a gather the program does not list."""
        if self.sharded is not None and not self.layerwise and chunk not in self.sharded.gathered:
            raise RuntimeError(f"rank {self.rank}, step {self.step_no}: a backward of chunk {chunk} computes with "
                               f"parameters its program never gathered (no UNSHARD({chunk}) before it)")
        for b in self.buckets.get(chunk, []):
            if not self.rules.sharded_grads:
                b.attach_grads()  # stages 0-1 keep full gradients: one buffer for the whole step
            b.arrived = set()

    def _grad_ready(self, b: Bucket, q: nn.Parameter) -> None:
        """Autograd finished accumulating `q`'s gradient; once all of its bucket's have arrived,
        that is the moment `grads k`: play what the program placed there (the bucket's reduction in
        a reducing backward)."""
        if self.rules.sharded_grads:
            b.adopt(q)
        if b.arrived is None:
            return
        b.arrived.add(b.position[q])
        if len(b.arrived) == len(b.params):
            b.arrived = None
            self.moment(Trigger(Moment.GRADS, self.index[b]), [], f"bucket {b.label}'s gradients")

    def after_input_grad(self, chunk: int) -> None:
        """A B ran, its weight gradients deferred to W (what it gathered, layer by layer, the program
        released at the moments it placed)."""

    def note_copy(self, name: str, nbytes: int) -> None:
        """The executor moved a micro-batch's activations (OFFLOAD_ACT, RELOAD_ACT): in the step's record."""
        self.comm.note_start(name, nbytes, "act", Group.HOST.value)

    def note_world(self, name: str, nbytes: int) -> None:
        """The executor all-reduces over the world (a forward-only program's LOSS_SUM, one fp64
        number): in the record."""
        self.comm.note_start(name, nbytes, "fp64", Group.WORLD.value)

    def after_backward(self, chunk: int) -> None:
        if self.rules.sharded_grads:
            for b in self.buckets.get(chunk, []):
                for q in b.params:  # gradients written by W, outside autograd's accumulation
                    b.adopt(q)

    # --- the program's collectives -----------------------------------------------------------
    def play(self, instr: DataParallel) -> None:
        """One UNSHARD, RESHARD, TIED_SUM or REDUCE_GRAD of the program (OPTIM_STEP is `step`)."""
        if instr.kind is Kind.TIED_SUM:
            self._sum_tied(instr.chunk)
        elif instr.kind is Kind.REDUCE_GRAD:
            self.comm.reduce(self.buckets[instr.chunk][instr.bucket])  # type: ignore[index]
            if instr.bound is not None:
                # the program's bound on reductions in flight: without one every bucket a split W or
                # a shared parameter reduces stayed full, with its reduction's buffers, until the
                # step drained them all (ZeRO-1 keeps its full buckets for the step anyway: there
                # the bound holds its reductions' output shards)
                self.comm.drain(keep_last=instr.bound)
            if instr.blocking:
                self.comm.drain()
        elif instr.kind in (Kind.OFFLOAD_GRAD, Kind.HOST_STEP):
            self._host(instr)
        elif instr.kind is Kind.WAIT:
            self._wait(instr)
        elif self.rules.gathers_updates and instr.kind is Kind.UNSHARD and instr.bucket is not None:
            self._gather_update(instr)
        elif self.sharded is None:
            raise ValueError(f"rank {self.rank}: {instr} in a ZeRO-{self.stage} program")
        elif instr.bucket is not None:  # layer by layer: one layer's bucket, at its moment
            b = self.buckets[instr.chunk][instr.bucket]
            if instr.kind is Kind.RESHARD:
                self.sharded.release(b, f"{instr} in {self.armed_for}")
            elif instr.blocking:
                self.sharded.gather(b, instr.group is Group.NODE)
            else:
                self.sharded.start(b, instr.group is Group.NODE)
        elif instr.kind is Kind.UNSHARD:
            self.sharded.before_use(instr.chunk)
        else:
            self.sharded.after_final_backward(instr.chunk)

    def _wait(self, instr: DataParallel) -> None:
        """WAIT: the gather of a bucket (or of each of a chunk's) that an UNSHARD started without
        waiting. ZeRO-1/2's updated weights may have nothing in flight (the first step, a skipped
        one, a checkpoint settled them); ZeRO-3's must: a WAIT for a gather never started is an error."""
        ks = range(len(self.buckets[instr.chunk])) if instr.bucket is None else [instr.bucket]
        for k in ks:
            b = self.buckets[instr.chunk][k]
            if self.rules.gathers_updates:
                self.comm.wait_update(b)
            elif b.gathering is None:
                raise RuntimeError(f"rank {self.rank}, step {self.step_no}: {instr} in {self.armed_for}: no gather of "
                                   f"bucket {b.label} ({b.names[0]}, ...) is in flight to wait for")
            else:
                self.comm.finish_gather(b)

    def enter(self, index: int | None) -> None:
        """The executor plays instruction `index` of its program (None: it left the program): the
        place the record gives a wait (zero/coordinator.py `place`)."""
        self.playing = index
        self.comm.place = "" if index is None else f"#{index}"

    def end_program(self, what: str) -> None:
        """The program ended (its OPTIM_STEP, LOSS_SUM or last instruction): a gather it had to wait
        for and did not is an error, named by bucket and layer, not a wait the runtime adds."""
        left = self.comm.updating[:1] or [b for b in self.all_buckets() if b.gathering is not None][:1]
        if left:
            b = left[0]
            raise RuntimeError(f"rank {self.rank}, step {self.step_no}: {what}: the gather of bucket {b.label} "
                               f"({b.names[0]}, ...) is still in flight: its program never waits for it (no "
                               f"WAIT({b.label}))")

    # --- layer by layer: the collectives inside an action, fired at its moments ----------------
    def begin_compute(self, ins: Compute) -> None:
        """The executor starts compute instruction `ins`: arm the collectives it lists."""
        self._arm(list(ins.during), str(ins))

    def end_compute(self, ins: Compute) -> None:
        self._disarm()

    def moment(self, at: Trigger, uses: list[Bucket], what: str) -> None:
        """Moment `at` of the action under way: play what the program placed here (its waits
        among them), then check that the buckets the layer computes with (`uses`) are gathered and
        waited for: one the program has not waited for by now is an error naming the bucket, the
        layer and the instruction."""
        todo = self.armed
        if todo and todo[0].at == at:
            self.comm.place = f"#{self.playing}@{at}"
            while todo and todo[0].at == at:
                self.play(todo.pop(0))
            self.comm.place = f"#{self.playing}"
        where = f"{self.armed_for}, {what}"
        if self.sharded is not None:
            for b in uses:
                self.sharded.need(b, where)
        else:
            for b in uses:
                if b in self.comm.updating:
                    raise RuntimeError(f"rank {self.rank}, step {self.step_no}: {where} computes with bucket {b.label} "
                                       f"({b.names[0]}, ...) before its program waits for its updated weights (no "
                                       f"WAIT({b.label}) at or before {at})")

    def _arm(self, todo: list[DataParallel], what: str) -> None:
        self.armed, self.armed_for = todo, what if self.playing is None else f"{what} (#{self.playing})"
        self.moment(START, [], "")

    def _disarm(self) -> None:
        self.moment(END, [], "")
        left, self.armed = self.armed, None
        what, self.armed_for = self.armed_for, "a forward outside any program"
        if left:
            raise RuntimeError(f"rank {self.rank}: {what}: the program placed {left[0]} at {left[0].at}, "
                               f"a moment this action never reached in that order")

    def _sum_tied(self, chunk: int) -> None:
        """TIED_SUM: add the tied embedding's copies' gradients (the program reduces their buckets,
        held back from the backward, right after)."""
        if self.tied is None:
            raise ValueError(f"rank {self.rank}: TIED_SUM({chunk}) on a rank holding no tied copy")
        self.comm.note_start(f"TIED_SUM({chunk})", self.tied.nbytes, "fp32", "tie")
        self.tied.sum_grads(self.timeout_s, f"rank {self.rank}, step {self.tracer.step}: TIED_SUM({chunk}): sum of "
                                            f"tied embedding gradients between the first and last pipeline rank")
        if self.rules.sharded_grads:  # the sum is the copies' gradient: into the flat buckets
            for b in self.all_buckets():
                if b.tied:
                    for q in b.params:
                        b.adopt(q)

    # --- whole model ------------------------------------------------------------------------
    def gather_all(self) -> None:
        """Full weights of every chunk, for a snapshot outside any program; undo with release_all."""
        self.settle("snapshot")
        if self.sharded is not None:
            self.sharded.gather_all()

    def release_all(self) -> None:
        if self.sharded is not None:
            self.sharded.release_all()

    @property
    def peak_gathered(self) -> int:
        """Stage 3: most parameter bytes gathered at once since `reset_peak`."""
        return self.sharded.peak if self.sharded is not None else 0

    def reset_peak(self) -> None:
        if self.sharded is not None:
            self.sharded.peak = 0

    # --- the optimizer step ------------------------------------------------------------------
    def step(self, lr: float, max_norm: float, norm_group: Any, loss: torch.Tensor | float = 0.0) -> StepOutcome:
        """OPTIM_STEP: finish the reductions, clip and update this rank's shards (zero/update.py).
        At stages 1-2 the program's UNSHARDs after it gather the updated weights (`_gather_update`);
        those the previous step started were waited for by this program's WAITs, or it is an error."""
        self.end_program("OPTIM_STEP")
        self.comm.drain()
        self.comm.generation += 1  # the masters change here: secondary shares cut before are stale
        if self.host is not None:  # the update itself is the program's HOST_STEPs after this
            outcome, coef = global_norm(self.all_buckets(), self.rules, self.comm, max_norm, norm_group, loss,
                                        self.tied.head if self.tied else None, self.device)
            if outcome.applied:
                self.host.begin(coef, lr)
            return outcome
        return clip_and_update(self.all_buckets(), self.rules, self.opt, self.comm, lr, max_norm, norm_group, loss,
                               self.tied.head if self.tied else None, self.device)

    def _host(self, instr: DataParallel) -> None:
        """OFFLOAD_GRAD: once the bucket's reduction has landed (waited for here if the program left it in
        flight), its gradient to the host; HOST_STEP: its AdamW there and its weights back."""
        if self.host is None:
            raise ValueError(f"rank {self.rank}: {instr} in a program without --offload optimizer")
        b = self.buckets[instr.chunk][instr.bucket]  # type: ignore[index]
        if instr.kind is Kind.OFFLOAD_GRAD and b in self.comm.reducing:  # its last reduction, and every older one
            self.comm.drain(keep_last=self.comm.reducing[::-1].index(b))
        self.comm.note_start(f"{instr.kind.value}({b.label})", instr.nbytes, "fp32", Group.HOST.value)
        step = instr.kind is Kind.HOST_STEP
        with self.tracer.span(f"{instr.kind.value}({b.label})", "optim" if step else "copy", "host"):
            if step:
                self.host.step(b)
            else:
                self.host.to_host(b)

    def _gather_update(self, instr: DataParallel) -> None:
        """Stages 1-2, after an applied step: start gathering one bucket's updated shards, in place (the
        program lists them in forward order, so the first layers' weights come first). Its wait is
        the program's: a blocking one waits for every gather started so far; with --overlap-gather
        none blocks and the next program's WAITs wait for each (schedules/lowering.py `update_waits`)."""
        self.comm.start_updates([self.buckets[instr.chunk][instr.bucket]])  # type: ignore[index]
        if instr.blocking:
            self.comm.settle()

    def settle(self, reader: str) -> None:
        """Wait for every gather of updated parameters in flight (stages 1-2). Programs wait with
        their WAITs; this is for `reader`, which reads full parameters outside any program, one of
        schedules/played.py OUTSIDE_READERS: a checkpoint's shards (zero/shard_state.py), a snapshot
        (`gather_all`), the memory profile of the first step and the end of the run (engine.py). The
        record names it as the waits' place, and holds it to what the program before left in flight."""
        if reader not in OUTSIDE_READERS:
            raise ValueError(f"rank {self.rank}: a wait for the step's gathers outside every program by {reader!r}: "
                             f"only {', '.join(OUTSIDE_READERS)} read the weights there")
        self.comm.settle(reader)
