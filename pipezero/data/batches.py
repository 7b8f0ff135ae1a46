"""Batches as pure functions of (seed, step, global batch size, sequence length).

Step s draws its G window starts from a generator seeded by (seed, s) alone, so the global batch of a
step is the same whatever the pipeline, data-parallel or micro-batch layout, and resuming at step s
needs no saved reader state. Each data-parallel rank then takes its contiguous rows.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def window_starts(n_tokens: int, step: int, seed: int, n_seqs: int, seq_len: int) -> np.ndarray:
    if n_tokens < seq_len + 2:
        raise ValueError(f"need at least {seq_len + 2} tokens for windows of {seq_len}, have {n_tokens}")
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len - 1, size=n_seqs)


def windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, each (len(starts), seq_len) int64."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    seqs = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def global_batch(tokens: np.ndarray, step: int, seed: int, n_seqs: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The G training sequences of optimizer step `step`: (inputs, targets), each (G, T)."""
    return windows(tokens, window_starts(len(tokens), step, seed, n_seqs, seq_len), seq_len)


def microbatches_for_rank(batch: tuple[torch.Tensor, ...], dp_rank: int, dp: int,
                          microbatches: int) -> list[tuple[torch.Tensor, ...]]:
    """Data-parallel rank d takes rows [d*G/D, (d+1)*G/D) and cuts them into M equal micro-batches,
    of every tensor of the batch alike: inputs, targets and, with document packing, document ids."""
    g = batch[0].shape[0]
    if g % (dp * microbatches):
        raise ValueError(f"global batch {g} does not split into {dp} ranks x {microbatches} micro-batches")
    per_rank = g // dp
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return list(zip(*(t[rows].chunk(microbatches) for t in batch)))


def heldout_batches(tokens: np.ndarray, n_batches: int, batch_size: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evenly spaced, fixed held-out windows: the same every evaluation, and for every layout with
    the same micro-batch size (`n_batches` micro-batches of `batch_size` rows: another size spaces
    them differently)."""
    n = n_batches * batch_size
    starts = np.linspace(0, len(tokens) - seq_len - 2, num=n).astype(np.int64)
    inputs, targets = windows(tokens, starts, seq_len)
    return list(zip(inputs.split(batch_size), targets.split(batch_size)))


def unigram_entropy(tokens: np.ndarray) -> float:
    """Cross-entropy (nats/token) of predicting each token by its corpus frequency: the loss a model
    that ignores context would reach, and the bar a trained model must clear."""
    counts = np.zeros(0, dtype=np.int64)
    for i in range(0, len(tokens), 1 << 24):  # in pieces: a memory-mapped corpus may not fit in memory
        part = np.bincount(np.asarray(tokens[i:i + (1 << 24)], dtype=np.int64))
        counts = np.pad(counts, (0, max(0, len(part) - len(counts)))) + np.pad(part, (0, max(0, len(counts) - len(part))))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum()) if len(p) else math.nan
