"""Sample text from a whole model held in one process (the end-of-run sample)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def sample(model: nn.Module, prompt: list[int], n_tokens: int, max_seq_len: int, seed: int,
           temperature: float = 0.8, top_k: int = 40, vocab: int | None = None) -> list[int]:
    """Autoregressive top-k sampling; recomputes the full window each token (no KV cache: it is a
    one-off of a few dozen tokens on a tiny model). `vocab`: only ids below it are drawn; the
    model may have more embedding rows than the tokenizer has ids (tiny: 4096 rows, bytes: 256),
    and an id the tokenizer cannot decode would be a token of the sample that prints nothing."""
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = list(prompt) or [0]
    model.eval()
    for _ in range(n_tokens):
        window = torch.tensor([ids[-max_seq_len:]], dtype=torch.long, device=device)
        logits = model(window)[0, -1].float().cpu() / max(temperature, 1e-5)
        if vocab is not None:
            logits = logits[:vocab]
        if not bool(torch.isfinite(logits).all()):  # weights a last update made non-finite (--lr 1e308):
            break  # nothing to draw from; the held-out loss already says NaN
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits[logits < kth] = -float("inf")
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
    model.train()
    return ids
