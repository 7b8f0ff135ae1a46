"""Sample text from a model: the end-of-run sample's drawing of tokens.

The forwards that feed it are a program of their own (schedules/forward_only.py `lower_sample`,
played by runtime/executor.py `sample`): a `Sampler` says what each forward reads (the window of
the tokens so far) and takes what the last chunk returns (the next token's logits).
"""

from __future__ import annotations

import torch


class Sampler:
    """Autoregressive top-k sampling, token by token; recomputes the full window each token (no KV
    cache: it is a one-off of a few dozen tokens on a tiny model). `vocab`: only ids below it are
    drawn; the model may have more embedding rows than the tokenizer has ids (tiny: 4096 rows,
    bytes: 256), and an id the tokenizer cannot decode would be a token of the sample that prints
    nothing."""

    def __init__(self, prompt: list[int], max_seq_len: int, seed: int, temperature: float = 0.8, top_k: int = 40,
                 vocab: int | None = None) -> None:
        self.ids = list(prompt) or [0]
        self.max_seq_len, self.temperature, self.top_k, self.vocab = max_seq_len, temperature, top_k, vocab
        self.gen = torch.Generator().manual_seed(seed)
        self.done = False  # logits that were not finite: nothing more to draw

    def window(self) -> torch.Tensor:
        """The next forward's input: the newest `max_seq_len` tokens, batch 1 (on the CPU)."""
        return torch.tensor([self.ids[-self.max_seq_len:]], dtype=torch.long)

    def take(self, logits: torch.Tensor) -> None:
        """Draw the next token from the last position's `logits` (vocabulary,); once logits were not
        finite, draw nothing more (a program of forwards goes on playing them as written)."""
        if self.done:
            return
        logits = logits.float().cpu() / max(self.temperature, 1e-5)
        if self.vocab is not None:
            logits = logits[:self.vocab]
        if not bool(torch.isfinite(logits).all()):  # weights a last update made non-finite (--lr 1e308):
            self.done = True  # nothing to draw from; the held-out loss already says NaN
            return
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
            logits[logits < kth] = -float("inf")
        self.ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=self.gen)))
