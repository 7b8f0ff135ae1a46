"""Split backward without doing the work twice: B computes input gradients and stashes what W needs.

Every weight of the decoder's blocks and head sits in a `Linear` (y = x Wᵀ + b) or a module that
computes its weight's gradient itself (`OwnWeightGrad`: the model's RMSNorm, y = n(x) * w). A chunk
with any other weighted module keeps autograd for W, and the executor says so once. Forward hooks record each such module's input x and output y for the micro-batch.
B asks autograd for the gradient of the chunk's input *and* of every recorded y, without touching
weights, so it costs one input-gradient pass. W then needs no graph at all: dW = dyᵀ x and db = Σ dy for a Linear,
the module's own rule otherwise (dw = Σ dy * n(x) for an RMSNorm). (The embedding's gradient needs no B: it lives on the first chunk,
which has no input gradient to send, so W there is plain autograd.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class OwnWeightGrad(Protocol):
    """A module with one weight whose gradient follows from (x, dy) alone, as a norm's does: the
    model says how (models/llama.py's RMSNorm), so this module needs to know no model."""

    weight: nn.Parameter

    def weight_grad(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor: ...


def splittable(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, OwnWeightGrad))


@dataclass
class Record:
    module: nn.Module
    x: torch.Tensor
    y: torch.Tensor


class WeightGradCapture:
    """Hooks on one chunk's Linear and RMSNorm modules; records only inside `recording()`."""

    def __init__(self, chunk: nn.Module) -> None:
        self._records: list[Record] | None = None
        # modules holding weights that W could not compute from (x, dy): their chunk keeps autograd
        self.unsupported = sorted({type(m).__name__ for m in chunk.modules()
                                   if next(m.parameters(recurse=False), None) is not None and not splittable(m)})
        self.supported = not self.unsupported
        for m in chunk.modules():
            if splittable(m):
                m.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        # a frozen module (--freeze) gets no gradient: B need not keep its (x, dy), W computes nothing
        if self._records is not None and output.requires_grad and any(q.requires_grad for q in module.parameters()):
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
            g = module.weight_grad(x, dy)
        _accumulate(module.weight, g)
        if isinstance(module, nn.Linear) and module.bias is not None:
            _accumulate(module.bias, dy.reshape(-1, dy.shape[-1]).float().sum(0))


def _accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    if not p.requires_grad:  # frozen, while another tensor of its module trains
        return
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)
