"""Your own decoder through pipezero's model protocol: a small GPT-2-style model (learned absolute
positions, LayerNorm with bias, GELU MLP, multi-head attention from nn.Linear), not the built-in Llama,
trained with a 2-stage pipeline x 2 data-parallel replicas, ZeRO-2 and the zb-h1 schedule.

    python examples/own_model.py [DATA_FOLDER]   # prints both runs' losses, equal to the digits shown

The model is described by a `ModelSpec` (pipezero/models/spec.py): how to build and initialise
layer i of [embedding, block x n_layers, head], per-layer parameter counts for the partitioner,
FLOPs per token, and the loss. `pipezero.engine.train(cfg, spec=...)` takes it; the TrainConfig
still says the layout, optimizer, data and run (its [model] section is not used for the model).
Every weighted module here is nn.Linear, nn.Embedding or nn.LayerNorm, so zero-bubble schedules
split each block's backward into B and W without falling back to autograd.

From the command line, in this folder (or with it on PYTHONPATH):

    pipezero train --model-spec own_model:GPTSpec --tokenizer bytes --packing concat --data DOCS ...
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipezero.models import ModelSpec


@dataclass(frozen=True)
class GPTShape:
    vocab_size: int = 256  # the bytes tokenizer's
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 128  # rows of the learned position table


class Embed(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(s.vocab_size, s.dim)
        self.pos = nn.Embedding(s.max_seq_len, s.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, dim)
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(ln(x)), then x + mlp(ln(x)), with a 4x GELU MLP."""

    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.n_heads = s.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(s.dim), nn.LayerNorm(s.dim)
        self.q = nn.Linear(s.dim, s.dim)
        # No key bias: it adds the same q.b to every score of a query, which softmax ignores, so its
        # true gradient is zero and AdamW would only turn rounding noise into updates.
        self.k = nn.Linear(s.dim, s.dim, bias=False)
        self.v = nn.Linear(s.dim, s.dim)
        self.out = nn.Linear(s.dim, s.dim)
        self.fc = nn.Linear(s.dim, 4 * s.dim)
        self.proj = nn.Linear(4 * s.dim, s.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, dim) -> (B, T, dim)
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (proj(h).view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)  # (B, H, T, hd)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, s: GPTShape) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(s.dim)
        self.lm = nn.Linear(s.dim, s.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, dim) -> (B, T, vocab)
        return self.lm(self.ln(x))


class GPTSpec(ModelSpec):
    """The layer list [Embed, Block x n_layers, Head] of a GPTShape."""

    def __init__(self, shape: GPTShape = GPTShape()) -> None:
        self.shape = shape
        self.n_layers, self.dim, self.vocab_size = shape.n_layers, shape.dim, shape.vocab_size
        self.max_seq_len = shape.max_seq_len  # the end-of-run sample's window

    def build_layer(self, index: int) -> nn.Module:
        if index == 0:
            return Embed(self.shape)
        return Head(self.shape) if index == self.n_layers + 1 else Block(self.shape)

    def init_layer(self, layer: nn.Module, index: int, seed: int) -> None:
        """GPT-2's: N(0, 0.02), projections into the residual stream scaled by 1/sqrt(2L), biases
        zero, LayerNorms one; from a generator of (seed, index), so any rank builds the same layer."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
        with torch.no_grad():
            for name, p in sorted(layer.named_parameters()):
                if name.startswith("ln"):  # ln, ln1, ln2
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    residual = name in ("out.weight", "proj.weight")
                    std = 0.02 / math.sqrt(2 * self.n_layers) if residual else 0.02
                    p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))

    def layer_param_counts(self) -> list[int]:
        with torch.device("meta"):  # counted from the modules themselves, allocating nothing
            return [sum(p.numel() for p in self.build_layer(i).parameters()) for i in range(self.n_layers + 2)]

    def flops_per_token(self, seq_len: int) -> float:
        matmuls = sum(self.layer_param_counts()[1:])  # the embedding is a lookup; biases and norms: noise
        return 6.0 * matmuls + 12.0 * self.n_layers * seq_len * self.dim


def settings(data: str | None, out: str, pp: int, dp: int, microbatches: int, steps: int = 5) -> dict[str, Any]:
    """The run around the model: layout, optimizer, data (bytes tokens, documents concatenated; no
    folder: the first 400 KB of the standard library's source)."""
    # this model has no document masks: documents are concatenated, attention crosses them
    source = {"data.path": data, "data.packing": "concat"} if data else {"data.max_bytes": 400_000}
    return {**source, "data.tokenizer": "bytes", "data.seq_len": 32,
            "parallel.pp": pp, "parallel.dp": dp, "parallel.zero": 2, "parallel.schedule": "zb-h1",
            "parallel.microbatches": microbatches, "parallel.micro_batch_size": 2, "parallel.timeout_s": 60.0,
            "run.max_steps": steps, "run.out": out, "run.progress": False, "run.sample_tokens": 0,
            "run.eval_every": 0, "run.eval_batches": 1, "optim.warmup_steps": 2, "optim.lr": 1e-2}


def train_rank(rank: int, world: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """One rank of the job (or the whole job when world is 1): losses, norms and its parameters."""
    from pipezero.engine import train
    from pipezero.settings import build_config

    res = train(build_config(None, overrides), snapshot=True, spec=GPTSpec())
    return {"losses": res.losses, "grad_norms": res.grad_norms, "params": res.params}


def main(data: str | None) -> None:
    from pipezero.parallel.spawn import run_ranks

    one = train_rank(0, 1, settings(data, "runs/own-1", 1, 1, microbatches=8))
    four = run_ranks(train_rank, 4, settings(data, "runs/own-4", 2, 2, microbatches=4), timeout=300)
    print("one process:    ", " ".join(f"{x:.5f}" for x in one["losses"]))
    print("pp=2 dp=2 zb-h1:", " ".join(f"{x:.5f}" for x in four[0]["losses"]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
