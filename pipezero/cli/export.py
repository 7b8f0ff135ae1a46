"""`pipezero export`: a run's checkpoint as one set of weights (safetensors, or a Hugging Face folder)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipezero.errors import ConfigError


SHARD_SIZE = "5GB"  # export --format hf's default, as transformers' save_pretrained


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="write a checkpoint as model.safetensors + config.json",
                       description="Export a checkpoint (any layout) as one safetensors file for inference, or "
                                   "(--format hf) as a folder transformers' from_pretrained loads.")
    e.add_argument("source", help="a checkpoint folder (…/checkpoints/step-N) or a run directory (newest good one)")
    e.add_argument("--out", required=True, help="folder for model.safetensors and config.json")
    e.add_argument("--format", choices=("pipezero", "hf"), default="pipezero",
                   help="pipezero: one file under our names; hf: Hugging Face names, shards, config, tokenizer")
    e.add_argument("--shard-size", default=None, help=f"with --format hf: most bytes a shard (default {SHARD_SIZE})")
    e.add_argument("--model-spec", metavar="MODULE:NAME",
                   help="a run of --model-spec: name the same spec (it imports and runs that code)")
    e.set_defaults(func=lambda args: cmd_export(args))  # looked up when run: the parser is built once


def cmd_export(args: argparse.Namespace) -> int:
    from pipezero.checkpoint import CheckpointError
    from pipezero.checkpoint.export import export

    source = Path(args.source)
    if not args.out.strip():
        raise ConfigError("--out is empty: name a new folder for the export")
    from pipezero.files import unexpanded_home, unfollowable

    if problem := unexpanded_home("--out", args.out) or unfollowable("--out", args.out):
        raise ConfigError(problem)
    if not args.source.strip():  # Path("") is the working directory
        raise ConfigError("the source is empty: pass a run directory or one of its checkpoints/step-N")
    if not source.is_dir():
        raise ConfigError(f"{source} is not a folder: pass a run directory or one of its checkpoints/step-N")
    if args.model_spec is not None and not args.model_spec.strip():  # "" read as none given: exported anyway
        raise ConfigError("--model-spec is empty: name the run's spec, MODULE:NAME, or leave --model-spec out")
    if args.format == "hf" and args.model_spec:
        raise ConfigError("--format hf writes the Hugging Face families (llama, mistral, qwen2), never a --model-spec "
                          "model: drop --model-spec, or --format hf to export it as model.safetensors")
    if args.format != "hf" and args.shard_size is not None:  # its default given by name is unread too
        raise ConfigError(f"--shard-size {args.shard_size} applies with --format hf (the pipezero format is one "
                          f"model.safetensors): add --format hf, or drop --shard-size")
    try:
        if args.format == "hf":
            from pipezero.checkpoint.hf_export import export_hf, parse_size

            used, tokenizer = export_hf(source, Path(args.out), parse_size(args.shard_size or SHARD_SIZE))
            print(f"exported {used} to {args.out} (Hugging Face folder); {tokenizer}")
            return 0
        used = export(source, Path(args.out), args.model_spec)
    except CheckpointError as e:
        print(f"pipezero: error: {e}", file=sys.stderr)
        return 1
    print(f"exported {used} to {Path(args.out) / 'model.safetensors'}")
    return 0

