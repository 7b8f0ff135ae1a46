"""--offload-activations: the tensors autograd saves in one micro-batch's forward, held where the
program says (schedules/program.py OFFLOAD_ACT, RELOAD_ACT).

A forward whose micro-batch the program offloads runs under autograd's saved-tensor hooks: every
tensor the graph saves for backward is kept here instead (parameters, views of them and the chunk's
input stay where they are: they are not this micro-batch's to move, and ZeRO-3 releases and
gathers a parameter's storage under the view). Many of them are views of one another
(the heads cut from one projection, a reshape of a block's output), so what moves is each storage
once, as bytes, and each tensor is cut from its storage again when the backward reads it: the host
holds what the device held, not a copy a view. OFFLOAD_ACT copies the storages to host memory and
drops the device's; RELOAD_ACT copies them back one action before the backward. On CUDA both run on
a stream of their own from pinned host memory, and the backward's first read waits for the copy
back by an event; on a CPU rank they are real copies in the one memory (the path the suite
proves). A backward that meets a tensor still on the host is an error naming the micro-batch: a
RELOAD_ACT the program lacks, never a silent copy.
"""

from __future__ import annotations

from typing import Any

import torch


class SavedActivations:
    """One chunk's micro-batch: what its forward saved for backward, on the device or the host."""

    def __init__(self, device: torch.device, what: str, stream: Any = None) -> None:
        self.device, self.what, self.stream = device, what, stream
        # a saved tensor: (its storage's place in `storages`, dtype, shape, stride, storage offset)
        self.views: list[tuple[int, torch.dtype, torch.Size, tuple[int, ...], int]] = []
        self.storages: list[torch.Tensor] = []  # each storage once, as bytes (uint8)
        self.place: dict[int, int] = {}  # the device storage's address -> its place
        self.ids: dict[int, int] = {}  # a saved tensor's id -> its view (one tensor saved twice: one view)
        self.keep: list[torch.Tensor] = []  # the saved tensors, until OFFLOAD_ACT
        self.on_host = False
        self.ready: Any = None  # CUDA: the copy back has ended

    def pack(self, t: torch.Tensor) -> Any:
        if t.requires_grad and (t.is_leaf or (t._base is not None and t._base.is_leaf)):
            return t  # a parameter or a view of one (a linear's transposed weight), or the chunk's input
        if id(t) in self.ids:
            return self.ids[id(t)]
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.place:
            self.place[storage.data_ptr()] = len(self.storages)
            self.storages.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
        self.ids[id(t)] = len(self.views)
        self.views.append((self.place[storage.data_ptr()], t.dtype, t.shape, t.stride(), t.storage_offset()))
        self.keep.append(t)
        return self.ids[id(t)]

    def unpack(self, ref: Any) -> torch.Tensor:
        if not isinstance(ref, int):
            return ref
        if self.on_host:
            raise RuntimeError(f"{self.what}: its backward reads activations still in host memory (no RELOAD_ACT "
                               f"before it in the program)")
        if self.keep:  # never offloaded (the program moved another micro-batch): the tensors themselves
            return self.keep[ref]
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
            self.ready = None
        k, dtype, shape, stride, offset = self.views[ref]
        return torch.empty(0, dtype=dtype, device=self.device).set_(self.storages[k].untyped_storage(), offset, shape,
                                                                     stride)

    def to_host(self) -> None:
        """OFFLOAD_ACT: every saved storage copied to host memory, the device's dropped."""
        self.storages = [self._copy(s, torch.device("cpu")) for s in self.storages]
        self.keep, self.place, self.on_host = [], {}, True

    def to_device(self) -> None:
        """RELOAD_ACT: back to the device, ahead of the backward that reads them."""
        self.storages = [self._copy(s, self.device) for s in self.storages]
        self.on_host = False
        if self.stream is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(self.stream)

    def nbytes(self) -> int:
        return sum(s.numel() for s in self.storages)

    def host_bytes(self) -> int:
        return self.nbytes() if self.on_host else 0

    def _copy(self, t: torch.Tensor, to: torch.device) -> torch.Tensor:
        if self.stream is None:  # CPU: a real copy, so the device's storage is freed as on a GPU
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, device=to, pin_memory=to.type == "cpu")
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward that made `t` is done
        with torch.cuda.stream(self.stream):
            out.copy_(t, non_blocking=True)
        (t if t.device.type == "cuda" else out).record_stream(self.stream)  # freed only after the copy
        return out
