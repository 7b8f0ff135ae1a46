"""A layer's parts, as a model spec names them (models/spec.py `layer_parts`), held to the layer it
builds: ZeRO-3 with `--zero3-unit sublayer` gathers, releases and reduces each part apart, and its
hooks (zero/layerwise.py) report a part's start at its first module's forward and its end at its
last module's output. So each part must name sub-modules the layer has, every trainable tensor must
lie in one, and a forward must run the parts in their order, one after another. Checked while the
settings are validated (a --model-spec, before any rank starts) and where the plan reads them
(stage.py `model_shapes`, a spec handed to `train` in Python)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipezero.errors import ConfigError
from pipezero.models.spec import ModelSpec
from pipezero.schedules.model_shapes import LayerTensors, TensorShape


def checked_parts(spec: ModelSpec, layer: nn.Module, index: int, tensors: tuple[TensorShape, ...],
                  rebuild: Callable[[], nn.Module] | None = None) -> tuple[tuple[str, ...], ...]:
    """The spec's parts of layer `index` (models/spec.py `layer_parts`), held to the layer it built:
    each part names sub-modules the layer has, every trainable tensor lies in one, and a forward
    runs them in order (`forward_order`; `rebuild` makes a CPU copy of the layer where it cannot
    run on meta)."""
    said = spec.layer_parts(index)
    where = f"{type(spec).__name__}.layer_parts({index}) = {said!r}"
    if not isinstance(said, (tuple, list)) or not all(isinstance(g, (tuple, list)) and
                                                      all(isinstance(n, str) for n in g) for g in said):
        raise ConfigError(f"{where}: expected groups of sub-module names, like (('attn_norm', 'attn'), "
                          f"('mlp_norm', 'mlp'))")
    parts = tuple(tuple(g) for g in said)
    for group in parts:
        missing = [n for n in group if not isinstance(getattr(layer, n, None), nn.Module)]
        if not group or missing:
            raise ConfigError(f"{where}: {missing or 'an empty part'} is no sub-module of layer {index} "
                              f"({type(layer).__name__}); name its sub-modules, in forward order")
    shapes = LayerTensors(index, tensors, parts=parts)
    for t in tensors:
        try:
            shapes.part_of(t.name)
        except ValueError:
            raise ConfigError(f"{where}: {t.name} lies in none of them; every trainable tensor of the layer must "
                              f"lie in one part") from None
    ran = forward_order(layer, parts, spec.dim, rebuild)
    if ran is not None and not runs_in_parts(ran, parts):
        entered = [what.split()[0] for _, what in ran if what.endswith("entered")]
        raise ConfigError(f"{where}: a forward of layer {index} enters its modules in the order {entered}; list the "
                          f"parts in the order they run, each part's modules one after another, its first module "
                          f"first and its last last")
    return parts


CPU_TRY_PARAMS = 1 << 24  # a layer that cannot run on meta runs on CPU if it holds at most this many (64 MiB fp32)


def forward_order(layer: nn.Module, parts: tuple[tuple[str, ...], ...], dim: int,
                  rebuild: Callable[[], nn.Module] | None = None) -> list[tuple[int, str]] | None:
    """(part, `name` entered or `name` returned) for each of the parts' modules in the order a forward
    of `layer` runs them: on the meta device, or where the layer cannot run there (its forward reads
    its input's values) on a CPU copy from `rebuild`, if the layer is small enough
    (CPU_TRY_PARAMS). None where neither runs: then the runtime's own check, a unit computing with
    weights its program never gathered, is what stands (said in one line: cli.failure_line)."""
    ran = _run_hooked(layer, parts, torch.empty(1, 8, dim, device="meta"))
    if ran is None and rebuild is not None and sum(q.numel() for q in layer.parameters()) <= CPU_TRY_PARAMS:
        with torch.device("cpu"):
            ran = _run_hooked(rebuild(), parts, torch.zeros(1, 8, dim))
    return ran


def _run_hooked(layer: nn.Module, parts: tuple[tuple[str, ...], ...],
                x: torch.Tensor) -> list[tuple[int, str]] | None:
    """One forward of `layer` on `x`, the parts' modules reporting as they run; None if it raises."""
    ran: list[tuple[int, str]] = []
    handles = []
    for j, group in enumerate(parts):
        for name in group:
            module = layer.get_submodule(name)
            handles.append(module.register_forward_pre_hook(lambda *_, j=j, n=name: ran.append((j, f"{n} entered"))))
            handles.append(module.register_forward_hook(lambda *_, j=j, n=name: ran.append((j, f"{n} returned"))))
    try:
        with torch.no_grad():
            layer(x)
    except Exception:  # noqa: BLE001 - the spec's layer does not run on this device: nothing to say here
        return None
    finally:
        for h in handles:
            h.remove()
    return ran


def runs_in_parts(ran: list[tuple[int, str]], parts: tuple[tuple[str, ...], ...]) -> bool:
    """Whether the parts ran in their order, one after another, each entered by its first module and
    left by its last (what the hooks that report a part's moments assume: zero/layerwise.py)."""
    order = [j for j, _ in ran]
    if order != sorted(order) or set(order) != set(range(len(parts))):
        return False
    for j, group in enumerate(parts):
        mine = [what for k, what in ran if k == j]
        if mine[0] != f"{group[0]} entered" or mine[-1] != f"{group[-1]} returned":
            return False
    return True


def check_spec_parts(spec: ModelSpec) -> None:
    """Every layer of `spec` that names parts, built on the meta device and held to them (`checked_parts`),
    each of its tensors counted as trainable (--freeze is applied later, by the plan)."""
    for i in range(spec.n_layers + 2):
        said = spec.layer_parts(i)
        if isinstance(said, (tuple, list)) and not said:  # a whole layer a unit; anything else is held to the layer
            continue
        with torch.device("meta"):
            layer = spec.build_layer(i)
        tensors = tuple(TensorShape(f"layers.{i}.{n}", tuple(q.shape)) for n, q in layer.named_parameters()
                        if q.requires_grad)
        checked_parts(spec, layer, i, tensors, lambda i=i: spec.build_layer(i))
