"""What `train --layout auto` refuses of a request before any rank starts, beyond what every run's
settings are held to (planner/auto_job.py `request` calls these): a step's tokens past train's
limit, a probe measured where the run does not train, quantized traffic no layout weighed has."""

from __future__ import annotations

from typing import Any

from pipezero.config import TrainConfig
from pipezero.errors import ConfigError


def check_batch_tokens(global_batch: int, seq_len: int) -> None:
    """train's limit on a step's tokens (settings.py), said for --global-batch: every layout of a larger
    one is refused, and the search's refusal blamed the world size."""
    from pipezero.schedules import limits

    if (tokens := global_batch * seq_len) > limits.BATCH_TOKENS:
        raise ConfigError(f"--global-batch {global_batch} x --seq-len {seq_len} = {tokens} tokens a step; the limit "
                          f"is {limits.BATCH_TOKENS} (every rank holds the step's batch in memory): a smaller "
                          f"--global-batch or --seq-len")


def check_quantized_read(keys: tuple[str, str], bits: tuple[int, int], world: int, wanted: dict[str, Any],
                         names: dict[str, str]) -> None:
    """Quantized traffic allowed (`keys`: the weights' and gradients' settings; `bits`: theirs) where
    no layout weighed has any (one rank, D = 1 by a constraint, ZeRO-0 for the weights' gathers): the
    flag would be read by nothing, as train refuses it for a given layout (settings.py)."""
    given = {k: v for k, v in wanted.items() if k in ("parallel.pp", "parallel.dp", "parallel.zero")}
    one_replica = world == 1 or given.get("parallel.dp") == 1 or given.get("parallel.pp") == world
    for key, b in zip(keys, bits):
        weights = key == "parallel.quantize_weights"
        if b and (one_replica or (weights and given.get("parallel.zero") == 0)):
            flag = f"{names.get(key, '--' + key.split('.')[1].replace('_', '-'))} int{b}"
            with_ = " with " + " ".join(f"--{k.split('.')[1]} {getattr(v, 'value', v)}" for k, v in given.items()) \
                if given else ""
            what = "ZeRO gathers of weights" if weights else "data-parallel gradient traffic"
            raise ConfigError(f"--layout auto with {flag}: no layout of {world} rank{'s' * (world != 1)}{with_} has "
                              f"{what} to quantize; drop it{' or those constraints' if given else ''}")


def check_measured_here(path: str, probe: Any, base: TrainConfig, cuda: bool) -> None:
    """A probe prices the ranks it was measured on: another device kind's or dtype's rates (a GPU's
    for CPU ranks, bf16's for an fp32 run) would choose from figures this run never reaches."""
    if (probe.device == "cpu") == cuda:
        here = "CUDA GPUs" if cuda else "the CPU"
        raise ConfigError(f"--costs {path} was measured on {probe.device}, and this run's ranks compute on {here}: "
                          f"probe where the run trains (pipezero probe --device {'cuda' if cuda else 'cpu'} --json "
                          f"FILE), or drop --costs")
    if probe.dtype != base.run.dtype.value:
        raise ConfigError(f"--costs {path} was measured in {probe.dtype}, and the run trains in "
                          f"{base.run.dtype.value}: probe with --dtype {base.run.dtype.value}, or train with --dtype "
                          f"{probe.dtype}")


def shape_note(path: str, probe: Any, base: TrainConfig) -> str | None:
    """A probe timed at another sequence length than the run's: its compute rate (a block's FLOPs
    over its time) moves with the shape (attention grows with the square of the length), so the
    choice may price compute the run never sees; said, not refused (the figures still rank layouts)."""
    if probe.seq_len == base.data.seq_len:
        return None
    return (f"--costs {path} timed blocks of {probe.seq_len} tokens, and this run's are {base.data.seq_len}: its "
            f"compute rate may not hold at this length; probe with --seq-len {base.data.seq_len} for figures of this run")
