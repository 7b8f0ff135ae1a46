"""Modules built for their shapes only: on the meta device, without torch.nn's initialisers.

A tensor on the meta device has a shape and no values, so the initialisers every nn.Linear and
norm runs as it is built (kaiming_uniform_, ones_, ...) fill nothing there; their Python (fans,
bounds, a decomposed uniform_) is still about half of building a model on meta. The plan's view
of the model (stage.py `model_shapes`, once a run on every rank) and a pretrained model's frame
are built so. Not for checking a user's spec: there its init code is run on meta on purpose, to
find what raises before a run starts (models/user_spec.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class _SkipMetaInit(TorchFunctionMode):
    """A torch.nn.init function called on a meta tensor returns that tensor, untouched (what it
    would have returned); on a tensor with values it runs as usual."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextmanager
def shapes_only() -> Iterator[None]:
    """Build modules on the meta device (as `with torch.device("meta")`), skipping the
    initialisers of their meta tensors."""
    with torch.device("meta"), _SkipMetaInit():
        yield
