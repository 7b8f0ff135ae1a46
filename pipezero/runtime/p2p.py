"""Point-to-point transfers between stage chunks: async, pre-posted, and timed out with a message.

Every transfer is named by (kind, consumer chunk, micro-batch), but no tag travels: NCCL ignores p2p
tags, so transfers between a pair of ranks match in posting order on every backend alike, and the
executor posts both ends in one agreed order (schedules/posting.py). Running tag-less on gloo too
means the CPU tests check the order an NCCL run depends on. Shapes are fixed for a run (B, T, dim)
and known to both sides, so nothing but the payload travels. Sends are not waited for until the end
of the step (or of an evaluation's program); receives are posted as early as the plan allows (when,
simulated, the data exists). Neighbouring chunks on the same rank (the V placement's turn) hand
tensors over in memory.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

import torch

from pipezero.parallel.staging import Direct, Transport
from pipezero.parallel.waits import PipelineTimeout, wait_or_raise
from pipezero.runtime.flight import FlightRecord
from pipezero.schedules.played import PlayEvent, Played
from pipezero.telemetry.trace import Tracer

__all__ = ["P2P", "Payload", "PipelineTimeout"]


class Payload(enum.IntEnum):
    """What a point-to-point transfer carries (a tag in its key, beside the chunk and micro-batch)."""

    ACT = 0  # activation into chunk c from chunk c-1
    GRAD = 1  # gradient into chunk c from chunk c+1
    EVAL = 2  # forward-only activation during evaluation


@dataclass
class P2P:
    rank: int  # this process's global rank
    rank_of_chunk: dict[int, int]  # chunk -> global rank holding it (in this pipeline)
    shape: tuple[int, ...]  # (B, T, dim) of one micro-batch's activation; T as `lengths` says
    timeout_s: float
    dtype: torch.dtype = torch.float32  # on the wire; bf16 halves the traffic
    boundary: torch.dtype = torch.float32  # what chunks hand over and take (the residual stream's dtype)
    device: torch.device = torch.device("cpu")  # where buffers live (a GPU: NCCL moves them)
    # Sequence length of each micro-batch of the step (or evaluation) under way: every rank holds
    # the micro-batches, so each receiver knows a transfer's shape without it travelling.
    lengths: Sequence[int] = ()
    bytes_sent: int = 0
    wait_s: float = 0.0  # time spent blocked on peers (the rest of a step is compute)
    tracer: Tracer = field(default_factory=Tracer)
    flight: FlightRecord = field(default_factory=lambda: FlightRecord(-1, -1))  # where the rank is (doctor.py)
    # how payloads travel (parallel/staging.py: through host buffers where ranks share a GPU); None:
    # straight to torch.distributed on `device`
    transport: Transport | None = None
    # The rank's record of what it plays (zero/coordinator.py `played`, the same list): each transfer
    # to or from another rank, posted (start) and waited for (a receive where its consumer needs it,
    # the sends at the step's or a forward-only program's end), named as the program names it
    # (`SEND(act 2:0 to 1)`); None: not recorded
    record: list[Played] | None = None
    # a peer's process rank -> its rank as the program numbers it (`pp_rank * dp + dp_rank`), where the
    # placement numbers processes otherwise (pp-inner); the record names peers as the program does
    program_rank: dict[int, int] = field(default_factory=dict)
    _recvs: dict[tuple[int, int, int], tuple[Any, torch.Tensor]] = field(default_factory=dict)
    _local: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    _sends: list[tuple[Any, str, dict[str, Any]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.transport is None:
            self.transport = Direct(self.device)

    def _source(self, kind: Payload, chunk: int) -> int:
        return self.rank_of_chunk[chunk + 1 if kind is Payload.GRAD else chunk - 1]

    def describe(self, kind: Payload, chunk: int, mb: int) -> str:
        what = "gradient" if kind is Payload.GRAD else "activation"
        return (f"rank {self.rank}, step {self.tracer.step}: chunk {chunk} waiting for {what} of micro-batch {mb} "
                f"from rank {self._source(kind, chunk)}")

    def post_recv(self, kind: Payload, chunk: int, mb: int) -> None:
        key = (int(kind), chunk, mb)
        src = self._source(kind, chunk)
        if key in self._recvs:
            raise RuntimeError(f"rank {self.rank}, step {self.tracer.step}: RECV of {Payload(key[0]).name.lower()} "
                               f"{chunk}:{mb} from rank {src} posted twice: its program posts a receive once")
        if key in self._local or src == self.rank:
            return
        shape = (self.shape[0], self.lengths[mb], *self.shape[2:]) if self.lengths else self.shape
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._recvs[key] = (self.transport.irecv(buf, src), buf)  # type: ignore[union-attr]
        self._note(PlayEvent.START, self._named(False, kind, chunk, mb, src), buf.numel() * buf.element_size())

    def recv(self, kind: Payload, chunk: int, mb: int) -> torch.Tensor:
        key = (int(kind), chunk, mb)
        if key in self._local:
            return self._local.pop(key)
        if key not in self._recvs:  # the program posts every receive before the action reading it
            raise RuntimeError(f"{self.describe(kind, chunk, mb)}: a receive its program never posted (no RECV before "
                               f"the action that reads it)")
        work, buf = self._recvs.pop(key)
        self._wait(work, self.describe(kind, chunk, mb),
                   {"op": "RECV", "peer": self._source(kind, chunk), "transfer": [chunk, kind is Payload.GRAD, mb]})
        self._note(PlayEvent.WAIT, self._named(False, kind, chunk, mb, self._source(kind, chunk)))
        return buf if buf.dtype == self.boundary else buf.to(self.boundary)

    def send(self, kind: Payload, consumer: int, mb: int, tensor: torch.Tensor) -> None:
        """Send to the rank holding `consumer` (the chunk that will receive it)."""
        dst = self.rank_of_chunk[consumer]
        if dst == self.rank:  # handed over in memory: nothing travels, nothing is rounded
            self._local[(int(kind), consumer, mb)] = tensor.detach()
            return
        payload = tensor.detach().to(self.dtype).contiguous()
        work = self.transport.isend(payload, dst)  # type: ignore[union-attr]
        nbytes = payload.numel() * payload.element_size()
        self.bytes_sent += nbytes
        self.flight.posted(dst, nbytes)
        self._note(PlayEvent.START, self._named(True, kind, consumer, mb, dst), nbytes)
        what = "gradient" if kind is Payload.GRAD else "activation"
        self._sends.append((work, f"rank {self.rank}, step {self.tracer.step}: sending {what} of micro-batch {mb} "
                                  f"for chunk {consumer} to rank {dst}",
                            {"op": "SEND", "peer": dst, "transfer": [consumer, kind is Payload.GRAD, mb]}))

    def finish(self) -> None:
        """Wait for every send of the step, so buffers can be reused and a dead peer is noticed."""
        for work, what, awaited in self._sends:
            self._wait(work, what, awaited)
            consumer, grad, mb = awaited["transfer"]
            self._note(PlayEvent.WAIT, self._named(True, Payload.GRAD if grad else Payload.ACT, consumer, mb,
                                                   awaited["peer"]))
        self._sends.clear()
        if self._recvs or self._local:
            left = sorted(self._recvs) + sorted(self._local)
            raise RuntimeError(f"rank {self.rank}, step {self.tracer.step}: transfers never consumed: {left}")

    def _named(self, send: bool, kind: Payload, chunk: int, mb: int, peer: int) -> str:
        """A transfer as the program names it (schedules/program.py `PointToPoint`)."""
        peer = self.program_rank.get(peer, peer)
        return (f"{'SEND' if send else 'RECV'}({'grad' if kind is Payload.GRAD else 'act'} {chunk}:{mb} "
                f"{'to' if send else 'from'} {peer})")

    def _note(self, event: PlayEvent, name: str, nbytes: int = 0) -> None:
        if self.record is not None:
            self.record.append(Played(event, name, nbytes, "pp" if event is PlayEvent.START else "",
                                      "p2p" if event is PlayEvent.START else "", self.tracer.step))

    def _wait(self, work: Any, what: str, awaited: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        with self.tracer.span(what.split(": ", 1)[-1], "wait", "p2p"), self.flight.awaiting(what, **awaited):
            ordered = self.transport.stream_ordered  # type: ignore[union-attr]
            wait_or_raise(work, self.timeout_s, what, stream_ordered=ordered)
        self.wait_s += time.perf_counter() - t0
