"""Checkpoint entries that do not depend on the layout that wrote them.

Every tensor is stored flat, under the model's own parameter name (`model.layers.3.attn.wq.weight`,
`optim.exp_avg.layers.3.attn.wq.weight`, ...), and each rank writes exactly the elements its ZeRO
shard owns. A shard is a range of a flat bucket, so it cuts a parameter at an arbitrary element,
which torch's DTensor placements cannot describe; `Piece` tells torch.distributed.checkpoint (its
`_Checkpointable` protocol) "elements [offset, offset + n) of a 1-D tensor of `numel`". Loading
asks for the pieces the *new* layout owns, and DCP reads whatever stored ranges overlap them: that
is the whole of resharding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclass(frozen=True)
class Owned:
    """The part of one parameter that a shard holds."""

    name: str
    numel: int  # elements of the whole parameter
    lo: int  # [lo, hi) of the flattened parameter
    hi: int
    at: int  # where that range starts inside the shard


def owned_ranges(names: Sequence[str], offsets: Sequence[int], numels: Sequence[int], shard: slice) -> list[Owned]:
    """Which ranges of which parameters fall in `shard` of a bucket whose parameters sit at
    `offsets` (padding belongs to no parameter and is never stored)."""
    out = []
    for name, off, n in zip(names, offsets, numels):
        a, b = max(off, shard.start), min(off + n, shard.stop)
        if a < b:
            out.append(Owned(name, n, a - off, b - off, a - shard.start))
    return out


class Piece(torch.Tensor):
    """Elements [offset, offset + len(local)) of a 1-D tensor of `numel` elements, for DCP only.

    It carries no data of its own: saving reads `local`, loading writes into it (a view into a
    ZeRO shard, so a load lands in place). Any other use is an error.
    """

    _local: torch.Tensor
    _offset: int

    @staticmethod
    def __new__(cls, numel: int, offset: int, local: torch.Tensor) -> "Piece":
        if local.dim() != 1 or not 0 <= offset <= offset + local.numel() <= numel:
            raise ValueError(f"piece [{offset}, {offset + local.numel()}) does not fit a tensor of {numel}")
        r = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=local.dtype, device=local.device)
        r._local, r._offset = local, offset
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"a checkpoint Piece only feeds torch.distributed.checkpoint, not {func}")

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self._offset]), sizes=torch.Size([self._local.numel()]))

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        data = TensorWriteData(chunk=self._chunk(), properties=TensorProperties.create_from_tensor(self._local),
                               size=self.shape)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size([self._offset])), type=WriteItemType.SHARD,
                          tensor_data=data)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._local

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Piece([{self._offset}, {self._offset + self._local.numel()}) of {self.shape[0]})"
