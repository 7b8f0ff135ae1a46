"""`pipezero simulate --memory`: each rank's predicted peak memory by category (memory/model.py) for a
layout given with train's layout flags, as a table, JSON, or a picture of every rank's memory over
the step (--png).

A flag left out takes train's default, not simulate's (whose --pp 4, --microbatches 8 and --preset
small suit a timeline): `simulate --memory --dp 2` predicts the P=1 x D=2 that `train --dp 2` runs,
so a prediction is never held against a run of another layout. The table's title and the JSON's
`layout` name the layout predicted."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from pipezero.config import Offload, Partition, ScheduleKind, TrainConfig, Zero3Unit
from pipezero.schedules.registry import default_virtual
from pipezero.memory.model import CATEGORIES, HOST_CATEGORIES, PHASES, RankMemory, build_plan, every_rank
from pipezero.memory.partition import resolve

MIB = 2**20
# simulate's flag -> the run setting it sets for --memory (the layout flags train also takes)
LAYOUT: dict[str, str] = {"preset": "model.preset", "pp": "parallel.pp", "dp": "parallel.dp", "zero": "parallel.zero",
                          "schedule": "parallel.schedule", "microbatches": "parallel.microbatches",
                          "virtual_stages": "parallel.virtual_stages", "micro_batch_size": "parallel.micro_batch_size",
                          "seq_len": "data.seq_len", "recompute": "parallel.recompute", "dtype": "run.dtype",
                          "bucket_mb": "parallel.bucket_mb", "grad_reduce": "parallel.grad_reduce",
                          "partition": "parallel.partition", "eval_batches": "run.eval_batches",
                          "zero3_prefetch": "parallel.zero3_prefetch", "zero3_unit": "parallel.zero3_unit",
                          "sample_tokens": "run.sample_tokens", "quantize_weights": "parallel.quantize_weights",
                          "quantize_grads": "parallel.quantize_grads", "quant_block": "parallel.quant_block",
                          "offload": "parallel.offload", "offload_activations": "parallel.offload_activations"}


def add_memory_flags(s: argparse.ArgumentParser) -> None:
    m = s.add_argument_group("memory (--memory: each rank's predicted peak by category, memory/model.py)")
    m.add_argument("--memory", action="store_true", help="predict every rank's peak memory of one step")
    m.add_argument("--config", help="a train TOML file; the flags given override it")
    m.add_argument("--micro-batch-size", type=int, default=None, help="sequences a micro-batch (B)")
    m.add_argument("--seq-len", type=int, default=None, help="tokens a sequence")
    m.add_argument("--recompute", action="store_true", default=None, help="activation checkpointing, one transformer block at a time")
    m.add_argument("--eval-batches", type=int, default=None,
                   help="global batches an evaluation reads (its phase: sends held to its end; default 4)")
    m.add_argument("--sample-tokens", type=int, default=None,
                   help="the end-of-run text sample's length (its phase, without a pipeline; default 64)")
    m.add_argument("--zero3-prefetch", default=None,  # a number, read by commands.py read_prefetch
                   help="ZeRO-3 layer by layer: layers a gather starts ahead of its use (as train --zero3-prefetch; "
                        "with --zero3-layerwise it also places the lowered program's gathers; auto is the planner's: "
                        "pipezero plan, or train --link-gbps)")
    m.add_argument("--zero3-unit", choices=[x.value for x in Zero3Unit], default=None,
                   help="ZeRO-3 layer by layer (--memory, or --zero3-layerwise): what one gather covers (as train "
                        "--zero3-unit: layer, or sublayer, a block's attention and MLP apart)")
    m.add_argument("--offload", choices=[x.value for x in Offload], default=None,
                   help="optimizer: predict with fp32 masters, AdamW moments and a gradient staging copy in host "
                        "memory (16 bytes an updated parameter; the device sheds AdamW's 8): its host bytes are "
                        "shown beside the device's (as train --offload)")
    m.add_argument("--offload-activations", type=int, default=None, metavar="N",
                   help="predict with each pipeline rank's first N warm-up micro-batches' saved activations in host "
                        "memory between forward and backward (as train --offload-activations)")
    m.add_argument("--partition", choices=[x.value for x in Partition], default=None,
                   help="how layers are cut into stage chunks (as train --partition; memory: the cuts whose "
                        "largest predicted peak is least)")


def memory_config(args: argparse.Namespace, typed: set[str]) -> TrainConfig:
    """The run settings the flags describe: the flags `typed` on the command line (dests) over the
    --config file over train's defaults, as `train` would take them."""
    from pipezero.settings import build_config

    given = {}
    for dest, key in LAYOUT.items():
        value = getattr(args, dest, None)
        if value is None or dest not in typed:
            continue
        given[key] = value if isinstance(value, (bool, str)) else str(value)
    if "schedule" in typed and "virtual_stages" not in typed:  # as simulate's timing: V = 2 where it needs V > 1
        given["parallel.virtual_stages"] = str(default_virtual(ScheduleKind(args.schedule)))
    return build_config(args.config, given, {key: f"--{dest.replace('_', '-')}" for dest, key in LAYOUT.items()})


def layout_of(cfg: TrainConfig) -> dict:
    """The layout a prediction is of, as train's settings name it."""
    p = cfg.parallel
    return {"preset": cfg.model.preset, "pp": p.pp, "dp": p.dp, "zero": p.zero, "schedule": p.schedule.value,
            "microbatches": p.microbatches, "micro_batch_size": p.micro_batch_size,
            "virtual_stages": p.virtual_stages, "seq_len": cfg.data.seq_len, "dtype": cfg.run.dtype.value,
            "recompute": p.recompute, "quantize_weights": p.quantize_weights.value,
            "quantize_grads": p.quantize_grads.value, "offload": p.offload.value}


def cmd_simulate_memory(args: argparse.Namespace, typed: set[str]) -> int:
    cfg = memory_config(args, typed)
    plan = build_plan(resolve(cfg))
    ranks = every_rank(plan, keep_timeline=bool(args.png))
    cuts = [b - a for a, b in plan.layer_bounds]  # layers a stage chunk, as the policy cut them
    if args.png:
        draw_memory(ranks, cfg, args.png)
    if args.json:
        print(json.dumps({"layout": layout_of(cfg), "ranks": [r.to_json() for r in ranks], "stage_layers": cuts},
                         indent=2))
        return 0
    p = cfg.parallel
    table = Table(title=f"peak memory a rank (MiB): {cfg.model.preset} P={p.pp} D={p.dp} ZeRO-{p.zero} "
                        f"{p.schedule.value} M={p.microbatches} B={p.micro_batch_size} T={cfg.data.seq_len} "
                        f"{cfg.run.dtype.value}{' recompute' if p.recompute else ''}"
                        f"{''.join(f' {k} {v}' for k, v in (('weights', p.quantize_weights.value), ('grads', p.quantize_grads.value)) if v != 'none')}"
                        f"{' offload ' + p.offload.value if p.offload is not Offload.NONE else ''}"
                        f"; layers a chunk "
                        f"{','.join(map(str, cuts))} ({'explicit' if p.stage_layers else p.partition.value})")
    # the device's categories at its peak, then the host's (memory/model.py WHERE: each says where it lives)
    shown = [c for c in CATEGORIES if any(r.categories[c] for r in ranks)]
    host = [c for c in HOST_CATEGORIES if any(r.host_categories.get(c) for r in ranks)]
    # each phase's own peak (the training step, the evaluation, the text sample): the peak is the most
    phases = [ph for ph in PHASES if any(ph in r.phases for r in ranks)]
    for col in ("rank", "device peak", *shown, *(f"{ph} peak" for ph in phases), "at", "host peak", *host):
        table.add_column(col, justify="left" if col == "at" else "right")
    for r in ranks:
        table.add_row(str(r.rank), f"{r.peak_bytes / MIB:,.1f}", *(f"{r.categories[c] / MIB:,.1f}" for c in shown),
                      *(f"{r.phases[ph] / MIB:,.1f}" if ph in r.phases else "-" for ph in phases), r.at,
                      f"{r.host_peak_bytes / MIB:,.1f}", *(f"{r.host_categories.get(c, 0) / MIB:,.1f}" for c in host))
    Console(width=160, emoji=False).print(table)
    return 0


def draw_memory(ranks: list[RankMemory], cfg: TrainConfig, path: str) -> None:
    """One panel a pipeline rank (data-parallel rank 0): live bytes by category, instruction by
    instruction, then the evaluation's and the text sample's peaks (the last points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in ranks if r.rank % cfg.parallel.dp == 0]
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.8 * len(shown) + 0.6), squeeze=False, sharex=False)
    for ax, r in zip(axes[:, 0], shown):
        xs = [i for i, _ in r.timeline]
        ax.stackplot(xs, *[[live[c] / MIB for _, live in r.timeline] for c in CATEGORIES], labels=CATEGORIES)
        ax.set_ylabel(f"rank {r.rank}\nMiB")
    axes[0, 0].legend(loc="upper left", fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel("instruction of the step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
