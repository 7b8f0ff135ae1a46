"""Split backward without doing the work twice: B computes input gradients and stashes what W needs.

W knows the weight gradient of torch's `Linear` (y = x Wᵀ + b), `Embedding` (rows scatter-added),
`LayerNorm` and `RMSNorm` (y = n(x) * w + b), and of any module that computes its weight's gradient
itself (`OwnWeightGrad`, for a layer of one's own; the built-in model's RMSNorm is an `nn.RMSNorm`). So any block built of those splits, whatever
the model (models/spec.py). A chunk with any other weighted module keeps autograd for W, and the
executor says so once, naming the module type. Forward hooks record each such module's input x and
output y for the micro-batch. B asks autograd for the gradient of the chunk's input *and* of every
recorded y, without touching weights, so it costs one input-gradient pass. W then needs no graph at
all: dW = dyᵀ x and db = Σ dy for a Linear, the module's own rule otherwise (dw = Σ dy * n(x) for a
norm). (The embedding layer's gradient needs no B: it lives on the first chunk, which has no input
gradient to send, so W there is plain autograd.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn


@runtime_checkable
class OwnWeightGrad(Protocol):
    """A module with one weight whose gradient follows from (x, dy) alone, as a norm's does: the
    model says how, so this module needs to know no model. A `bias`
    beside it, if any, must be added along the output's trailing dimensions (its gradient is then
    dy summed over the leading ones)."""

    weight: nn.Parameter

    def weight_grad(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor: ...


def splittable(module: nn.Module) -> bool:
    if isinstance(module, nn.Embedding):  # these options change the gradient or the weight itself
        return module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
    return isinstance(module, (nn.Linear, nn.LayerNorm, nn.RMSNorm, OwnWeightGrad))


@dataclass
class Record:
    module: nn.Module
    x: torch.Tensor
    y: torch.Tensor


class WeightGradCapture:
    """Hooks on one chunk's splittable modules; records only inside `recording()`."""

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
        if module.weight is not None:
            _accumulate(module.weight, weight_grad(module, x, dy))
        bias = getattr(module, "bias", None)
        if isinstance(bias, nn.Parameter):
            _accumulate(bias, dy.reshape(-1, *bias.shape).float().sum(0))


def weight_grad(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dL/dweight of one splittable module from its input x and output gradient dy."""
    if isinstance(module, nn.Linear):
        # in the dtype the forward ran in, as autograd computes it (bf16 under autocast)
        return (dy.reshape(-1, dy.shape[-1]).t() @ x.to(dy.dtype).reshape(-1, x.shape[-1])).float()
    if isinstance(module, nn.Embedding):  # x: token ids; each row gets the sum of its tokens' dy
        w = module.weight
        g = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        g.index_add_(0, x.reshape(-1), dy.reshape(-1, w.shape[1]).float())
        if module.padding_idx is not None:
            g[module.padding_idx] = 0.0
        return g
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        shape = module.normalized_shape
        if isinstance(module, nn.LayerNorm):
            normed = F.layer_norm(x.float(), shape, eps=module.eps)
        else:
            normed = F.rms_norm(x.float(), shape, eps=module.eps)
        return (dy.float() * normed).reshape(-1, *shape).sum(0)
    return module.weight_grad(x, dy)


def _accumulate(p: nn.Parameter, g: torch.Tensor) -> None:
    if not p.requires_grad:  # frozen, while another tensor of its module trains
        return
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)
