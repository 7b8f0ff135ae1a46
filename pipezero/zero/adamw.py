"""AdamW on flat fp32 shards, in the operation order of torch's single-tensor AdamW.

Keeping torch's order (decay, lerp of m, v update, bias corrections, addcdiv) makes every ZeRO stage
and every layout take the same step as `torch.optim.AdamW(foreach=False)` on the unsharded model, up
to the rounding of the gradient reduction itself.
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


@dataclass
class ShardedAdamW:
    cfg: OptimConfig
    states: list[ShardState] = field(default_factory=list)
    step_count: int = 0

    def add_shard(self, size: int, decay: list[tuple[int, int]], device: torch.device = torch.device("cpu")) -> None:
        self.states.append(ShardState(torch.zeros(size, device=device), torch.zeros(size, device=device), decay))

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor], lr: float) -> None:
        """Update each fp32 shard in place from its gradient shard (same order as add_shard)."""
        c = self.cfg
        self.step_count += 1
        bc1 = 1 - c.beta1 ** self.step_count
        bc2_sqrt = (1 - c.beta2 ** self.step_count) ** 0.5  # as torch computes it
        for p, g, st in zip(params, grads, self.states):
            if c.weight_decay:
                for a, b in st.decay:  # per-parameter ranges: no shard-sized mask or temporary
                    p[a:b].mul_(1 - lr * c.weight_decay)
            st.exp_avg.lerp_(g, 1 - c.beta1)
            st.exp_avg_sq.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
            denom = (st.exp_avg_sq.sqrt() / bc2_sqrt).add_(c.eps)
            p.addcdiv_(st.exp_avg, denom, value=-lr / bc1)

    def state_bytes(self) -> int:
        return sum(s.exp_avg.numel() * 4 + s.exp_avg_sq.numel() * 4 for s in self.states)
