"""Frozen parameters (`--freeze REGEX`): which tensors train, decided from the configuration alone.

A pattern is matched with `re.search` against the model's own, layout-independent names
(`layers.0.weight`, `layers.3.attn.wq.weight`, `layers.{L+1}.proj.weight`), so the same pattern
freezes the same tensors on every layout, and every rank decides alone (no collective). A frozen
tensor gets `requires_grad=False` before ZeRO builds its buckets; the buckets take trainable
parameters only, so a frozen tensor has no gradient buffer, no AdamW moments and no reduction at
any ZeRO stage, and the global gradient norm and clipping see trainable tensors only.

Two choices, both visible in summary.json and the README:
- ZeRO-3 does not shard frozen tensors: they stay whole on every data-parallel rank, as plain
  module parameters, never gathered or released. That saves their gathers (every step, forward
  and backward) and keeps the ZeRO-3 machinery to trainable buckets, at 4 bytes a frozen parameter
  instead of 4/D; summary.json reports that extra as `zero3_param_bytes_extra` beside the saving.
- Tied embeddings are one tensor with two names (the embedding and the head's projection). It is
  frozen when the pattern matches either name, so both copies of a pipeline stay equal and no
  rank waits on a tied-gradient sum its partner skips.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from pipezero.errors import ConfigError

if TYPE_CHECKING:  # settings.validate imports this module
    from pipezero.config import ModelConfig
    from pipezero.models.spec import ModelSpec

EXAMPLE = r"layers\.0\.|layers\.[1-2]\."  # the embedding and the first two blocks


def shell_quoted(pattern: str) -> str:
    """`pattern` in single quotes as a shell reads it back (a quote inside closed and escaped), for
    a message whose fix is pasted: its Python repr doubles each backslash, and the pattern so
    written (`'layers\\\\.0\\\\.'`) matches nothing."""
    return "'" + pattern.replace("'", "'\\''") + "'"


def param_names(model: ModelConfig | ModelSpec) -> list[str]:
    """Every parameter name of the whole model, in model order, both names of a tied weight
    included, as the model's spec lists them (on the meta device: a 70B shape costs nothing)."""
    from pipezero.models.llama_spec import spec_of

    return spec_of(model).param_names()


def tied_names(model: ModelConfig | ModelSpec) -> tuple[str, str] | None:
    """The two names of the tied embedding weight, or None without tying."""
    from pipezero.models.llama_spec import spec_of

    return spec_of(model).tied_names()


def frozen_names(model: ModelConfig | ModelSpec, pattern: str | None) -> set[str]:
    """Names `pattern` freezes (none without a pattern); a tied weight's two names go together."""
    if pattern is None:
        return set()
    rx = re.compile(pattern)
    out = {n for n in param_names(model) if rx.search(n)}
    tied = tied_names(model)
    if tied and out & set(tied):
        out |= set(tied)
    return out


def check_pattern(model: ModelConfig | ModelSpec, pattern: str | None) -> None:
    """Refuse, before any process group starts, a pattern that is not a regex or would freeze
    nothing or everything (a run that trains nothing is a mistake, not a job)."""
    if pattern is None:
        return
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"--freeze {shell_quoted(pattern)} is not a valid regular expression ({e}); write a Python "
                          f"regex over parameter names, e.g. --freeze '{EXAMPLE}'") from None
    names = param_names(model)
    frozen = frozen_names(model, pattern)
    if not frozen:
        raise ConfigError(f"--freeze {shell_quoted(pattern)} matches no parameter; names look like {names[0]}, "
                          f"{names[1]}, ..., {names[-1]} (re.search), e.g. --freeze '{EXAMPLE}'")
    if frozen >= set(names):
        raise ConfigError(f"--freeze {shell_quoted(pattern)} matches every parameter, so nothing would train; narrow "
                          f"it, e.g. --freeze '{EXAMPLE}' (the embedding and the first two blocks)")


def apply_freeze(chunks: dict[int, nn.Module], model: ModelConfig | ModelSpec, pattern: str | None) -> None:
    """Turn off gradients of the frozen tensors of this rank's chunks (before ZeRO buckets them)."""
    frozen = frozen_names(model, pattern)
    for chunk in chunks.values():
        for name, p in chunk.named_parameters():
            if name in frozen:
                p.requires_grad_(False)


def frozen_params(chunks: dict[int, nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """This rank's frozen parameters by name (a tied weight in one chunk listed once)."""
    return [(n, p) for c in sorted(chunks) for n, p in chunks[c].named_parameters() if not p.requires_grad]


def saved_bytes(stage: int, dp: int, frozen_numel: int) -> dict[str, int]:
    """Bytes this rank does not allocate because `frozen_numel` of its parameters are frozen: their
    fp32 gradient (whole below stage 2, a 1/D shard from stage 2) and AdamW's two fp32 moments
    (whole at stage 0, 1/D from stage 1), as zero/accounting.held_bytes counts them; and what ZeRO-3 pays
    instead for keeping them whole (4 - 4/D bytes a parameter; see the module docstring). Frozen
    tensors are in no ZeRO bucket, so held_bytes leaves them out: `param_bytes` is their own
    fp32 storage, held whole on every data-parallel rank."""
    grads = 4 * frozen_numel // (dp if stage >= 2 else 1)
    optimizer = 8 * frozen_numel // (dp if stage >= 1 else 1)
    extra = 4 * frozen_numel - 4 * frozen_numel // dp if stage == 3 else 0
    return {"frozen_params": frozen_numel, "param_bytes": 4 * frozen_numel, "grad_bytes_saved": grads,
            "optimizer_bytes_saved": optimizer, "zero3_param_bytes_extra": extra}


def summarize(per_rank: Sequence[dict[str, int]], pattern: str | None, one_replica: Sequence[int]) -> dict:
    """summary.json's `frozen` entry: the pattern, the frozen parameters of one replica (the global
    ranks `one_replica`, one a stage: which they are depends on the placement), and bytes summed
    over every rank."""
    total = {k: sum(r[k] for r in per_rank) for k in per_rank[0] if k != "frozen_params"} if per_rank else {}
    return {"pattern": pattern, "frozen_params": sum(per_rank[r]["frozen_params"] for r in one_replica), **total,
            "bytes_saved": total.get("grad_bytes_saved", 0) + total.get("optimizer_bytes_saved", 0)}
