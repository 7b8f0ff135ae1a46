"""Split backward without doing the work twice: B computes input gradients and stashes what W needs.

Every weight of the decoder's blocks and head sits in a `Linear` (y = x Wᵀ) or an `RMSNorm`
(y = n(x) * w). Forward hooks record each such module's input x and output y for the micro-batch.
B asks autograd for the gradient of the chunk's input *and* of every recorded y, without touching
weights, so it costs one input-gradient pass. W then needs no graph at all: dW = dyᵀ x and db = Σ dy for a Linear,
dw = Σ dy * n(x) for an RMSNorm. (The embedding's gradient needs no B: it lives on the first chunk,
which has no input gradient to send, so W there is plain autograd.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from pipezero.models.llama import RMSNorm


@dataclass
class Record:
    module: nn.Module
    x: torch.Tensor
    y: torch.Tensor


class WeightGradCapture:
    """Hooks on one chunk's Linear and RMSNorm modules; records only inside `recording()`."""

    def __init__(self, chunk: nn.Module) -> None:
        self._records: list[Record] | None = None
        self.supported = all(isinstance(m, (nn.Linear, RMSNorm)) or not any(m.parameters(recurse=False))
                             for m in chunk.modules())
        for m in chunk.modules():
            if isinstance(m, (nn.Linear, RMSNorm)):
                m.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if self._records is not None and output.requires_grad:
            self._records.append(Record(module, inputs[0], output))

    @contextmanager
    def recording(self) -> Iterator[list[Record]]:
        self._records = records = []
        try:
            yield records
        finally:
            self._records = None


def input_grad_and_stash(out: torch.Tensor, inp: torch.Tensor, grad: torch.Tensor | None,
                         records: list[Record]) -> tuple[torch.Tensor, list[tuple[nn.Module, torch.Tensor, torch.Tensor]]]:
    """B: the gradient of `inp`, and (module, x, dy) for every recorded weight op."""
    grads = torch.autograd.grad(out, [inp] + [r.y for r in records], grad, allow_unused=True)
    stash = [(r.module, r.x.detach(), dy) for r, dy in zip(records, grads[1:]) if dy is not None]
    return grads[0], stash


@torch.no_grad()
def apply_weight_grads(stash: list[tuple[nn.Module, torch.Tensor, torch.Tensor]]) -> None:
    """W: accumulate every weight gradient from the stash into `.grad` (fp32)."""
    for module, x, dy in stash:
        if isinstance(module, nn.Linear):
            # in the dtype the forward ran in, as autograd computes it (bf16 under autocast)
            g = (dy.reshape(-1, dy.shape[-1]).t() @ x.to(dy.dtype).reshape(-1, x.shape[-1])).float()
        else:
            xf, dy2 = x.float(), dy.float().reshape(-1, dy.shape[-1])
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.eps)
            g = (dy2 * normed.reshape(-1, normed.shape[-1])).sum(0)
        _accumulate(module.weight, g)
        if isinstance(module, nn.Linear) and module.bias is not None:
            _accumulate(module.bias, dy.reshape(-1, dy.shape[-1]).float().sum(0))


def _accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)
