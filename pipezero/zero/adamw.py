"""AdamW on flat fp32 shards, with torch's fused AdamW kernel.

A flat shard holds many parameters, and weight decay applies to the matrices among them, not to norm
gains. So each step makes two lists of views, the decayed ranges and the rest, and runs torch's
fused kernel once on each: one pass over parameters, gradients and both moments, a few launches a
step whatever the bucket count. Element for element this is `torch.optim.AdamW(fused=True)` on the
unsharded model, so every ZeRO stage and every layout take the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipezero.config import OptimConfig


@dataclass
class ShardState:
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: list[tuple[int, int]]  # [start, stop) ranges of the shard where weight decay applies
    plain: list[tuple[int, int]]  # the rest of the shard


@dataclass
class ShardedAdamW:
    cfg: OptimConfig
    states: list[ShardState] = field(default_factory=list)
    step_count: int = 0
    _steps: dict[torch.device, torch.Tensor] = field(default_factory=dict)  # the kernel reads the step here

    def add_shard(self, size: int, decay: list[tuple[int, int]], device: torch.device = torch.device("cpu")) -> None:
        self.states.append(ShardState(torch.zeros(size, device=device), torch.zeros(size, device=device), decay,
                                      _complement(decay, size)))

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor], lr: float) -> None:
        """Update each fp32 shard in place from its gradient shard (same order as add_shard)."""
        self.step_count += 1
        self.apply(self.states, params, grads, lr)

    def apply(self, states: list[ShardState], params: list[torch.Tensor], grads: list[torch.Tensor],
              lr: float) -> None:
        """This step's update (`step_count` already counts it) of the shards of `states`: with
        --offload optimizer each bucket's runs on the host as its own HOST_STEP, the same kernel on
        the same elements as the step that updates every shard at once."""
        c = self.cfg
        for wd, ranges in ((c.weight_decay, "decay"), (0.0, "plain")):
            views: tuple[list[torch.Tensor], ...] = ([], [], [], [])
            for p, g, st in zip(params, grads, states):
                for a, b in getattr(st, ranges):
                    for out, t in zip(views, (p, g, st.exp_avg, st.exp_avg_sq)):
                        out.append(t[a:b])
            if not views[0]:
                continue
            step = self._step_tensor(views[0][0].device)
            torch._fused_adamw_(*views, [], [step] * len(views[0]), lr=lr, beta1=c.beta1, beta2=c.beta2,
                                weight_decay=wd, eps=c.eps, amsgrad=False, maximize=False)

    def _step_tensor(self, device: torch.device) -> torch.Tensor:
        t = self._steps.get(device)
        if t is None:
            t = self._steps[device] = torch.zeros((), device=device)
        return t.fill_(self.step_count)

    def state_bytes(self) -> int:
        return sum(s.exp_avg.numel() * 4 + s.exp_avg_sq.numel() * 4 for s in self.states)


def _complement(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The parts of [0, size) that sorted, disjoint `ranges` leave out."""
    out, at = [], 0
    for a, b in ranges:
        if a > at:
            out.append((at, a))
        at = b
    if at < size:
        out.append((at, size))
    return out
