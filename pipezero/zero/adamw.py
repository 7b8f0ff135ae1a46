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
        """Update each fp32 shard in place from its gradient shard (same order as add_shard).

        Each line is one multi-tensor kernel over a group of shards (a few launches a group, not a
        few a bucket, and weight decay not one a parameter); the arithmetic is element for element
        the single-tensor order. Groups cap the square-root temporary at `GROUP_ELEMENTS`."""
        c = self.cfg
        self.step_count += 1
        bc1 = 1 - c.beta1 ** self.step_count
        bc2_sqrt = (1 - c.beta2 ** self.step_count) ** 0.5  # as torch computes it
        for idx in _groups([p.numel() for p in params]):
            ps, gs, sts = [params[i] for i in idx], [grads[i] for i in idx], [self.states[i] for i in idx]
            if c.weight_decay:  # per-parameter ranges: no shard-sized mask or temporary
                decayed = [p[a:b] for p, st in zip(ps, sts) for a, b in st.decay]
                if decayed:
                    torch._foreach_mul_(decayed, 1 - lr * c.weight_decay)
            m, v = [st.exp_avg for st in sts], [st.exp_avg_sq for st in sts]
            torch._foreach_lerp_(m, gs, 1 - c.beta1)
            torch._foreach_mul_(v, c.beta2)
            torch._foreach_addcmul_(v, gs, gs, value=1 - c.beta2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, c.eps)
            torch._foreach_addcdiv_(ps, m, denom, value=-lr / bc1)

    def state_bytes(self) -> int:
        return sum(s.exp_avg.numel() * 4 + s.exp_avg_sq.numel() * 4 for s in self.states)


GROUP_ELEMENTS = 1 << 25  # 128 MiB of fp32 temporaries at most while a group updates


def _groups(sizes: list[int]) -> list[list[int]]:
    """Consecutive indices, each group as many shards as fit in GROUP_ELEMENTS (at least one)."""
    out: list[list[int]] = []
    total = GROUP_ELEMENTS
    for i, n in enumerate(sizes):
        if total + n > GROUP_ELEMENTS:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out
