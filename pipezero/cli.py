"""`pipezero train | verify | export | cluster | simulate | plan`: a thin argparse layer over config, engine,
launcher and simulator. The reference pages of the documentation are generated from this parser.

Every user mistake becomes one line on stderr and exit code 2; only bugs give tracebacks.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pipezero.errors import ConfigError
from pipezero.schedules.registry import help_text as schedule_help

# Every `train` flag, declared once: flag -> (setting it overrides, help). Values reach settings.py as
# text, which checks and converts them like TOML values, so a bad value is one line naming the flag.
# Flags left unset do not override the TOML file or the defaults.
TRAIN_FLAGS: dict[str, tuple[str, str]] = {
    "--preset": ("model.preset", "model size: tiny, small, base, 1b, 7b, 13b, 70b"),
    "--model": ("model.pretrained", "a local Hugging Face model folder (llama, mistral, qwen2: config.json, "
                                    "safetensors, tokenizer.json) to fine-tune; nothing is downloaded"),
    "--model-spec": ("model.spec", "MODULE:NAME of a model of your own: a ModelSpec subclass, instance or function "
                                   "returning one (examples/own_model.py:GPTSpec is one); the working directory "
                                   "is searched first"),
    "--nproc": ("launch.nproc", "start this many local ranks through torchrun"),
    "--max-restarts": ("launch.max_restarts", "with --nproc: torchrun restarts a failed job this often, "
                                              "resuming from the last checkpoint"),
    "--pp": ("parallel.pp", "pipeline ranks"),
    "--dp": ("parallel.dp", "data-parallel ranks per stage"),
    "--zero": ("parallel.zero", "ZeRO stage"),
    "--schedule": ("parallel.schedule", "pipeline schedule; " + schedule_help()),
    "--microbatches": ("parallel.microbatches", "micro-batches per data-parallel rank per step (M)"),
    "--micro-batch-size": ("parallel.micro_batch_size", "sequences per micro-batch (B)"),
    "--virtual-stages": ("parallel.virtual_stages", "stage chunks per pipeline rank (V; default the schedule's fewest: 1, or 2 for interleaved and V-shaped ones)"),
    "--partition": ("parallel.partition", "how layers are split over stage chunks (memory: the cut whose largest "
                                          "predicted per-rank peak is least)"),
    "--stage-layers": ("parallel.stage_layers", "layers per stage chunk, e.g. 3,5,5,3"),
    "--grad-reduce": ("parallel.grad_reduce", "reduce gradients once a step or every micro-batch"),
    "--placement": ("parallel.placement", "neighbouring ranks (one node) hold a stage's replicas (dp-inner) "
                                          "or a pipeline's stages (pp-inner)"),
    "--bucket-mb": ("parallel.bucket_mb", "gradient bucket size in MB (default 25)"),
    "--recompute": ("parallel.recompute", "activation checkpointing"),
    "--no-overlap-gather": ("parallel.overlap_gather", "ZeRO-1/2: wait for the all-gather of updated weights at "
                                                       "the end of the step (default: each layer waits for its own "
                                                       "in the next forward)"),
    "--buckets-in-flight": ("parallel.buckets_in_flight", "ZeRO-2/3: gradient buckets whose reduce-scatter may "
                                                          "still run while the backward goes on (memory: a full "
                                                          "bucket each; default 1)"),
    "--hierarchical": ("parallel.hierarchical", "reduce gradients in two levels, inside each node first, then "
                                                "across nodes (CPU ranks; pays where a slow link joins the nodes)"),
    "--quantize-weights": ("parallel.quantize_weights", "ZeRO-1/2/3: gathers of parameters travel as int8 with one "
                                                        "fp32 scale a block (~1/4 of fp32's bytes); master "
                                                        "weights stay fp32"),
    "--quantize-grads": ("parallel.quantize_grads", "gradient reductions travel blockwise-quantized, summed in fp32 "
                                                    "(~1/4 or ~1/8 of fp32's bytes)"),
    "--secondary-shard": ("parallel.secondary_shard", "ZeRO-3 layer by layer: node keeps each bucket split over its "
                                                      "ranks after the step's first gather, so later gathers stay "
                                                      "inside the node (4/N bytes a parameter)"),
    "--offload": ("parallel.offload", "optimizer: fp32 master shards and AdamW state in host memory, the AdamW "
                                      "step on the CPU (the device keeps the weights it computes with; AdamW's "
                                      "8 bytes a parameter leave it)"),
    "--offload-activations": ("parallel.offload_activations", "on each pipeline rank, this many micro-batches' "
                                                              "saved activations wait in host memory between "
                                                              "their forward and backward (default 0; at least "
                                                              "M lowers a steady state's peak)"),
    "--zero3-prefetch": ("parallel.zero3_prefetch", "ZeRO-3 layer by layer: layers ahead of its use a layer's gather "
                                                    "starts (default 1), or auto: the planner's choice for "
                                                    "--link-gbps"),
    "--zero3-unit": ("parallel.zero3_unit", "ZeRO-3 layer by layer: what one gather and reduction covers: layer "
                                            "(default) or sublayer (a block's attention and MLP apart)"),
    "--link-gbps": ("parallel.link_gbps", "GB/s a rank's data-parallel traffic gets between nodes (for "
                                          "--zero3-prefetch auto)"),
    "--tflops": ("parallel.tflops", "TFLOP/s a rank's compute achieves (for --zero3-prefetch auto; default 445 on "
                                    "CUDA, 0.05 on CPU)"),
    "--quant-block": ("parallel.quant_block", "elements sharing one fp32 scale when quantizing (default 256)"),
    "--timeout": ("parallel.timeout_s", "seconds any collective or p2p wait may take before the run fails "
                                        "naming the rank and operation (default 300)"),
    "--stall-report": ("parallel.stall_report_s", "seconds a wait may take before every rank writes where it is "
                                                  "for the hang doctor (default: a quarter of --timeout)"),
    "--seq-len": ("data.seq_len", "tokens a sequence"),
    "--data": ("data.path", "documents: .jsonl/.json/.parquet records, .txt/.md files, folders or globs; "
                            "or one .bin/.npy token file"),
    "--text-field": ("data.text_field", "the record field (parquet: column) holding a document's text"),
    "--on-bad-record": ("data.on_bad_record", "a bad record stops the run (fail) or is counted and skipped"),
    "--packing": ("data.packing", "documents into windows: doc-masked (default for documents), concat, "
                                  "or none (one document a row)"),
    "--heldout-fraction": ("data.heldout_fraction", "share of documents held out for evaluation"),
    "--tokenizer": ("data.tokenizer", "bpe, bytes, or a tokenizer.json"),
    "--max-document-mb": ("data.max_document_mb", "largest document (a record, a parquet value, a text file): "
                                                  "a larger one is a bad record (tokenizing one takes many times "
                                                  "its size in memory)"),
    "--lr": ("optim.lr", "peak learning rate"),
    "--warmup-steps": ("optim.warmup_steps", "steps of linear warm-up to the peak rate (the preset's: 20, or "
                                             "2000 from 1b up)"),
    "--freeze": ("optim.freeze", "parameters whose name (layers.0.weight, layers.3.attn.wq.weight, ...) this regex "
                                 "matches do not train, e.g. 'layers\\.0\\.|layers\\.[1-2]\\.'"),
    "--max-steps": ("run.max_steps", "optimizer steps"),
    "--seed": ("run.seed", "seed of weights and data order"),
    "--dtype": ("run.dtype", "compute and communication dtype"),
    "--device": ("run.device", "cpu (gloo) or cuda (GPU LOCAL_RANK, NCCL); auto: cuda when torch sees a GPU"),
    "--share-device": ("run.share_device", "ranks sharing a GPU, through the host (gloo, staging copies), each capped "
                                           "to its share of the GPU's memory: auto (default) when a node has more "
                                           "ranks than GPUs, on (always; on CPU ranks the staging path's test), off"),
    "--out": ("run.out", "run directory (metrics.jsonl, summary.json, checkpoints)"),
    "--checkpoint-every": ("run.checkpoint_every", "sharded checkpoint every K steps (and at the end, unless --no-save-final)"),
    "--no-save-final": ("run.save_final", "save no checkpoint after the last step (saved by default, so "
                                          "`pipezero export` and --resume find the trained weights), only "
                                          "--checkpoint-every's multiples"),
    "--keep-checkpoints": ("run.keep_checkpoints", "keep the newest N checkpoints of this run (default 3)"),
    "--max-bad-steps": ("run.max_bad_steps", "stop after N non-finite steps in a row (default 3)"),
    "--eval-every": ("run.eval_every", "held-out loss every K steps (0: at the end only)"),
    "--threads": ("run.threads", "torch threads per rank (default: OMP_NUM_THREADS, else cores / ranks on the node)"),
    "--sample-tokens": ("run.sample_tokens", "length of the text sample at the end (0: none)"),
    "--resume": ("run.resume", "continue from the newest good checkpoint under --out (a fresh start if none, unless the folder holds the run's metrics.jsonl, summary.json or trace: refused, never replaced)"),
    "--trace": ("run.trace", "write trace.json and trace.png"),
    "--tensorboard": ("run.tensorboard", "also write metrics.jsonl's records to OUT/tensorboard (needs tensorboard)"),
    "--compile": ("run.compile", "torch.compile each transformer block (1f1b, gpipe, interleaved-1f1b, looped-bfs)"),
    "--no-progress": ("run.progress", "a plain log line every step (step, loss, tokens/s) instead of a progress bar"),
    "--memory-profile": ("run.memory_profile", "measure each rank's peak memory of the first step, the first "
                                               "evaluation and the text sample and write them beside the memory "
                                               "model's prediction in summary.json"),
    "--gpu-memory": ("run.gpu_memory_gib", "GiB a rank may use: a layout whose predicted peak exceeds it is refused "
                                           "before any rank starts (default on CUDA: the device's memory, or a "
                                           "rank's share of it when ranks share a GPU; CPU: off)"),
    "--host-memory": ("run.host_memory_gib", "GiB of host memory this node has for its ranks: a run whose ranks here "
                                             "need more (--offload optimizer's host buffers; CPU ranks: their whole "
                                             "predicted peak) is refused before any rank starts (default: this "
                                             "machine's memory)"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see --help\n")


def add_train_flags(parser: argparse.ArgumentParser, keys: Collection[str] | None = None) -> None:
    """Register `train`'s flags on `parser` (any command that takes a run's settings reuses it);
    `keys`: only the flags of these settings (a command that reads no others takes no others)."""
    from pipezero.settings import accepts, choices_of, setting_type

    parser.add_argument("--config", help="TOML file with [model] [parallel] [optim] [data] [run] tables")
    for flag, (key, text) in TRAIN_FLAGS.items():
        if keys is not None and key not in keys:
            continue
        if setting_type(key) is bool:  # a switch: --no-X turns a setting off, any other flag on
            parser.add_argument(flag, dest=key, action="store_const", const=not flag.startswith("--no-"), help=text)
        else:
            options = choices_of(key)
            metavar = "{" + ",".join(options) + "}" if options else flag[2:].upper().replace("-", "_")
            many = accepts(key).startswith("a list of strings")  # e.g. --data PATH...
            parser.add_argument(flag, dest=key, metavar=metavar, nargs="+" if many else None,
                                help=f"{text} ({accepts(key)})")


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", allow_abbrev=False, help="train a model", description="Train a decoder LM; how it works: docs/ARCHITECTURE.md.")
    add_train_flags(t)
    t.add_argument("--force", action="store_true", help="train a new run in an --out that holds a run pipezero started (its .run-id or checkpoints), "
                        "replacing its metrics.jsonl, summary.json and trace; in a folder of files pipezero did not "
                        "write (no .run-id, no checkpoints) a run's names are refused, never replaced, and other "
                        "files are left beside the run")
    t.set_defaults(func=cmd_train)


def flag_values(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """The flags given, as (run settings, launcher settings, flag name of each setting)."""
    given = {key: getattr(args, key) for key, _ in TRAIN_FLAGS.values() if getattr(args, key, None) is not None}
    names = {key: flag for flag, (key, _) in TRAIN_FLAGS.items()}
    launch = {k: v for k, v in given.items() if k.startswith("launch.")}
    return {k: v for k, v in given.items() if k not in launch}, launch, names


def cmd_train(args: argparse.Namespace) -> int:
    from pipezero.settings import build_config, build_launch, check_launch

    settings, launch_values, names = flag_values(args)
    launch = build_launch(launch_values, names)
    cfg = build_config(args.config, settings, names)
    check_launch(launch, cfg.parallel.world_size)
    from pipezero.sim.fit import check_fit, limit_name, rank_limit_gib

    local = local_ranks(launch.nproc, cfg.parallel.world_size)
    limit, cuda = rank_limit_gib(cfg, local)
    check_fit(cfg, limit, cuda, limit_name(cfg, local))  # before any rank starts: a layout that cannot fit is refused
    from pipezero.launch import (adopt_slurm, check_rendezvous_host, check_world_size, exit_rank, launch_local,
                                 preflight, under_torchrun)

    adopt_slurm(launch.nproc)  # srun with one task a rank: torchrun's variables from Slurm's
    check_world_size(os.environ, cfg.parallel.pp, cfg.parallel.dp)
    check_rendezvous_host(os.environ)
    if not under_torchrun():  # a rank of a job (srun's, torchrun's) holds only its own
        check_host_memory(cfg, cuda)
    from pipezero.rundir import HELD_BY_LAUNCHER, Claim, claim_here

    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if not restarts.isdigit():  # torchrun's, read as an integer by the claim and the resume: a traceback
        raise ConfigError(f"TORCHELASTIC_RESTART_COUNT={restarts[:80]!r} is not a count; it is torchrun's variable: "
                          f"unset it")
    if args.force and cfg.run.resume:  # resume won, and --force was read by nothing
        raise ConfigError("--force and --resume ask for opposite things (--force: a new run beside the one in --out; "
                          "--resume: continue that one): choose one")
    check_out(cfg)
    if cfg.model.pretrained is not None and not under_torchrun():  # once, not in every rank
        from pipezero.models.hf_weights import check_finite

        check_finite(cfg.model)

    launching = launch.nproc is not None and launch.nproc > 1 and not under_torchrun()
    if launching:
        device = preflight(cfg, launch.nproc)  # the ranks' device is decided here, once
    def clashes() -> str | None:
        from pipezero.checkpoint.state import clashes as beside

        return beside(cfg)

    with claim_here(cfg.run.out, cfg.run.resume, args.force, clashes) as held:
        if launching:
            return launch_local(launch.nproc, [*args.argv, "--device", device.value], cfg.run.out,
                                launch.max_restarts, {HELD_BY_LAUNCHER: "1"},
                                lock_fd=held.fd if isinstance(held, Claim) else None)
        code = train_here(cfg)
        if code == 2 and isinstance(held, Claim):  # the user's spec raised: nothing of the run stays
            held.drop_opening()
    if under_torchrun():
        exit_rank(code)
    return code


def local_ranks(nproc: int | None, world: int) -> int:
    """Ranks on this node: `--nproc`'s, or torchrun's LOCAL_WORLD_SIZE for a rank it started, or the
    layout's (one process of a one-rank run)."""
    from pipezero.launch import under_torchrun

    if nproc is not None:
        return nproc
    return int(os.environ.get("LOCAL_WORLD_SIZE") or world) if under_torchrun() else 1


def check_out(cfg: Any) -> None:
    """What train refuses about --out before any rank starts (a resume's clashes and problems, a
    link at OUT/hf); the claim checks the rest as it takes the folder."""
    from pipezero.launch import under_torchrun
    from pipezero.rundir import run_id

    kept = Path(cfg.run.out) / "hf"
    if cfg.model.pretrained is not None and kept.is_symlink():  # rewritten at each start, through the link
        raise ConfigError(f"--out {cfg.run.out!r}: hf is a symlink (to {os.readlink(kept)}), and the run rewrites the "
                          f"model's files there at each start, which would write over that folder's: remove the "
                          f"link (the run keeps its own copy)")
    if cfg.run.resume and not under_torchrun():  # another run's folder is named busy first: its steps are moving
        from pipezero.rundir import in_use

        in_use(cfg.run.out)
    if cfg.run.resume:  # a save replaces what is at its step: refuse here what the run did not write
        from pipezero.checkpoint.state import resume_clashes, resume_problem

        if clash := resume_clashes(cfg, run_id(cfg.run.out)):
            raise ConfigError(f"--out {cfg.run.out!r}: {clash}")
        if not under_torchrun() and (problem := resume_problem(cfg, run_id(cfg.run.out))):
            raise ConfigError(f"--resume in {cfg.run.out!r}: {problem}")


def check_host_memory(cfg: Any, cuda: bool = False) -> None:
    """The ranks started here share this host's memory (--host-memory, default this machine's): a
    run whose ranks need more was built for minutes before the kernel killed it (--preset 7b on a
    24 GiB host). Counted from the memory model (sim/memory.py, sim/offload.py): each rank's host
    bytes (--offload optimizer's masters, moments and gradient staging) and, on CPU ranks, whose
    device is the host, their device peak too. A model of one's own is not predicted."""
    from pipezero.config import Offload

    offload = cfg.parallel.offload is not Offload.NONE
    if cfg.model.spec is not None or (cuda and not offload):
        return  # nothing of pipezero's own on a GPU rank's host without offload
    from pipezero.sim.memory import predict
    from pipezero.sim.memory_partition import resolve
    from pipezero.sim.offload import node_host_need

    gib = 2**30
    given = cfg.run.host_memory_gib
    host = given * gib if given is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    ranks = predict(resolve(cfg, cuda), cuda)  # cut as the ranks will cut it (--partition memory)
    need = node_host_need([r.host_peak_bytes for r in ranks], [r.peak_bytes for r in ranks], not cuda)
    if need <= host:
        return
    ranks_of = "1 rank's" if len(ranks) == 1 else f"{len(ranks)} ranks'"
    held = "host buffers of --offload optimizer: fp32 masters, AdamW moments, gradient staging"
    if cuda:
        whose = f"{ranks_of.replace('rank', 'GPU rank')} {held}"
    else:  # a CPU rank's whole peak is on the host, and with offload its host buffers beside it
        whose = (f"{ranks_of.replace('rank', 'CPU rank')} predicted peak{'' if len(ranks) == 1 else 's'}: weights, "
                 f"gradients, AdamW state, activations" + (f"; and their {held}" if offload else ""))
    limit = f"--host-memory {given:g} GiB" if given is not None else f"this host's {host / gib:.1f} GiB"
    fix = ("more host memory, ranks on more hosts, or with --dp > 1 --zero 1 or more (each rank offloads its shard, "
           "not every bucket)" if offload else "a smaller --preset or --model, or ranks on more hosts")
    size = f"{need / gib:.1f}" if need >= gib else f"{need / gib:.2g}"  # a small run's need is not "0.0"
    raise ConfigError(f"the run needs about {size} GiB ({whose}), more than {limit}: {fix}")


def train_here(cfg: Any) -> int:
    """Train as this process (alone or one rank); a failure the user can act on is one line, exit 1
    (exit 2: the user's own --model-spec code raised)."""
    from pipezero.checkpoint import CheckpointError
    from pipezero.engine import train
    from pipezero.launch import under_torchrun
    from pipezero.nonfinite import TrainingDiverged
    from pipezero.parallel.waits import PipelineTimeout

    try:
        train(cfg)
    except (CheckpointError, TrainingDiverged, PipelineTimeout) as e:
        print(f"pipezero: error: {e}", file=sys.stderr, flush=True)
        if under_torchrun():
            os._exit(1)  # peers may be gone: no teardown collective
        return 1
    except Exception as e:  # noqa: BLE001 - said in one line only when it is no bug of pipezero's (failure_line)
        if (said := failure_line(cfg, e)) is None:
            raise
        code, line = said
        print(f"pipezero: error: {line}", file=sys.stderr, flush=True)
        if under_torchrun():
            os._exit(code)  # peers may be gone: no teardown collective
        return code
    return 0


def failure_line(cfg: Any, e: Exception) -> tuple[int, str] | None:
    """(exit code, line) for a training failure the user can act on; None for any other (its traceback):
    a write refused (a full disk, a read-only or immutable file), a process group whose connection
    failed, the user's --model-spec code raising (exit 2: its own line, as a refusal's)."""
    from pipezero.launch import under_torchrun
    from pipezero.slurm import rendezvous_advice
    from pipezero.util import refused_write

    if isinstance(e, OSError) and (refused := refused_write(e)) is not None:  # metrics, summary, tensorboard
        from pipezero.checkpoint.store import after_fixing
        from pipezero.rundir import run_id

        return 1, f"rank {os.environ.get('RANK', 0)}: {refused}; {after_fixing(Path(cfg.run.out) / 'checkpoints', run_id(cfg.run.out))}"
    # torch's DistNetworkError, DistStoreError (by name: torch 2.5 has no such API): a MASTER_ADDR that
    # resolves nowhere
    if isinstance(e, RuntimeError) and type(e).__name__ in ("DistNetworkError", "DistStoreError"):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return 1, (f"rank {os.environ.get('RANK', 0)}: the process group's connection to "
                   f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')} failed "
                   f"({type(e).__name__}: {first}); {rendezvous_advice(os.environ)}")
    if cfg.model.spec is not None and (line := parts_out_of_order(cfg, e)) is not None:
        return 2, line
    if cfg.model.spec is not None:
        from pipezero.models.user_spec import users_fault

        if (fault := users_fault(cfg.model.spec, e)) is not None:  # each failing rank says it, named
            return 2, f"rank {os.environ.get('RANK', 0)}: {fault}" if under_torchrun() else str(fault)
    return None


def parts_out_of_order(cfg: Any, e: Exception) -> str | None:
    """The line for a spec's parts the runtime found in another order than its forward runs them
    (a layer the start-up check could not run: models/parts.py `forward_order`); None for any other
    failure. With the built-in model's parts the same error is a bug of ours (its traceback)."""
    from pipezero.config import Zero3Unit
    from pipezero.zero.gathering import UngatheredUse

    if not isinstance(e, UngatheredUse) or cfg.parallel.zero3_unit is not Zero3Unit.SUBLAYER:
        return None
    return (f"{e}: --model-spec {cfg.model.spec}'s layer_parts lists a layer's parts in another order than its "
            f"forward runs them; list the parts in the order they run, each part's modules one after another")


SHARD_SIZE = "5GB"  # export --format hf's default, as transformers' save_pretrained


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("export", help="write a checkpoint as model.safetensors + config.json",
                       description="Export a checkpoint (any layout) as one safetensors file for inference, or "
                                   "(--format hf) as a folder transformers' from_pretrained loads.")
    e.add_argument("source", help="a checkpoint folder (…/checkpoints/step-N) or a run directory (newest good one)")
    e.add_argument("--out", required=True, help="folder for model.safetensors and config.json")
    e.add_argument("--format", choices=("pipezero", "hf"), default="pipezero",
                   help="pipezero: one file under our names; hf: Hugging Face names, shards, config, tokenizer")
    e.add_argument("--shard-size", default=SHARD_SIZE, help=f"with --format hf: most bytes a shard (default {SHARD_SIZE})")
    e.add_argument("--model-spec", metavar="MODULE:NAME",
                   help="a run of --model-spec: name the same spec (it imports and runs that code)")
    e.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from pipezero.checkpoint import CheckpointError
    from pipezero.checkpoint.export import export

    source = Path(args.source)
    if not args.out.strip():
        raise ConfigError("--out is empty: name a new folder for the export")
    from pipezero.util import unexpanded_home, unfollowable

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
    if args.format != "hf" and args.shard_size != SHARD_SIZE:
        raise ConfigError(f"--shard-size {args.shard_size} applies with --format hf (the pipezero format is one "
                          f"model.safetensors): add --format hf, or drop --shard-size")
    try:
        if args.format == "hf":
            from pipezero.checkpoint.hf_export import export_hf, parse_size

            used, tokenizer = export_hf(source, Path(args.out), parse_size(args.shard_size))
            print(f"exported {used} to {args.out} (Hugging Face folder); {tokenizer}")
            return 0
        used = export(source, Path(args.out), args.model_spec)
    except CheckpointError as e:
        print(f"pipezero: error: {e}", file=sys.stderr)
        return 1
    print(f"exported {used} to {Path(args.out) / 'model.safetensors'}")
    return 0


def add_cluster_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("cluster", allow_abbrev=False, help="run pipezero on an emulated multi-node cluster (root)",
                       description="Nodes as network namespaces joined by links shaped with tc tbf; each node "
                                   "starts its ranks with torchrun. Example: pipezero cluster --nodes 2 "
                                   "--ranks-per-node 2 --link 200mbit train --pp 2 --dp 2 --zero 2")
    c.add_argument("--nodes", type=int, required=True, help="emulated nodes")
    c.add_argument("--ranks-per-node", type=int, default=1, help="ranks (torchrun --nproc-per-node) a node")
    c.add_argument("--link", default="200mbit", help="each node's link rate, tc units (kbit, mbit, gbit), e.g. 200mbit")
    c.add_argument("--pin", action="store_true", help="give each node its own share of this host's cores, as "
                                                      "separate machines have (needs a core a node)")
    c.add_argument("command", nargs=argparse.REMAINDER,
                   help="the `train` command every node runs; its pp x dp must be --nodes x --ranks-per-node "
                        "(checked, with its data, before the cluster is built)")
    c.set_defaults(func=cmd_cluster)


def cmd_cluster(args: argparse.Namespace) -> int:
    from pipezero.cluster import ClusterSpec, require_root, run_on_cluster
    from pipezero.launch import preflight

    if not args.command:
        raise ConfigError("pipezero cluster needs a command to run, e.g. `train --pp 2 --dp 2`")
    if args.ranks_per_node < 1:
        raise ConfigError(f"--ranks-per-node {args.ranks_per_node}: at least 1")
    spec = ClusterSpec(args.nodes, args.link, pin=args.pin)
    cfg, force = cluster_job(args.command, args.nodes * args.ranks_per_node, f"--nodes {args.nodes} x --ranks-per-node "
                      f"{args.ranks_per_node}")
    require_root()
    from pipezero.rundir import refuse_folder

    refuse_folder(cfg.run.out, cfg.run.resume, force)  # as node 0's rank 0 would: one line, not every node's report
    check_out(cfg)
    # data, tokenizer, vocabulary, the split over nodes: once, not on every rank
    preflight(cfg, args.nodes * args.ranks_per_node, args.ranks_per_node)
    from pipezero.runtime.watch import relaying_requests

    with relaying_requests(cfg.run.out):  # node 0's rank 0 prints the report
        return run_on_cluster(spec, args.ranks_per_node, args.command)


def cluster_job(argv: Sequence[str], world: int, shape: str) -> tuple[Any, bool]:
    """The run every node's ranks would start (its config, and whether it has --force), checked
    here as `train` checks it, before the cluster is built: a bad command caught on the nodes would
    end in every rank's torchrun report instead of one line."""
    from pipezero.settings import build_config, build_launch

    parser = build_parser()
    commands = next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if argv[0] in commands and argv[0] != "train":
        raise ConfigError(f"pipezero cluster runs `train` on every node, not `{argv[0]}`: e.g. pipezero cluster "
                          f"--nodes 2 train --dp 2")
    inner = parser.parse_args(list(argv))  # a mistake in it: one line here, not every node's
    settings, launch, names = flag_values(inner)
    if build_launch(launch, names).nproc is not None:
        raise ConfigError("--nproc: the cluster starts --ranks-per-node ranks a node; drop --nproc")
    cfg = build_config(inner.config, settings, names)
    if cfg.parallel.world_size != world:
        raise ConfigError(f"train's pp x dp = {cfg.parallel.world_size} but the cluster runs {shape} = {world} "
                          f"ranks; make them equal")
    return cfg, bool(inner.force)


def add_verify_parser(sub: argparse._SubParsersAction) -> None:
    """`verify` takes every `train` flag (the same parser's arguments) plus `--steps`."""
    v = sub.add_parser("verify", parents=[sub.choices["train"]], add_help=False,
                       help="check that a layout trains the same model as one process",
                       description="Run K steps of a layout and of one process (pp=1, dp=1) and compare losses, "
                                   "gradient norms and every rank's parameters, beside one process trained again "
                                   "with its batch cut another way (the rounding at this learning rate); exit 0 "
                                   "within tolerance, else 1. See docs/how-to/verify.md.")
    v.add_argument("--steps", type=int, default=3, help="optimizer steps to compare (default 3, at most 1000)")
    v.set_defaults(func=cmd_verify)


# train's settings verify decides itself (verify.layout_config) or has no use for: given, they would
# be ignored without a word
VERIFY_SETS = ("run.max_steps", "run.resume", "run.checkpoint_every", "run.keep_checkpoints", "run.save_final",
               "run.eval_every", "run.sample_tokens", "launch.max_restarts")


def cmd_verify(args: argparse.Namespace) -> int:
    from pipezero.coerce import coerce
    from pipezero.launch import under_torchrun
    from pipezero.settings import build_config, build_launch
    from pipezero.sim.fit import rank_limit_gib
    from pipezero.sim.limits import VERIFY_STEPS
    from pipezero.verify import verify_layout

    coerce("--steps", int, args.steps, False, VERIFY_STEPS)  # 10^11 trained three runs for ever
    settings, launch_values, names = flag_values(args)
    ignored = [names[k] for k in (*settings, *launch_values) if k in VERIFY_SETS] + (["--force"] if args.force else [])
    if ignored:
        raise ConfigError(f"pipezero verify runs --steps steps of the layout and of one process, fresh, in --out, "
                          f"without checkpoints; it takes no {ignored[0]}: drop it")
    cfg = build_config(args.config, settings, names)
    launch = build_launch(launch_values, names)
    if launch.nproc is not None and launch.nproc != cfg.parallel.world_size:  # was ignored: one process trained
        raise ConfigError(f"--nproc {launch.nproc} but pp x dp = {cfg.parallel.world_size}; make them equal (verify "
                          f"starts the layout's pp x dp ranks)")
    out = Path(cfg.run.out)
    if not cfg.run.out.strip() or (out.exists() and not out.is_dir()):  # else every rank's mkdir fails
        raise ConfigError(f"--out {cfg.run.out!r} is {'empty' if not cfg.run.out.strip() else 'a file'}: name a folder "
                          f"for verify's runs")
    _, cuda = rank_limit_gib(cfg, launch.nproc or cfg.parallel.world_size)  # verify starts the layout's ranks
    if not under_torchrun():
        check_host_memory(cfg, cuda)  # --preset 7b: minutes of building before the kernel killed it
    return verify_layout(cfg, args.steps, launch.nproc, args.argv)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pipezero", allow_abbrev=False, description="Pipeline parallelism + ZeRO training. "
                           "How it works: docs/ARCHITECTURE.md in the repository.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_verify_parser(sub)
    add_export_parser(sub)
    add_cluster_parser(sub)
    from pipezero.sim.commands import add_simulate_parser
    from pipezero.sim.plan_command import add_plan_parser

    add_simulate_parser(sub)
    add_plan_parser(sub)
    from pipezero.doctor import add_doctor_parser

    add_doctor_parser(sub)
    add_probe_parser(sub)
    return parser


def add_probe_parser(sub: argparse._SubParsersAction) -> None:
    from pipezero.probe_command import READS, cmd_probe, describe

    p = sub.add_parser("probe", allow_abbrev=False, help="measure this machine's compute and host costs",
                       description="Time one decoder block's forward, input and weight gradient at the run's "
                                   "micro-batch (the FLOP rate a rank achieves and what an action costs beyond "
                                   "its FLOPs), a copy to host memory and back, and AdamW on the host; print them "
                                   "and write them as JSON for `pipezero plan --costs`.")
    add_train_flags(p, READS)
    describe(p)
    p.set_defaults(func=lambda args: cmd_probe(args, *flag_values(args)[::2]))


class OutputFailed(Exception):
    """Standard output could not take what a command printed (a full disk, a closed pipe). Not an
    OSError: a command's own handlers of its file writes (a checkpoint on a full disk) never take
    it for theirs, and no OSError of those is taken for this."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


class GuardedOutput:
    """A stream (sys.stdout) whose failed writes and flushes raise OutputFailed; anything else is
    the stream's own."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise OutputFailed(e) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise OutputFailed(e) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


# commands whose result is what they print: with standard output closed, it would go nowhere, exit 0
PRINTS_ITS_RESULT = ("plan", "simulate", "doctor")
TRAINS = ("train", "verify")  # commands whose processes are ranks (or start them): SIGUSR1 is asked of them


def output_failed(e: OutputFailed, stream: Any) -> int:
    """A broken pipe (`pipezero plan | head`) ends quietly with the shell's status for SIGPIPE;
    any other failure is one line. Standard output is pointed at /dev/null, so the interpreter's
    own flush at exit finds nothing to fail on."""
    import errno

    if stream is sys.__stdout__:
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        except (OSError, ValueError):
            pass
    from pipezero.launch import under_torchrun

    if under_torchrun():
        os._exit(2)  # a rank: peers may be gone, no teardown collective
    if e.error.errno == errno.EPIPE:
        return 128 + 13  # as if killed by SIGPIPE, as `yes | head` is
    print(f"pipezero: error: cannot write to standard output ({e}): free space where it goes, or redirect it "
          f"elsewhere", file=sys.stderr)
    return 2


NEGATIVE = re.compile(r"-\.?[0-9]")  # a value that starts as a negative number does: -1, -0.5, -1:1:1


def negative_values(argv: Sequence[str]) -> list[str]:
    """`--flag -1,2` as `--flag=-1,2`: argparse reads a value starting with '-' that is not a plain
    number (`--cost -1:1:1`) as the next option and answered "expected one argument", which hides
    the mistake; given to the flag, its own check names it."""
    out: list[str] = []
    for arg in argv:
        prev = out[-1] if out else ""
        if NEGATIVE.match(arg) and prev.startswith("--") and "=" not in prev and prev != "--":
            out[-1] = f"{prev}={arg}"
        else:
            out.append(arg)
    return out


INTERRUPTED = "pipezero: interrupted; checkpoints are committed atomically, so --resume continues from the newest complete one"


def main(argv: Sequence[str] | None = None) -> int:
    from pipezero.lifeline import die_with_parent

    die_with_parent()  # a rank of pipezero's launcher: never outlive its torchrun agent
    try:
        parser = build_parser()  # imports torch: a second or more, the likeliest place for an early Ctrl-C
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    argv = negative_values(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    stream = sys.stdout
    if stream is None and args.command in PRINTS_ITS_RESULT:
        print(f"pipezero: error: standard output is closed, and pipezero {args.command} prints its result there: "
              f"redirect it to a file (> result.txt) or /dev/null", file=sys.stderr)
        return 2
    if stream is not None:
        sys.stdout = GuardedOutput(stream)  # type: ignore[assignment]
    from pipezero.runtime.watch import early_requests

    try:
        with early_requests(args.command in TRAINS):
            code = int(args.func(args) or 0)
        if sys.stdout is not None:  # closed (>&-): fine for a command that prints nothing it needs
            sys.stdout.flush()  # a full disk under the output shows here, not at the interpreter's exit
        return code
    except OutputFailed as e:
        return output_failed(e, stream)
    except ConfigError as e:
        print(f"pipezero: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        import errno

        from pipezero.util import refused_write

        if (refused := refused_write(e)) is not None:  # a full disk, a read-only or immutable file or folder
            print(f"pipezero: error: {refused}", file=sys.stderr)
            return 1
        if e.errno != errno.ENAMETOOLONG:  # any other is no input of the user's: its traceback
            raise
        name = str(e.filename or "")
        shown = name if len(name) <= 80 else f"{name[:40]}...{name[-20:]} ({len(name)} characters)"
        print(f"pipezero: error: the path {shown!r} is too long for this filesystem (File name too long): a name "
              f"holds at most {os.pathconf('/', 'PC_NAME_MAX')} bytes; give a shorter one", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C in a lone process (a --nproc launcher stops its job in job.py)
        print(INTERRUPTED, file=sys.stderr)
        return 130
    finally:
        if stream is not None:
            sys.stdout = stream


if __name__ == "__main__":
    sys.exit(main())
