"""--offload-activations: the tensors autograd saves in one micro-batch's forward, held where the
program says (schedules/program.py OFFLOAD_ACT, RELOAD_ACT).

A forward whose micro-batch the program offloads runs under autograd's saved-tensor hooks: every
tensor the graph saves for backward is kept here instead (parameters and the chunk's input stay
where they are: they are not this micro-batch's to move). OFFLOAD_ACT copies them to host memory and
drops the device copies; RELOAD_ACT copies them back one action before the backward, which then
reads them from here. On CUDA both copies run on a stream of their own from pinned host memory, and
the backward's first use waits for the copy back by an event; on a CPU rank they are real copies in
the one memory (the path the suite proves). A backward that meets a tensor still on the host is an
error naming the micro-batch: a RELOAD_ACT the program lacks, never a silent copy.
"""

from __future__ import annotations

from typing import Any

import torch


class SavedActivations:
    """One chunk's micro-batch: what its forward saved for backward, on the device or the host."""

    def __init__(self, device: torch.device, what: str, stream: Any = None) -> None:
        self.device, self.what, self.stream = device, what, stream
        self.tensors: list[torch.Tensor] = []
        self.index: dict[int, int] = {}  # id of a saved tensor -> its place (one tensor saved twice: one copy)
        self.on_host = False
        self.ready: Any = None  # CUDA: the copy back has ended

    def pack(self, t: torch.Tensor) -> Any:
        if t.is_leaf and t.requires_grad:  # a parameter, or the chunk's input: not this micro-batch's to move
            return t
        if id(t) not in self.index:
            self.index[id(t)] = len(self.tensors)
            self.tensors.append(t)
        return self.index[id(t)]

    def unpack(self, ref: Any) -> torch.Tensor:
        if not isinstance(ref, int):
            return ref
        if self.on_host:
            raise RuntimeError(f"{self.what}: its backward reads activations still in host memory (no RELOAD_ACT "
                               f"before it in the program)")
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.ready = None
        return self.tensors[ref]

    def to_host(self) -> None:
        """OFFLOAD_ACT: every saved tensor copied to host memory, the device's dropped."""
        self.tensors = [self._copy(t, torch.device("cpu")) for t in self.tensors]
        self.on_host = True

    def to_device(self) -> None:
        """RELOAD_ACT: back to the device, ahead of the backward that reads them."""
        self.tensors = [self._copy(t, self.device) for t in self.tensors]
        self.on_host = False
        if self.stream is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def host_bytes(self) -> int:
        return self.nbytes() if self.on_host else 0

    def _copy(self, t: torch.Tensor, to: torch.device) -> torch.Tensor:
        if self.stream is None:  # CPU: a real copy, so the device's tensor is freed as on a GPU
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, device=to, pin_memory=to.type == "cpu")
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward that made `t` is done
        with torch.cuda.stream(self.stream):
            out.copy_(t, non_blocking=True)
        (t if t.device.type == "cuda" else out).record_stream(self.stream)  # freed only after the copy
        return out
