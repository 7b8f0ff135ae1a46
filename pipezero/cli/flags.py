"""The run settings every command that takes a run's settings reads from its command line: `train`'s
flags, declared once, and the parser that reports a bad command line in one line."""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import Any, NoReturn

from pipezero.schedules.registry import help_text as schedule_help
from pipezero.schedules.zero_rules import help_text as zero_help

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
    "--zero": ("parallel.zero", "ZeRO stage across a stage's data-parallel ranks: " + zero_help()),
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
    "--recompute": ("parallel.recompute", "activation checkpointing, one transformer block at a time"),
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

    parser.add_argument("--config", help="TOML file with [model] [parallel] [optim] [data] [run] tables (at most 1 MiB)")
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


def flag_values(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """The flags given, as (run settings, launcher settings, flag name of each setting)."""
    given = {key: getattr(args, key) for key, _ in TRAIN_FLAGS.values() if getattr(args, key, None) is not None}
    names = {key: flag for flag, (key, _) in TRAIN_FLAGS.items()}
    launch = {k: v for k, v in given.items() if k.startswith("launch.")}
    return {k: v for k, v in given.items() if k not in launch}, launch, names

