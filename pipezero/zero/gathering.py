"""ZeRO-3's parameters: present only around their use, a shard otherwise.

Kept gathered (the default when P > 1): a chunk's buckets are all-gathered before its first forward
of the step and kept for its micro-batches (memory for traffic), then released after its last
backward. Layer by layer: buckets are whole layers, gathered and released around each use with the
next one prefetched (zero/layerwise.py places those calls). A released bucket keeps its tensor
objects at zero bytes, so autograd's saved views are valid again after the next gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from pipezero.zero.buckets import Bucket, in_order
from pipezero.zero.coordinator import Coordinator


@dataclass
class ShardedParams:
    buckets: dict[int, list[Bucket]]
    comm: Coordinator
    layerwise: bool
    peak: int = 0  # most parameter bytes gathered at once (see gathered_bytes)
    gathered: set[int] = field(default_factory=set)  # kept gathered: chunks whose parameters are present
    holding: bool = False  # between gather_all and release_all: layer hooks neither gather nor release

    def __post_init__(self) -> None:
        for bs in self.buckets.values():
            for b in bs:
                if b.master is None:  # else read from a pretrained folder (Bucket's `source`)
                    b.master = b.flat[b.shard].clone()
                b.release()

    def before_use(self, chunk: int) -> None:
        """A chunk is about to compute: kept gathered, its buckets are gathered (once a step)."""
        if not self.layerwise:
            self._gather_chunk(chunk)

    def _gather_chunk(self, chunk: int) -> None:
        if chunk not in self.gathered:
            for b in self.buckets.get(chunk, []):
                self.gather(b)
            self.gathered.add(chunk)

    def after_final_backward(self, chunk: int) -> None:
        """The chunk's last backward of the step is done and its reductions drained."""
        for b in self.buckets.get(chunk, []):
            b.release()
        self.gathered.discard(chunk)

    # --- layer by layer (the Gatherer protocol of zero/layerwise.py) ---------------------------
    def gather(self, b: Bucket) -> None:
        if b.gathering is not None:
            self.comm.finish_gather(b)
        elif not b.present:
            self.comm.gather(b, b.master, low_precision=True)  # type: ignore[arg-type]
        self._note()

    def prefetch(self, b: Bucket) -> None:
        if b.gathering is None and not b.present:
            self.comm.start_gather(b, b.master, low_precision=True)  # type: ignore[arg-type]
        self._note()

    def release(self, b: Bucket) -> None:
        if self.layerwise and not self.holding and b.gathering is None:
            b.release()

    def all_buckets(self) -> list[Bucket]:
        return in_order(self.buckets)

    def expect_grads(self, b: Bucket) -> None:
        b.expect = set(range(len(b.params)))

    def grad_arrived(self, b: Bucket, q: nn.Parameter) -> None:
        """Layer by layer, during a fused backward: once every gradient of the layer has arrived
        the backward is done with its weights."""
        if b.expect is not None:
            b.expect.discard(b.position[q])
            if not b.expect:
                b.expect = None
                b.release()

    def release_layers(self, chunk: int) -> None:
        """Layer by layer: nothing of `chunk` stays gathered after its backward work (B, W or BW);
        autograd.grad (B, W) never fires the post-accumulate hooks that release during a BW."""
        if self.holding:
            return
        for b in self.buckets.get(chunk, []):
            self.comm.finish_gather(b)  # a prefetch still writes into the storage: let it land first
            b.expect = None
            b.release()

    # --- whole model -------------------------------------------------------------------------
    def gather_all(self) -> None:
        """Full weights of every chunk, e.g. for a snapshot; undo with release_all."""
        for c in self.buckets:
            self._gather_chunk(c)
        self.holding = True  # rank 0 may now run forwards alone (the text sample)

    def release_all(self) -> None:
        self.holding = False
        for c in list(self.gathered):
            for b in self.buckets[c]:
                b.release()
        self.gathered.clear()

    def gathered_bytes(self) -> int:
        """Bytes of full parameters present now (buckets whose storage is not released)."""
        return sum(b.flat.untyped_storage().nbytes() for b in self.all_buckets())

    def _note(self) -> None:
        self.peak = max(self.peak, self.gathered_bytes())
