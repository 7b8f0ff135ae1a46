"""Packed samples of documents and the order they are read in.

A sample is one row of `seq_len` inputs and next-token targets. With `doc-masked` and `concat`
packing, sample i is the window tokens[i*T : i*T + T + 1] of the documents laid back to back (EOS
between them); `doc-masked` also gives every token its document id, from which the model builds
block-diagonal causal attention and restarts rotary positions, and ignores the target of a
document's last token (the next document's first). With `none`, sample i is document i alone, cut
to T tokens, the rest of the row ignored; each micro-batch is then cut to its longest document
(`fit_length`), so micro-batches differ in length and the pipeline carries each one's own shape.

Order: epoch e reads every sample once in a permutation drawn from (seed, e); a step takes the next
G samples of that endless sequence. The batch read at a position is a pure function of (seed,
position), so it is the same on every layout; checkpoints save the position, so a resumed run reads
exactly the batches it would have read, even with another global batch; data-parallel replicas,
taking disjoint rows of a batch, read disjoint samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pipezero.config import Packing
from pipezero.errors import ConfigError
from pipezero.data.cache import DocTokens

IGNORE = -100  # target id that cross-entropy skips (F.cross_entropy's ignore_index)

# (inputs, targets) or (inputs, targets, document ids), each (rows, T) int64
Rows = tuple[torch.Tensor, ...]


@dataclass
class PackedSamples:
    docs: DocTokens
    seq_len: int
    packing: Packing
    pad_id: int = 0
    _perm: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)  # last epoch's order

    def __len__(self) -> int:
        if self.packing is Packing.NONE:
            return self.docs.n_docs
        return max(0, (len(self.docs.tokens) - 1) // self.seq_len)

    def rows(self, index: np.ndarray) -> Rows:
        """Samples `index` as (inputs, targets[, document ids]), each (len(index), T)."""
        t = self.seq_len
        if self.packing is Packing.NONE:
            return self._documents(index)
        pos = index[:, None] * t + np.arange(t + 1)[None, :]  # (N, T+1) token positions
        seqs = torch.from_numpy(np.asarray(self.docs.tokens[pos], dtype=np.int64))
        x, y = seqs[:, :-1].contiguous(), seqs[:, 1:].clone()  # y is changed below: never a view of x
        if self.packing is Packing.CONCAT:
            return x, y
        doc = torch.from_numpy(np.searchsorted(self.docs.offsets, pos, side="right") - 1)
        y[doc[:, 1:] != doc[:, :-1]] = IGNORE  # never predict across a document boundary
        return x, y, (doc[:, :-1] - doc[:, :1]).contiguous()  # ids from 0 in each row

    def _documents(self, index: np.ndarray) -> Rows:
        t = self.seq_len
        x = torch.full((len(index), t + 1), self.pad_id, dtype=torch.int64)
        y = torch.full((len(index), t), IGNORE, dtype=torch.int64)
        for r, d in enumerate(index.tolist()):
            a, b = int(self.docs.offsets[d]), int(self.docs.offsets[d + 1])
            n = min(b - a, t + 1)
            x[r, :n] = torch.from_numpy(np.asarray(self.docs.tokens[a:a + n], dtype=np.int64))
            y[r, : n - 1] = x[r, 1:n]
        return x[:, :-1].contiguous(), y

    def order(self, seed: int, start: int, n: int) -> np.ndarray:
        """Sample indices at positions [start, start + n) of the seed's endless epoch order."""
        size = len(self)
        out = np.empty(n, dtype=np.int64)
        for i, p in enumerate(range(start, start + n)):
            epoch = p // size
            if (seed, epoch) not in self._perm:
                self._perm = {(seed, epoch): np.random.default_rng([seed, epoch]).permutation(size)}
            out[i] = self._perm[(seed, epoch)][p % size]
        return out

    def global_batch(self, position: int, seed: int, n_rows: int) -> Rows:
        """The G samples read from `position` on (the samples all earlier steps read)."""
        return self.rows(self.order(seed, position, n_rows))

    def heldout(self, n_batches: int, batch_size: int) -> list[Rows]:
        """Evenly spaced fixed samples, cut into batches: the same every evaluation and layout."""
        index = np.linspace(0, len(self) - 1, num=n_batches * batch_size).astype(np.int64)
        rows = self.rows(index)
        batches = [tuple(r) for r in zip(*(t.split(batch_size) for t in rows))]
        return [fit_length(b) for b in batches] if self.packing is Packing.NONE else batches


def fit_length(mb: Rows) -> Rows:
    """A micro-batch of whole documents (`none` packing) cut after the last column any row still
    predicts, rounded up to a power of two (at least 8): short documents cost short sequences, not
    --seq-len, and a few bucketed lengths keep the shapes a compiler or allocator sees few. Causal
    attention means no kept position ever saw a dropped one, and every dropped target was ignored,
    so the loss and gradients are those of the padded micro-batch."""
    counted = (mb[1] != IGNORE).any(0)
    last = int(counted.nonzero().max()) + 1 if bool(counted.any()) else 1
    t = min(mb[1].shape[1], max(8, 1 << (last - 1).bit_length()))
    return tuple(x[:, :t].contiguous() for x in mb)


def check_enough(samples: PackedSamples, need: int, what: str) -> None:
    if len(samples) < need:
        raise ConfigError(f"{what} gives {len(samples)} samples of --seq-len {samples.seq_len} "
                          f"({len(samples.docs.tokens):,} tokens, {samples.docs.n_docs} documents) but needs "
                          f"{need}: give more documents, or lower --seq-len or the global batch")
