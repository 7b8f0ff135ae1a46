"""Reading a checkpoint runs no code from it.

torch.distributed.checkpoint's FileSystemReader unpickles the `.metadata` file, and pickle can
call any importable function, so a crafted checkpoint would run code when loaded. `SafeReader`
reads it with an unpickler that admits only what DCP metadata is made of: the classes of
`torch.distributed.checkpoint.metadata` that describe tensors (no `BytesStorageMetadata`: a bytes
entry is later `torch.load`ed with `weights_only=False`, and pipezero never saves one), the
filesystem reader's `_StorageInfo`, `torch.Size`, dtypes and layouts, paths and builtin
containers. Tensor data itself is read by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_META = "torch.distributed.checkpoint.metadata"
ALLOWED: dict[str, set[str]] = {
    _META: {"Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
            "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # maps a layout's name to the layout object
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "builtins": {"set", "frozenset", "list", "dict", "tuple"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint's metadata names something that is not checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"metadata refers to {module}.{name}, which is not checkpoint metadata; "
                               f"refusing to load it (a checkpoint can carry code)")


class SafeReader(dcp.FileSystemReader):
    """A FileSystemReader whose metadata is unpickled by the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"metadata holds a {type(metadata).__name__}, not a checkpoint's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
