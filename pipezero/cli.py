"""`pipezero train | simulate`: a thin argparse layer over config, engine and simulator.

Every user mistake becomes one line on stderr and exit code 2; only bugs give tracebacks.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pipezero.config import ConfigError, Device, DType, GradReduce, Partition, ScheduleKind

# CLI flag -> config key; flags left unset do not override the TOML file or the defaults.
TRAIN_FLAGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "preset": ("model.preset", str),
    "pp": ("parallel.pp", int),
    "dp": ("parallel.dp", int),
    "zero": ("parallel.zero", int),
    "schedule": ("parallel.schedule", str),
    "microbatches": ("parallel.microbatches", int),
    "micro_batch_size": ("parallel.micro_batch_size", int),
    "virtual_stages": ("parallel.virtual_stages", int),
    "partition": ("parallel.partition", str),
    "grad_reduce": ("parallel.grad_reduce", str),
    "bucket_mb": ("parallel.bucket_mb", float),
    "seq_len": ("data.seq_len", int),
    "data": ("data.path", str),
    "tokenizer": ("data.tokenizer", str),
    "max_steps": ("run.max_steps", int),
    "seed": ("run.seed", int),
    "dtype": ("run.dtype", str),
    "device": ("run.device", str),
    "out": ("run.out", str),
    "checkpoint_every": ("run.checkpoint_every", int),
    "keep_checkpoints": ("run.keep_checkpoints", int),
    "max_bad_steps": ("run.max_bad_steps", int),
    "eval_every": ("run.eval_every", int),
    "threads": ("run.threads", int),
    "lr": ("optim.lr", float),
    "timeout": ("parallel.timeout_s", float),
    "sample_tokens": ("run.sample_tokens", int),
}


def _stage_layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stage-layers wants comma-separated integers, got {text!r}") from None


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train a model",
                       description="Train a decoder LM; how it works: docs/ARCHITECTURE.md.")
    t.add_argument("--config", help="TOML file with [model] [parallel] [optim] [data] [run] tables")
    t.add_argument("--preset", help="model size: tiny, small, base, 1b, 7b, 13b, 70b")
    t.add_argument("--nproc", type=int, help="start this many local ranks through torchrun")
    t.add_argument("--pp", type=int, help="pipeline ranks")
    t.add_argument("--dp", type=int, help="data-parallel ranks per stage")
    t.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    t.add_argument("--schedule", choices=[s.value for s in ScheduleKind])
    t.add_argument("--microbatches", type=int, help="micro-batches per data-parallel rank per step (M)")
    t.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch (B)")
    t.add_argument("--virtual-stages", type=int, help="stage chunks per pipeline rank (V)")
    t.add_argument("--partition", choices=[p.value for p in Partition])
    t.add_argument("--stage-layers", type=_stage_layers, help="layers per stage chunk, e.g. 3,5,5,3")
    t.add_argument("--grad-reduce", choices=[g.value for g in GradReduce])
    t.add_argument("--bucket-mb", type=float, help="gradient bucket size in MB (default 25)")
    t.add_argument("--recompute", action="store_true", default=None, help="activation checkpointing")
    t.add_argument("--seq-len", type=int)
    t.add_argument("--max-steps", type=int)
    t.add_argument("--seed", type=int)
    t.add_argument("--dtype", choices=[d.value for d in DType])
    t.add_argument("--device", choices=[d.value for d in Device],
                   help="cpu (gloo) or cuda (GPU LOCAL_RANK, NCCL); auto: cuda when torch sees a GPU")
    t.add_argument("--data", help="text file, folder of text files, or .bin/.npy token file")
    t.add_argument("--tokenizer", help="bpe, bytes, or a tokenizer.json")
    t.add_argument("--out", help="run directory (metrics.jsonl, summary.json, ...)")
    t.add_argument("--checkpoint-every", type=int, help="sharded checkpoint every K steps and at the end")
    t.add_argument("--keep-checkpoints", type=int, help="keep the newest N checkpoints (default 3)")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: torchrun restarts a failed job this often, resuming from the last checkpoint")
    t.add_argument("--max-bad-steps", type=int, help="stop after N non-finite steps in a row (default 3)")
    t.add_argument("--eval-every", type=int)
    t.add_argument("--threads", type=int, help="torch threads per rank")
    t.add_argument("--lr", type=float)
    t.add_argument("--timeout", type=float, help="seconds any collective or p2p wait may take before the run "
                                                 "fails naming the rank and operation (default 300)")
    t.add_argument("--sample-tokens", type=int, help="length of the text sample at the end (0: none)")
    t.add_argument("--resume", action="store_true", default=None,
                   help="continue from the newest good checkpoint under --out (a fresh start if none)")
    t.add_argument("--trace", action="store_true", default=None)
    t.add_argument("--tensorboard", action="store_true", default=None,
                   help="also write metrics.jsonl's records to OUT/tensorboard (needs the tensorboard package)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)


def train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {key: conv(getattr(args, flag)) for flag, (key, conv) in TRAIN_FLAGS.items()
                 if getattr(args, flag) is not None}
    if args.stage_layers is not None:
        overrides["parallel.stage_layers"] = args.stage_layers
    for flag, key in (("recompute", "parallel.recompute"), ("resume", "run.resume"), ("trace", "run.trace"),
                      ("tensorboard", "run.tensorboard")):
        if getattr(args, flag):
            overrides[key] = True
    if args.no_progress:
        overrides["run.progress"] = False
    return overrides


def cmd_train(args: argparse.Namespace) -> int:
    from pipezero.config import build_config
    from pipezero.engine import train

    cfg = build_config(args.config, train_overrides(args))
    if args.nproc is not None and args.nproc != cfg.parallel.world_size:
        raise ConfigError(f"--nproc {args.nproc} but --pp {cfg.parallel.pp} x --dp {cfg.parallel.dp} = "
                          f"{cfg.parallel.world_size}; make them equal")
    from pipezero.launch import exit_rank, launch_local, under_torchrun

    if args.nproc is not None and args.nproc > 1 and not under_torchrun():
        from pipezero.data import load_corpus

        load_corpus(cfg.data)  # tokenize and cache once here, not once a rank
        return launch_local(args.nproc, args.argv, args.max_restarts)
    from pipezero.checkpoint import CheckpointError
    from pipezero.nonfinite import TrainingDiverged
    from pipezero.parallel.waits import PipelineTimeout

    try:
        train(cfg)
    except (CheckpointError, TrainingDiverged, PipelineTimeout) as e:
        print(f"pipezero: error: {e}", file=sys.stderr, flush=True)
        if under_torchrun():
            os._exit(1)  # peers may be gone: no teardown collective
        return 1
    if under_torchrun():
        exit_rank(0)
    return 0


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="write a checkpoint as model.safetensors + config.json",
                       description="Export a checkpoint (any layout) as one safetensors file for inference.")
    e.add_argument("source", help="a checkpoint folder (…/checkpoints/step-N) or a run directory (newest good one)")
    e.add_argument("--out", required=True, help="folder for model.safetensors and config.json")
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipezero.checkpoint import CheckpointError
    from pipezero.checkpoint.export import export

    source = Path(args.source)
    if not source.is_dir():
        raise ConfigError(f"{source} is not a folder: pass a run directory or one of its checkpoints/step-N")
    try:
        used = export(source, Path(args.out))
    except CheckpointError as e:
        print(f"pipezero: error: {e}", file=sys.stderr)
        return 1
    print(f"exported {used} to {Path(args.out) / 'model.safetensors'}")
    return 0


def add_verify_parser(sub: argparse._SubParsersAction) -> None:
    """`verify` takes every `train` flag (the same parser's arguments) plus `--steps`."""
    v = sub.add_parser("verify", parents=[sub.choices["train"]], add_help=False,
                       help="check that a layout trains the same model as one process",
                       description="Run K steps of a layout and of one process (pp=1, dp=1) and compare losses, "
                                   "gradient norms and every rank's parameters; exit 0 within tolerance, else 1. "
                                   "See README and docs/ARCHITECTURE.md.")
    v.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3)")
    v.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    from pipezero.config import build_config
    from pipezero.verify import verify_layout

    if args.steps < 1:
        raise ConfigError("--steps must be at least 1")
    cfg = build_config(args.config, train_overrides(args))
    return verify_layout(cfg, args.steps, args.nproc, args.argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipezero", description="Pipeline parallelism + ZeRO training. "
                                     "How it works: docs/ARCHITECTURE.md in the repository.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_verify_parser(sub)
    add_export_parser(sub)
    from pipezero.sim.commands import add_plan_parser, add_simulate_parser

    add_simulate_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"pipezero: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
