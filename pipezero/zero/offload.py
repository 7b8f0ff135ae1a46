"""--offload optimizer: AdamW's state and the fp32 copy it updates in host memory, stepped there.

Device memory goes to what computes: the weights (ZeRO-0..2's full fp32 buckets, ZeRO-3's shard it
gathers from) and the gradients. What only the optimizer reads moves to the host, a bucket at a
time, where the program places it (schedules/lowering.py):
- OFFLOAD_GRAD(c.k): once the bucket's last reduction of the step has landed, the part of its
  gradient this rank updates is copied into a host buffer, beside the rest of the backward;
- OPTIM_STEP: the global norm and loss over the world, as without offload (the norm reads the
  device's gradients), which decides whether the step applies and by how much it clips;
- HOST_STEP(c.k), after it, in forward order: the bucket's AdamW on the host copy (the same fused
  kernel on the same elements as the device's step, so an offloaded run trains the same model),
  then the updated copy back into the device's weights, before the gathers that spread it.

On CUDA the host buffers are pinned: a gradient's copy runs on a stream of its own, which the host
step waits for by an event, and the copy back is queued on the compute stream, so every later
kernel and collective on the weights follows it while the host steps the next bucket. On a CPU
rank "host" and "device" are one memory: the copies are real copies (the path the suite proves),
and where each byte lives is what `host_bytes` reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipezero.schedules.zero_rules import Rules
from pipezero.zero.adamw import ShardedAdamW
from pipezero.zero.buckets import Bucket
from pipezero.zero.update import slices, updated


@dataclass
class HostShard:
    """One bucket's host side: the fp32 copy AdamW updates and the gradient it reads."""

    master: torch.Tensor
    grad: torch.Tensor
    copied: torch.cuda.Event | None = None  # CUDA: the gradient's copy to the host has ended
    returned: torch.cuda.Event | None = None  # CUDA: the copy back has read `master`


class HostOptimizer:
    """Every bucket's HostShard and AdamW state on the host, in the rank's bucket order."""

    def __init__(self, buckets: list[Bucket], rules: Rules, opt: ShardedAdamW, device: torch.device) -> None:
        self.rules, self.opt, self.device = rules, opt, device
        self.cuda = device.type == "cuda"
        self.index = {b: i for i, b in enumerate(buckets)}
        self.shards = [HostShard(self._host_copy(updated(b, rules)), self._host_empty(updated(b, rules).numel()))
                       for b in buckets]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.coef, self.lr = 1.0, 0.0  # the applied step's clipping factor and rate, for its HOST_STEPs

    def _host_empty(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32, pin_memory=self.cuda)

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        out = self._host_empty(t.numel())
        out.copy_(t)
        return out

    def states_on_host(self, sizes: list[int], decay: list[list[tuple[int, int]]]) -> None:
        """AdamW's moments for each bucket, in host memory (pinned on CUDA, as the step reads them there)."""
        for size, ranges in zip(sizes, decay):
            self.opt.add_shard(size, ranges, torch.device("cpu"))
        if self.cuda:
            for st in self.opt.states:
                st.exp_avg, st.exp_avg_sq = st.exp_avg.pin_memory(), st.exp_avg_sq.pin_memory()

    def refresh(self) -> None:
        """The host copies from the device's weights (after a checkpoint loaded into them)."""
        for b, hs in zip(self.index, self.shards):
            hs.master.copy_(updated(b, self.rules))

    def to_host(self, b: Bucket) -> None:
        """OFFLOAD_GRAD: start copying bucket `b`'s reduced gradient (the part this rank updates)."""
        hs = self.shards[self.index[b]]
        grad = slices(b, self.rules)[1]
        if self.stream is None:
            hs.grad.copy_(grad)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the reduction's result is there
        with torch.cuda.stream(self.stream):
            hs.grad.copy_(grad, non_blocking=True)
            hs.copied = torch.cuda.Event()
            hs.copied.record(self.stream)
        grad.record_stream(self.stream)  # not reused by the allocator before the copy has read it

    def begin(self, coef: float, lr: float) -> None:
        """OPTIM_STEP applied: this step's clipping factor and rate; AdamW counts the step."""
        self.coef, self.lr = coef, lr
        self.opt.step_count += 1

    def step(self, b: Bucket) -> None:
        """HOST_STEP: bucket `b`'s AdamW on the host, then its updated weights back to the device."""
        i = self.index[b]
        hs, st = self.shards[i], self.opt.states[i]
        for event in (hs.copied, hs.returned):  # the gradient is in; last step's copy back has read master
            if event is not None:
                event.synchronize()
        if self.coef < 1.0:
            hs.grad.mul_(self.coef)
        self.opt.apply([st], [hs.master], [hs.grad], self.lr)
        param = updated(b, self.rules)
        param.copy_(hs.master, non_blocking=self.cuda)
        if self.cuda:
            hs.returned = torch.cuda.Event()
            hs.returned.record(torch.cuda.current_stream(self.device))

    def host_bytes(self) -> int:
        """Bytes this rank holds in host memory for the optimizer: masters, gradient buffers, moments."""
        return sum(hs.master.numel() * 4 + hs.grad.numel() * 4 for hs in self.shards) + self.opt.state_bytes()
