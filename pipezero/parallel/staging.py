"""How a rank's tensors travel: straight to torch.distributed, or staged through host buffers.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected": its topology search allows one rank a
GPU), so ranks that share a GPU (parallel/device.py) join a gloo group, and gloo moves host memory.
Every transfer and collective pipezero makes (pipeline sends and receives, ZeRO's reductions and
gathers, the tied embedding's sum, the step's norm) goes through one `Transport`:

- `Direct`: the torch.distributed call on the tensor itself (NCCL on GPUs, gloo on CPU).
- `Staged`: each input copied into a host buffer of its own first (pinned, on a CUDA stream of its
  own; the CPU waits for that copy's event, because gloo's threads read the buffer), the call made
  on the host buffers, and each output copied back to the device when the work is waited for (on the
  same stream; the compute stream waits for it by event, so nothing reads the output early). On CPU
  ranks the copies are plain host copies into separate buffers: the same path, which the suite forces
  (`--share-device on --device cpu`) and holds to the direct one, bit for bit
  (tests/test_device.py).

Both return works waited for like torch's (`wait(timeout=...)`), so parallel/waits.py bounds every
wait and names the rank and operation. A staged wait always blocks the CPU (`stream_ordered` is
False): the copy back can only be queued once gloo has finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipezero.parallel import collectives


@dataclass(frozen=True)
class Direct:
    """The torch.distributed call on the tensors themselves."""

    device: torch.device = torch.device("cpu")

    @property
    def stream_ordered(self) -> bool:
        """NCCL's waits on GPU tensors order the stream instead of blocking (parallel/waits.py)."""
        return self.device.type == "cuda"

    @property
    def native(self) -> bool:
        """Whether the backend's own flat collectives serve best (NCCL); on gloo pipezero exchanges
        slices itself (parallel/hierarchical.py `start_exchange`)."""
        return self.device.type == "cuda"

    def all_reduce(self, t: torch.Tensor, group: Any) -> Any:
        return dist.all_reduce(t, group=group, async_op=True)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, group: Any) -> Any:
        return collectives.all_gather(out, shard, group)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, group: Any) -> Any:
        return collectives.reduce_scatter(out, full, group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
        return dist.all_to_all_single(out, inp, group=group, async_op=True)

    def isend(self, t: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> Any:
        return dist.isend(t, dst=dst, group=group, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> Any:
        return dist.irecv(t, src=src, group=group, tag=tag)


@dataclass
class Staged:
    """Every call through host buffers of its own; counts what it copied, each way."""

    device: torch.device = torch.device("cpu")
    # staging copies made and their bytes: out (device -> host, before a call), back (host -> device,
    # after the wait): what the suite holds against the bytes the rank sent (tests/test_device.py)
    copies_out: int = 0
    bytes_out: int = 0
    copies_back: int = 0
    bytes_back: int = 0
    stream_ordered: bool = False
    native: bool = False  # the host side is gloo: pipezero's own exchanges serve it best
    _stream: Any = field(default=None, repr=False)  # the copies' own CUDA stream (None on CPU)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)

    # --- the copies --------------------------------------------------------------------------
    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """An empty host buffer shaped as `t` (pinned where a GPU copies into it asynchronously)."""
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=self._stream is not None)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t`, complete when this returns (gloo reads it from its own threads)."""
        buf = self._host(t)
        self.copies_out += 1
        self.bytes_out += t.numel() * t.element_size()
        if self._stream is None:
            buf.copy_(t)
            return buf
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after the kernels that wrote t
        with torch.cuda.stream(self._stream):
            buf.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._stream)
        done.synchronize()
        return buf

    def to_device(self, host: torch.Tensor, t: torch.Tensor) -> None:
        """Copy what arrived in `host` into `t`; on a GPU the compute stream waits for the copy."""
        self.copies_back += 1
        self.bytes_back += t.numel() * t.element_size()
        if self._stream is None:
            t.copy_(host)
            return
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)  # after whatever queued still reads or writes t
        with torch.cuda.stream(self._stream):
            t.copy_(host, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(self._stream)
        current.wait_event(landed)

    def _start(self, work: Any, back: list[tuple[torch.Tensor, torch.Tensor]], *keep: torch.Tensor) -> StagedWork:
        return StagedWork(work, back, self, keep)

    # --- the calls ---------------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group: Any) -> StagedWork:
        h = self.to_host(t)
        return self._start(dist.all_reduce(h, group=group, async_op=True), [(h, t)])

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, group: Any) -> StagedWork:
        h_in, h_out = self.to_host(shard), self._host(out)
        return self._start(collectives.all_gather(h_out, h_in, group), [(h_out, out)], h_in)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, group: Any) -> StagedWork:
        h_in, h_out = self.to_host(full), self._host(out)
        return self._start(collectives.reduce_scatter(h_out, h_in, group), [(h_out, out)], h_in)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group: Any) -> StagedWork:
        h_in, h_out = self.to_host(inp), self._host(out)
        return self._start(dist.all_to_all_single(h_out, h_in, group=group, async_op=True), [(h_out, out)], h_in)

    def isend(self, t: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> StagedWork:
        h = self.to_host(t)
        return self._start(dist.isend(h, dst=dst, group=group, tag=tag), [], h)

    def irecv(self, t: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> StagedWork:
        h = self._host(t)
        return self._start(dist.irecv(h, src=src, group=group, tag=tag), [(h, t)])

    def counts(self) -> dict[str, int]:
        return {"copies_out": self.copies_out, "bytes_out": self.bytes_out, "copies_back": self.copies_back,
                "bytes_back": self.bytes_back}


class StagedWork:
    """A staged call in flight: its host buffers (inputs `keep`, outputs in `back`) stay alive with
    it while gloo's threads use them, and the first wait that succeeds copies the outputs back to the
    device, once."""

    def __init__(self, work: Any, back: list[tuple[torch.Tensor, torch.Tensor]], stage: Staged,
                 keep: tuple[torch.Tensor, ...] = ()) -> None:
        self._work, self._back, self._stage, self._keep = work, back, stage, keep

    def wait(self, timeout: timedelta | None = None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout=timeout)
        if ok is not False and self._back:
            for host, t in self._back:
                self._stage.to_device(host, t)
            self._back = []
        return ok


Transport = Direct | Staged
DIRECT = Direct()  # CPU tensors straight to torch.distributed: the default where a transport is optional


def transport_for(device: torch.device, staged: bool) -> Transport:
    """This rank's transport: staged where its ranks share a GPU (or the test path asks for it)."""
    return Staged(device) if staged else Direct(device)
