"""Play one rank's lowered programs (schedules/program.py, schedules/forward_only.py): within a program
the runtime adds no policy of its own (between programs a run has bookkeeping collectives the record
does not hold: docs/ARCHITECTURE.md lists them).

A step's program lists, in order, the rank's compute (F, B, W, BW), the sends and receives it posts
(in the global posting order) and its ZeRO collectives (UNSHARD, WAIT, RESHARD, REDUCE_GRAD, TIED_SUM,
OFFLOAD_GRAD, HOST_STEP); the executor runs compute itself, posts transfers through runtime/p2p.py
and hands each collective to the data-parallel layer, which starts, waits for or releases exactly
what the instruction names. Layer-by-layer ZeRO-3's collectives sit inside the compute instruction:
the executor arms them before the action and checks after it that every one fired (zero/sharded.py
`begin_compute`). With --offload-activations the program's OFFLOAD_ACT and RELOAD_ACT move a
micro-batch's saved activations to host memory and back (runtime/saved_activations.py); the
executor plays them itself. OPTIM_STEP is played here too, through the optimizer step the caller
binds to the step's learning rate (ZeroDP.step: drain, clip, update), after every send of the step
has been waited for; the UNSHARDs after it (ZeRO-1/2's gathers of the updated weights) are played
like any other, where the step was applied.

The held-out evaluation (`evaluate`) and the end-of-run text sample (`sample`) play forward-only
programs of their own the same way: F with the gathers and releases inside it, SEND and RECV where
listed, kept-gathered ZeRO-3's UNSHARD and RESHARD around the passes, and the evaluation's LOSS_SUM
(every send waited for, then the summed loss all-reduced over the world by the function the caller
binds to the world's group). Every wait for a gather is an instruction too (WAIT: a prefetched
layer's at the moment that layer computes, ZeRO-1/2's updated weights in the next program's first
forward of each chunk); a layer reading a bucket before its WAIT, or a program ending with a gather
in flight, is an error. The executor tells the data-parallel layer which instruction it plays
(`enter`), so what every rank plays, transfers included, is recorded with each wait at its place
(zero/coordinator.py `played`), OPTIM_STEP's all-reduce at its own place, and held against the
programs by the tests (schedules/played.py, tests/test_program_played.py), wait by wait and place by
place; gathers the program left in flight may be waited for between programs only by the readers
schedules/played.py `OUTSIDE_READERS` names, whose waits the next record holds.

F runs a chunk on tokens (first chunk) or a received activation and sends the result on (or, on the
last chunk, turns logits into this micro-batch's share of the global loss). BW back-propagates and
sends the input gradient back. A split backward uses autograd twice: B differentiates the output
with respect to the chunk's input only (keeping the graph), W later with respect to the parameters,
so zero-bubble schedules really defer weight gradients into their bubbles.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from pipezero.config import DType
from pipezero.generate import Sampler
from pipezero.models import StageChunk
from pipezero.nonfinite import StepOutcome
from pipezero.parallel.device import ComputeClock
from pipezero.runtime.autocast import autocast
from pipezero.runtime.flight import FlightRecord
from pipezero.runtime.p2p import P2P, Payload
from pipezero.runtime.recompute import checkpoint_blocks
from pipezero.runtime.weight_grad import Record, WeightGradCapture, apply_weight_grads, input_grad_and_stash
from pipezero.schedules.actions import Action, Op
from pipezero.schedules.forward_only import EvalInstr
from pipezero.schedules.posting import Transfer
from pipezero.runtime.saved_activations import SavedActivations
from pipezero.schedules.program import (ActivationCopy, Compute, DataParallel, Instr, LossSum, OptimStep,
                                       PointToPoint)
from pipezero.telemetry.trace import Tracer


class DataParallelLayer(Protocol):
    """What ZeRO (zero/sharded.py) does for the executor: the program's collectives (those inside a
    compute instruction fired at their moments), and the moments around compute that no instruction
    marks (gradient buffers)."""

    def play(self, instr: DataParallel) -> None: ...

    def begin_compute(self, instr: Compute) -> None: ...  # arms the collectives inside the action

    def end_compute(self, instr: Compute) -> None: ...  # every one of them fired, or an error

    def before_backward(self, chunk: int) -> None: ...

    def after_backward(self, chunk: int) -> None: ...

    def after_input_grad(self, chunk: int) -> None: ...

    def note_copy(self, name: str, nbytes: int) -> None: ...  # a host copy of activations, in the step's record

    def note_world(self, name: str, nbytes: int) -> None: ...  # an all-reduce over the world (LOSS_SUM), in the record

    def enter(self, index: int | None) -> None: ...  # instruction `index` of the program is played (None: none)

    def end_program(self, what: str) -> None: ...  # a gather the program never waited for is an error


MicroBatch = tuple[torch.Tensor, ...]  # (tokens, targets) or (tokens, targets, document ids), each (B, T)


def docs_of(mb: MicroBatch) -> torch.Tensor | None:
    return mb[2] if len(mb) > 2 else None


@dataclass
class StepStats:
    loss: torch.Tensor  # this rank's share of the global mean loss (non-zero only on the last chunk),
    # on the device: read with the gradient norm, in the step's one synchronisation
    peak_live: int  # most chunk activations held at once (F done, B or W not yet)
    elapsed_s: float = 0.0  # wall time of the schedule on this rank (to its OPTIM_STEP)
    wait_s: float = 0.0  # of which blocked on peers: the rank's measured bubble
    outcome: StepOutcome | None = None  # the optimizer step's, where the run played it


# OPTIM_STEP, played: drain, clip and update with the step's learning rate (zero/sharded.py `step`),
# given this rank's share of the loss
OptimizerStep = Callable[[torch.Tensor], StepOutcome]


@dataclass
class _Live:
    inp: torch.Tensor  # tokens, or the received activation (requires grad)
    out: torch.Tensor  # output activation, or the loss on the last chunk
    grad: torch.Tensor | None = None  # gradient of `out`, kept between B and W
    records: list[Record] | None = None  # weight ops seen in forward (split backward)
    stash: list | None = None  # (module, x, dy) left by B for W


class Executor:
    def __init__(self, chunks: dict[int, StageChunk], n_chunks: int, p2p: P2P, dtype: DType,
                 data_parallel: DataParallelLayer, recompute: bool = False, tracer: Tracer | None = None,
                 flight: FlightRecord | None = None) -> None:
        self.chunks = chunks
        # Outputs wait here for the program's SEND (schedules/posting.py orders every rank's posts
        # so that no pair of ranks can deadlock): one boundary's worth at most.
        self._outbox: dict[Transfer, torch.Tensor] = {}
        self.tracer = tracer or Tracer()
        self.flight = flight or FlightRecord(p2p.rank, -1, step_of=self.tracer)  # the hang doctor's view
        self.hooks = data_parallel
        self.last = n_chunks - 1
        self.p2p = p2p
        self.dtype = dtype
        self.device = p2p.device
        self.clock = ComputeClock(self.device)  # GPU: busy time of compute actions, for the bubble
        self.recompute = recompute
        if recompute:  # each block's forward runs again inside its backward (runtime/recompute.py)
            for chunk in chunks.values():
                checkpoint_blocks(chunk)
        # Split backward by stashing weight-op gradients where the chunk allows it (not the
        # embedding's chunk, and not with recomputation, whose forward reruns inside backward).
        captures = {} if recompute else {c: WeightGradCapture(m) for c, m in chunks.items() if c > 0}
        self.capture = {c: cap for c, cap in captures.items() if cap.supported}
        # --offload-activations: micro-batches whose saved tensors the program moves, by (chunk, mb)
        self.saved: dict[tuple[int, int], SavedActivations] = {}
        self.offloading: set[tuple[int, int]] = set()
        self.host_activation_peak = 0  # most activation bytes in host memory at once, over the run
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # chunks whose W falls back to autograd (said once, when a split schedule first meets them)
        self._unsplit = {c: cap.unsupported for c, cap in captures.items() if not cap.supported}

    def _forward(self, chunk: StageChunk, x: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
        with autocast(self.dtype, self.device.type):
            return chunk(x, docs)

    def _post(self, p: PointToPoint, forward_only: Payload | None = None) -> None:
        """Post a SEND or RECV; `forward_only`: an evaluation's (Payload.EVAL)."""
        chunk, grad, mb = p.transfer
        kind = forward_only or (Payload.GRAD if grad else Payload.ACT)
        if p.send:
            self.p2p.send(kind, chunk, mb, self._outbox.pop(p.transfer))
        else:
            self.p2p.post_recv(kind, chunk, mb)

    def _emit(self, kind: Payload, consumer: int, mb: int, tensor: torch.Tensor) -> None:
        """Hand an output over in memory (same rank), or hold it for the plan's send."""
        if self.p2p.rank_of_chunk[consumer] == self.p2p.rank:
            self.p2p.send(kind, consumer, mb, tensor)
        else:
            self._outbox[(consumer, kind is Payload.GRAD, mb)] = tensor

    def run(self, program: Sequence[Instr], microbatches: Sequence[MicroBatch], denom: float,
            optimizer_step: OptimizerStep | None = None) -> StepStats:
        """Play this rank's `program` on `microbatches` (every rank holds them all: the first chunk
        reads the tokens, the last the targets, every chunk the document ids of packed documents).
        OPTIM_STEP is played by `optimizer_step` (None: the run ends there, the schedule alone, as
        the benchmarks time it); what follows it (the gathers of updated weights) only where the
        step was applied: a step skipped for a non-finite gradient changed no weight."""
        live: dict[tuple[int, int], _Live] = {}
        microbatches = [tuple(t.to(self.device, non_blocking=True) for t in mb) for mb in microbatches]
        self.p2p.lengths = [mb[0].shape[1] for mb in microbatches]
        loss = torch.zeros((), device=self.device)
        split = {ins.action.chunk for ins in program if isinstance(ins, Compute) and ins.action.op is Op.B}
        if unsplit := {c: self._unsplit.pop(c) for c in sorted(split & self._unsplit.keys())}:
            warnings.warn(f"rank {self.p2p.rank}: split backward keeps the autograd graph from B to W for chunks "
                          f"{sorted(unsplit)}: their {sorted({n for v in unsplit.values() for n in v})} modules hold "
                          f"weights whose gradient W cannot compute from (input, output gradient); training is "
                          f"unchanged, the activations live longer", stacklevel=2)
        if not any(isinstance(ins, OptimStep) for ins in program):
            raise ValueError(f"rank {self.p2p.rank}: a program without OPTIM_STEP is not one step")
        t0, waited0 = time.perf_counter(), self.p2p.wait_s
        self.offloading = {(i.chunk, i.mb) for i in program if isinstance(i, ActivationCopy) and i.to_host}
        try:
            return self._play_step(program, live, microbatches, split, denom, loss, optimizer_step, t0, waited0)
        finally:
            self.hooks.enter(None)

    def _play_step(self, program: Sequence[Instr], live: dict[tuple[int, int], _Live],
                   microbatches: Sequence[MicroBatch], split: set[int], denom: float, loss: torch.Tensor,
                   optimizer_step: OptimizerStep | None, t0: float, waited0: float) -> StepStats:
        peak = 0
        stats: StepStats | None = None
        for i, ins in enumerate(program):
            self.flight.begin(i, ins)
            self.hooks.enter(i)
            if isinstance(ins, PointToPoint):
                self._post(ins)
            elif isinstance(ins, ActivationCopy):
                self._move_activations(ins)
            elif isinstance(ins, DataParallel):
                self.hooks.play(ins)
            elif isinstance(ins, OptimStep):
                stats = self._finish_step(live, loss, peak, t0, waited0)
                if optimizer_step is None:
                    return stats
                stats.outcome = optimizer_step(loss)
                if not stats.outcome.applied:
                    return stats
            else:
                self._play(ins, live, microbatches, ins.action.chunk in split, denom, loss)
                peak = max(peak, len(live))
        assert stats is not None
        return stats

    def _move_activations(self, ins: ActivationCopy) -> None:
        """OFFLOAD_ACT or RELOAD_ACT: a forward's saved tensors to the host, or back to the device (the
        backward then reads them; the record keeps no more of them)."""
        key = (ins.chunk, ins.mb)
        saved = self.saved.get(key)
        if saved is None:
            raise RuntimeError(f"rank {self.p2p.rank}: {ins} before the forward of chunk {ins.chunk}, micro-batch "
                               f"{ins.mb}")
        with self.tracer.span(str(ins), "copy", "host"):
            if ins.to_host:
                saved.to_host()
                self.host_activation_peak = max(self.host_activation_peak, self.host_activation_bytes)
            else:
                self.saved.pop(key).to_device()
        self.hooks.note_copy(str(ins), saved.nbytes())

    @property
    def host_activation_bytes(self) -> int:
        """Activation bytes this rank holds in host memory now (--offload-activations)."""
        return sum(s.host_bytes() for s in self.saved.values())

    def _finish_step(self, live: dict, loss: torch.Tensor, peak: int, t0: float, waited0: float) -> StepStats:
        """The schedule's end, at OPTIM_STEP: every send waited for, every activation released."""
        self.p2p.finish()
        if live:
            raise RuntimeError(f"rank {self.p2p.rank}: activations never released: {sorted(live)}")
        if self.saved:
            raise RuntimeError(f"rank {self.p2p.rank}: activations offloaded and never reloaded: {sorted(self.saved)}")
        return StepStats(loss, peak, time.perf_counter() - t0, self.p2p.wait_s - waited0)

    def _play(self, ins: Compute, live: dict[tuple[int, int], _Live], microbatches: Sequence[MicroBatch],
              split: bool, denom: float, loss: torch.Tensor) -> None:
        """One compute action (the last chunk's F adds its loss into `loss`), the collectives inside
        it armed for its moments. A method of its own so that nothing it binds outlives it: a local
        of the step's loop held a finished micro-batch (its input, its received gradient, a split
        chunk's recorded weight-op tensors, W's stash) alive until the next action rebound the name,
        up to most of a chunk's activations."""
        a = ins.action
        if a.op is Op.F:
            x = microbatches[a.mb][0] if a.chunk == 0 else \
                self.p2p.recv(Payload.ACT, a.chunk, a.mb).requires_grad_(True)
            with self._timed(a), self._saving(a):
                self.hooks.begin_compute(ins)
                live[(a.chunk, a.mb)] = st = self._run_f(a, x, docs_of(microbatches[a.mb]), split)
                self.hooks.end_compute(ins)
                if a.chunk == self.last:
                    st.out = self.chunks[a.chunk].spec.loss(st.out, microbatches[a.mb][1], denom)
                    loss.add_(st.out.detach())
            return
        if a.op is not Op.B:
            self.hooks.before_backward(a.chunk)
        if a.op is Op.W:
            with self._timed(a):
                self.hooks.begin_compute(ins)
                self._run_w(a, live.pop((a.chunk, a.mb)))
                self.hooks.end_compute(ins)
        else:
            grad = None if a.chunk == self.last else self.p2p.recv(Payload.GRAD, a.chunk, a.mb)
            st = live.pop((a.chunk, a.mb)) if a.op is Op.BW else live[(a.chunk, a.mb)]
            with self._timed(a):
                self.hooks.begin_compute(ins)
                self._run_b(a, st, grad)
                self.hooks.end_compute(ins)
        if a.op is Op.B:
            self.hooks.after_input_grad(a.chunk)
        else:
            self.hooks.after_backward(a.chunk)

    @contextmanager
    def _saving(self, a: Action) -> Iterator[None]:
        """A forward whose micro-batch the program offloads: what autograd saves is kept in a
        SavedActivations the program's OFFLOAD_ACT and RELOAD_ACT move."""
        if (a.chunk, a.mb) not in self.offloading:
            yield
            return
        saved = self.saved[(a.chunk, a.mb)] = SavedActivations(
            self.device, f"rank {self.p2p.rank}: chunk {a.chunk}, micro-batch {a.mb}", self.copy_stream)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            yield

    @contextmanager
    def _timed(self, a: Action) -> Iterator[None]:
        self.clock.start()
        with self.tracer.span(str(a), a.op.value):
            yield
        self.clock.stop()

    def _run_f(self, a: Action, x: torch.Tensor, docs: torch.Tensor | None, split: bool) -> _Live:
        chunk = self.chunks[a.chunk]
        records = None
        if split and a.chunk in self.capture:
            with self.capture[a.chunk].recording() as records:
                y = self._forward(chunk, x, docs)
        else:
            y = self._forward(chunk, x, docs)
        if a.chunk != self.last:
            self._emit(Payload.ACT, a.chunk + 1, a.mb, y)
        return _Live(x, y, records=records)

    def _run_b(self, a: Action, st: _Live, grad: torch.Tensor | None) -> None:
        """BW: full backward. B: input gradient only, keeping what W needs (a stash or the graph)."""
        if not st.out.requires_grad:
            # the first chunk, every parameter frozen (--freeze): nothing upstream, nothing to train
            gx = None
        elif a.op is Op.BW:
            torch.autograd.backward(st.out, grad)
            gx = st.inp.grad if a.chunk > 0 else None
        elif st.records is not None:
            gx, st.stash = input_grad_and_stash(st.out, st.inp, grad, st.records)
            st.out, st.records = None, None  # the graph is freed; W needs only the stash
        else:
            st.grad = grad
            gx = torch.autograd.grad(st.out, [st.inp], grad, retain_graph=True)[0] if a.chunk > 0 else None
        if gx is not None:
            self._emit(Payload.GRAD, a.chunk - 1, a.mb, gx)

    def _run_w(self, a: Action, st: _Live) -> None:
        if st.stash is not None:
            apply_weight_grads(st.stash)
            return
        params = [p for p in self.chunks[a.chunk].parameters() if p.requires_grad]  # frozen ones get no gradient
        if params and st.out.requires_grad:
            grads = torch.autograd.grad(st.out, params, st.grad, allow_unused=True)
            for p, g in zip(params, grads):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)

    @torch.no_grad()
    def evaluate(self, program: Sequence[EvalInstr], batches: Sequence[MicroBatch],
                 sum_loss: Callable[[torch.Tensor], float]) -> float:
        """Play this rank's evaluation program (schedules/forward_only.py) on `batches`: forward only,
        the last chunk summing its token loss; at LOSS_SUM every send is waited for and `sum_loss`
        (bound by the caller to the world's group) all-reduces the sum over the world (zero on ranks
        without the last chunk)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        batches = [tuple(t.to(self.device) for t in batch) for batch in batches]
        self.p2p.lengths = [batch[0].shape[1] for batch in batches]
        try:
            return self._play_evaluation(program, batches, sum_loss, total)
        finally:
            self.hooks.enter(None)

    def _play_evaluation(self, program: Sequence[EvalInstr], batches: Sequence[MicroBatch],
                         sum_loss: Callable[[torch.Tensor], float], total: torch.Tensor) -> float:
        for i, ins in enumerate(program):
            self.hooks.enter(i)
            if isinstance(ins, PointToPoint):
                self._post(ins, Payload.EVAL)
            elif isinstance(ins, DataParallel):
                self.hooks.play(ins)
            elif isinstance(ins, LossSum):
                self.hooks.end_program(f"the evaluation's {ins}")
                self.p2p.finish()
                self.hooks.note_world(str(ins), ins.nbytes)
                return sum_loss(total)
            elif isinstance(ins, Compute) and ins.action.op is Op.F:
                a, batch = ins.action, batches[ins.action.mb]
                x = batch[0] if a.chunk == 0 else self.p2p.recv(Payload.EVAL, a.chunk, a.mb)
                self.hooks.begin_compute(ins)
                y = self._forward(self.chunks[a.chunk], x, docs_of(batch))
                self.hooks.end_compute(ins)
                if a.chunk == self.last:
                    total += self.chunks[a.chunk].spec.loss(y, batch[1], 1.0).double()
                else:
                    self._emit(Payload.EVAL, a.chunk + 1, a.mb, y)
            else:
                raise ValueError(f"rank {self.p2p.rank}: {ins} in an evaluation program")
        raise ValueError(f"rank {self.p2p.rank}: an evaluation program without LOSS_SUM")

    @torch.no_grad()
    def sample(self, program: Sequence[EvalInstr], sampler: Sampler) -> None:
        """Play this rank's text-sample program (schedules/forward_only.py): each F of the first chunk
        reads the window of the tokens so far (`sampler.window`), the chunks hand their outputs over
        in memory (one pipeline rank), and each F of the last chunk draws the next token
        (`sampler.take`). Every instruction is played as written, also once a token's logits were
        not finite (the sampler then draws nothing more: the forwards left compute on the window as it
        stands, and the gathers and releases inside them are the program's). The forward runs without
        autocast, in the weights' own dtype."""
        out: torch.Tensor | None = None
        for chunk in self.chunks.values():
            chunk.eval()
        try:
            for i, ins in enumerate(program):
                self.hooks.enter(i)
                if isinstance(ins, DataParallel):
                    self.hooks.play(ins)
                elif isinstance(ins, Compute) and ins.action.op is Op.F:
                    a = ins.action
                    out = self._forward_only(ins, sampler.window().to(self.device) if a.chunk == 0 else out)
                    if a.chunk == self.last:
                        sampler.take(out[0, -1])
                        out = None  # the window's logits, not held through the next token's forward
                else:
                    raise ValueError(f"rank {self.p2p.rank}: {ins} in a text-sample program (one pipeline rank)")
            self.hooks.end_program("the text sample's end")
        finally:
            self.hooks.enter(None)
            for chunk in self.chunks.values():
                chunk.train()

    def _forward_only(self, ins: Compute, x: torch.Tensor) -> torch.Tensor:
        """A sample's F: the chunk on `x`, the collectives inside it armed (a method of its own so that
        nothing it binds outlives it)."""
        self.hooks.begin_compute(ins)
        y = self.chunks[ins.action.chunk](x)
        self.hooks.end_compute(ins)
        return y
