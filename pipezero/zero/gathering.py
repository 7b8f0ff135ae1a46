"""ZeRO-3's parameters: present only around their use, a shard otherwise.

Kept gathered (the default when P > 1): a chunk's buckets are all-gathered before its first forward
of the step and kept for its micro-batches (memory for traffic), then released after its last
backward. Layer by layer: buckets are whole layers, gathered, waited for and released at the
moments of each action the program names (schedules/layer_plan.py; zero/layerwise.py's hooks fire
those instructions). A released bucket keeps its tensor objects at zero bytes, so autograd's saved
views are valid again after the next gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipezero.zero.buckets import Bucket, in_order
from pipezero.zero.coordinator import Coordinator


class UngatheredUse(RuntimeError):
    """A layer computed with a bucket its program never gathered, or gathered and not yet waited
    for: with a spec's own parts (--zero3-unit sublayer), a forward that runs them in another order
    than listed."""


@dataclass
class ShardedParams:
    buckets: dict[int, list[Bucket]]
    comm: Coordinator
    layerwise: bool
    peak: int = 0  # most parameter bytes gathered at once (see gathered_bytes)
    gathered: set[int] = field(default_factory=set)  # kept gathered: chunks whose parameters are present

    def __post_init__(self) -> None:
        for bs in self.buckets.values():
            for b in bs:
                if b.master is None:  # else read from a pretrained folder (Bucket's `source`)
                    b.master = b.flat[b.shard].clone()
                b.release()

    def before_use(self, chunk: int) -> None:
        """UNSHARD of a kept chunk (once a step, before its first forward): its buckets gathered. A
        second one while they are present is a program the lowering did not write: an error, not
        skipped."""
        if chunk in self.gathered:
            raise RuntimeError(f"rank {self.comm.rank}: UNSHARD({chunk}) while chunk {chunk} is gathered: its program "
                               f"gathers a kept chunk once, before its first forward, and releases it after its last "
                               f"backward")
        if not self.layerwise:
            self._gather_chunk(chunk)

    def _gather_chunk(self, chunk: int) -> None:
        if chunk not in self.gathered:
            for b in self.buckets.get(chunk, []):
                self.gather(b)
            self.gathered.add(chunk)

    def after_final_backward(self, chunk: int) -> None:
        """RESHARD of a kept chunk: its last backward of the step (or an evaluation) is done."""
        for b in self.buckets.get(chunk, []):
            self.comm.note_release(b)
            b.release()
        self.gathered.discard(chunk)

    # --- one bucket, as the program's layer-by-layer instructions say ---------------------------
    def gather(self, b: Bucket, from_node: bool = False) -> None:
        """Gather `b` and wait for it; `from_node`: from the fp32 shares this rank's node kept of the
        step's first gather (hpZ, as the program says)."""
        if b.gathering is not None:
            raise RuntimeError(f"rank {self.comm.rank}: UNSHARD({b.label}, wait) while its gather is in flight: "
                               f"the program waits for a started gather with WAIT({b.label})")
        self._check_released(b)
        self.comm.gather(b, b.master, low_precision=True, from_node=from_node)  # type: ignore[arg-type]
        self._note()

    def start(self, b: Bucket, from_node: bool = False) -> None:
        """Start gathering `b`; the program's WAIT for it waits."""
        if b.gathering is not None:
            raise RuntimeError(f"rank {self.comm.rank}: UNSHARD({b.label}) while its gather is in flight: the program "
                               f"starts a bucket's gather once until its RESHARD")
        self._check_released(b)
        self.comm.start_gather(b, b.master, low_precision=True, from_node=from_node)  # type: ignore[arg-type]
        self._note()

    def _check_released(self, b: Bucket) -> None:
        """A gather finds its bucket released: a present one means an UNSHARD the program did not
        pair with a RESHARD, never a gather to skip."""
        if b.present:
            raise RuntimeError(f"rank {self.comm.rank}: UNSHARD({b.label}) of bucket {b.label} ({b.names[0]}, ...), "
                               f"whose full weights are present: its program gathers a bucket again only after its "
                               f"RESHARD")

    def need(self, b: Bucket, what: str) -> None:
        """A layer computes with `b` now: a gather still in flight (the program placed no WAIT before
        this use) or a released bucket (no gather) is an error."""
        if b.gathering is not None:
            raise UngatheredUse(f"rank {self.comm.rank}: {what} computes with bucket {b.label} ({b.names[0]}, ...) "
                                f"before its program waits for its gather (no WAIT({b.label}) at or before this "
                                f"moment)")
        if not b.present:
            raise UngatheredUse(f"rank {self.comm.rank}: {what} computes with bucket {b.label} ({b.names[0]}, ...), "
                               f"which its program never gathered")

    def release(self, b: Bucket, what: str = "") -> None:
        """Drop `b`'s full weights (RESHARD; `what`: the instruction, for an error)."""
        if b.gathering is not None:  # it would still write into the storage
            raise RuntimeError(f"rank {self.comm.rank}: {what or f'RESHARD({b.label})'}: bucket {b.label} "
                               f"({b.names[0]}, ...) released while its gather is in flight: the program never "
                               f"waited for it (no WAIT({b.label}) before)")
        self.comm.note_release(b)
        b.release()

    def all_buckets(self) -> list[Bucket]:
        return in_order(self.buckets)

    # --- whole model -------------------------------------------------------------------------
    def gather_all(self) -> None:
        """Full weights of every chunk, e.g. for a snapshot; undo with release_all."""
        for c in self.buckets:
            self._gather_chunk(c)

    def release_all(self) -> None:
        for c in list(self.gathered):
            for b in self.buckets[c]:
                b.release()
        self.gathered.clear()

    def gathered_bytes(self) -> int:
        """Bytes of full parameters present now (buckets whose storage is not released)."""
        return sum(b.flat.untyped_storage().nbytes() for b in self.all_buckets())

    def _note(self) -> None:
        self.peak = max(self.peak, self.gathered_bytes())
