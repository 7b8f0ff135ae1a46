"""`pipezero plan`: the planner (planner/search.py) from the command line: the model, the cluster as
flags, the fitting layouts as a table or JSON."""

from __future__ import annotations

import argparse
import json
import math
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from pipezero.coerce import Range
from pipezero.config import ParallelConfig, Zero3Unit
from pipezero.errors import ConfigError
from pipezero.settings import NON_NEGATIVE, POSITIVE, POSITIVE_INT, RANGES
from pipezero.schedules import limits
from pipezero.cli.simulate import check_ranges
from pipezero.memory.fit import flags
from pipezero.planner.layouts import Cluster
from pipezero.memory.offload import CPU_ADAMW_PARAMS_S, PCIE_GBPS

if TYPE_CHECKING:
    from pipezero.planner.search import Estimate
    from pipezero.planner.prefetch import Choice


BANDWIDTH = "300,25"  # --bandwidth's default: intra,inter-node GB/s a GPU

def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("plan", help="choose a pp x dp x ZeRO x schedule layout for a cluster",
                       description="Enumerate layouts, drop those that do not fit, estimate and rank the rest. "
                                   "A request answers within seconds: it simulates at most "
                                   f"{limits.PLAN_BUDGET} schedule actions, the layouts of fewest micro-batches first, "
                                   "and says how many layouts it left unsimulated (lower --global-batch to weigh "
                                   "them).")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", help="model preset (tiny ... 70b)")
    what.add_argument("--params", type=float, help=f"model size in parameters, e.g. 13e9 ({limits.PARAMS.describe()})")
    s.add_argument("--gpus", type=int, help=f"GPUs in all (or --nodes x --gpus-per-node; {limits.GPUS.describe()})")
    s.add_argument("--gpu-memory", type=float, required=True, help=f"GiB per GPU, e.g. 80 ({limits.GPU_MEMORY_GIB.describe()})")
    s.add_argument("--host-memory", type=float, default=0.0,
                   help="GiB of host memory a node: where a layout does not fit the GPUs, the planner tries it with "
                        "--offload optimizer, which keeps 16 bytes an updated parameter there (default 0: none "
                        f"offered; {limits.HOST_MEMORY_GIB.describe()})")
    s.add_argument("--pcie-gbps", type=float, default=PCIE_GBPS,
                   help=f"GB/s a GPU's host link carries each way, for offload's copies (default {PCIE_GBPS:g}: "
                        f"PCIe 4.0 x16; {limits.GBPS.describe()})")
    s.add_argument("--cpu-adamw", type=float, default=CPU_ADAMW_PARAMS_S,
                   help=f"parameters a second a rank's share of its node's CPU steps AdamW, for offload (default "
                        f"{CPU_ADAMW_PARAMS_S:.3g}: bench/cpu_adamw.py's ShardedAdamW on one core; "
                        f"{limits.PARAMS_S.describe()})")
    s.add_argument("--nodes", type=int, help="nodes of --gpus-per-node GPUs each")
    s.add_argument("--node-size", "--gpus-per-node", dest="node_size", type=int, default=8,
                   help=f"GPUs a node ({limits.GPUS.describe()})")
    s.add_argument("--bandwidth", default=BANDWIDTH, help=f"intra,inter-node GB/s per GPU (each, as --intra-bw and --inter-bw, "
                                                         f"{limits.GBPS.describe()})")
    s.add_argument("--intra-bw", type=float, help="GB/s per GPU inside a node (overrides --bandwidth's first)")
    s.add_argument("--inter-bw", type=float, help="GB/s of a node's link to the others, shared by its GPUs "
                                                  "(overrides --bandwidth's second, which is per GPU)")
    s.add_argument("--wire-bytes", type=int, choices=(2, 4),
                   help="bytes an element on the wire: 2 (bf16 runs; the default with --device cuda) or 4 "
                        "(fp32 runs; the default with --device cpu, where train runs fp32)")
    s.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: ranks on gloo, reduce-scatters as direct exchanges of slices, "
                        "a node's ranks sharing one link; --hierarchical becomes a candidate")
    s.add_argument("--bucket-mb", type=float, default=25.0,
                   help="the run's gradient bucket (train --bucket-mb): collectives hide behind compute a bucket at a time")
    q = s.add_argument_group("quantized traffic (as train's flags; zero/quantize.py)")
    q.add_argument("--quantize-weights", choices=("none", "int8"), default="none",
                   help="price ZeRO-1/2/3's parameter gathers as int8 with a scale a block")
    q.add_argument("--quantize-grads", choices=("none", "int8", "int4"), default="none",
                   help="price gradient reductions quantized (an exchange, summed in fp32)")
    q.add_argument("--quant-block", type=int, default=None, help="elements a scale (default 256; only with a "
                   "--quantize-* flag)")
    q.add_argument("--compress", choices=("none", "auto"), default="none",
                   help="auto: price every layout also with int8 weight gathers and gradient reductions (and "
                        "--secondary-shard node where it applies), and propose them where they make its step at "
                        "least 5%% faster (int4 is not proposed: it costs held-out loss)")
    q.add_argument("--secondary-shard", choices=("none", "node"), default="none",
                   help="ZeRO-3 layer by layer keeps a node's copy split over its ranks (memory 4/N bytes a "
                        "parameter), its later gathers inside the node")
    c = s.add_argument_group("compute (defaults: an H100's dense bf16 peak at 45% of it)")
    c.add_argument("--tflops", type=float, default=989.0, help=f"dense peak TFLOP/s of one GPU at the run's dtype "
                                                                     f"({limits.TFLOPS.describe()})")
    c.add_argument("--mfu", type=float, default=0.45, help="share of that peak one stage's compute reaches")
    c.add_argument("--overhead-ms", type=float, default=0.0,
                   help="fixed milliseconds every forward, backward or half of one costs beyond its FLOPs "
                        f"({limits.OVERHEAD_MS.describe()})")
    c.add_argument("--costs", metavar="FILE",
                   help="a probe of this machine (pipezero probe --json FILE): its achieved FLOP rate, an "
                        "action's fixed cost, host copy rate and AdamW on the host replace --tflops, --mfu, "
                        "--overhead-ms, --pcie-gbps and --cpu-adamw")
    h = s.add_argument_group("ranks sharing one host (an emulated cluster)")
    h.add_argument("--cores", type=int, default=0, help="CPU cores every rank shares (0: a device a rank)")
    h.add_argument("--net-cpu", type=float, default=0.0,
                   help="host CPU-seconds a GB crossing a node's link costs those cores (bench/link_probe.py; "
                        f"{limits.NET_CPU.describe()})")
    s.add_argument("--global-batch", type=int, default=1024, help=f"sequences per step ({limits.GLOBAL_BATCH.describe()})")
    s.add_argument("--seq-len", type=int, default=None,
                   help="tokens a sequence (default: the model's longest, at most 4096)")
    s.add_argument("--top", type=int, default=10, help="layouts to show, fastest first")
    s.add_argument("--json", action="store_true", help="print the layouts as JSON instead of a table")
    s.set_defaults(func=lambda args: cmd_plan(args))  # looked up when run: the parser is built once


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The planner's cluster from `--gpus` or `--nodes`, and the two link classes: `--bandwidth`
    (per GPU) or `--intra-bw` / `--inter-bw` (the inter-node link is a node's, shared by its GPUs)."""
    if args.nodes is not None and args.gpus is not None and args.gpus != args.nodes * args.node_size:
        raise ConfigError(f"--gpus {args.gpus} is not --nodes {args.nodes} x --gpus-per-node {args.node_size}")
    if args.nodes is None and args.gpus is None:
        raise ConfigError("say how many GPUs: --gpus N, or --nodes K --gpus-per-node N")
    gpus = args.gpus if args.gpus is not None else args.nodes * args.node_size
    if gpus > args.node_size and gpus % args.node_size:  # links are priced by node: a part-filled one is no cluster's
        raise ConfigError(f"--gpus {gpus} is not a whole number of nodes of --gpus-per-node {args.node_size} "
                          f"({gpus // args.node_size} nodes and {gpus % args.node_size} GPUs of another): give a "
                          f"multiple of {args.node_size}, or the --gpus-per-node your nodes have")
    if args.secondary_shard == "node" and gpus <= args.node_size:
        raise ConfigError(f"--secondary-shard node is read only across nodes (weights sharded within a node, "
                          f"replicated between nodes); --gpus {gpus} is one node of --gpus-per-node "
                          f"{args.node_size}: drop it, or plan more nodes")
    if gpus not in limits.GPUS:
        raise ConfigError(f"--nodes {args.nodes} x --gpus-per-node {args.node_size} = {gpus} GPUs; the limit is "
                          f"{limits.GPUS.high:.0f}: fewer --nodes or --gpus-per-node")
    try:
        intra, inter = (float(x) for x in args.bandwidth.split(","))
    except ValueError:
        raise ConfigError(f"--bandwidth wants intra,inter GB/s like 300,25, got {args.bandwidth!r}") from None
    if not all(math.isfinite(x) and x in limits.GBPS for x in (intra, inter)):
        raise ConfigError(f"--bandwidth {args.bandwidth}: expected two numbers > 0 (from {limits.GBPS.low:g} to "
                          f"{limits.GBPS.high:g}: intra,inter-node GB/s)")
    if args.intra_bw is not None and args.inter_bw is not None and args.bandwidth != BANDWIDTH:  # neither part read
        raise ConfigError(f"--bandwidth {args.bandwidth} is overridden by --intra-bw and --inter-bw: drop one of them")
    between = (("--inter-bw", args.inter_bw, "the link between nodes"),
               ("--net-cpu", args.net_cpu or None, "the host CPU work of bytes crossing between nodes"))
    for flag, value, what in between:
        if value is not None and gpus <= args.node_size:  # nothing crosses: every plan is the same without it
            raise ConfigError(f"{flag} {value:g} prices {what}; --gpus {gpus} is one node of --gpus-per-node "
                              f"{args.node_size}: drop it, or plan more nodes")
    intra = args.intra_bw if args.intra_bw is not None else intra
    inter = args.inter_bw / args.node_size if args.inter_bw is not None else inter
    wire = args.wire_bytes or (4 if args.device == "cpu" else 2)
    return Cluster(gpus, args.gpu_memory, args.node_size, intra, inter, tflops=args.tflops, mfu=args.mfu,
                   wire_bytes=wire, overhead_s=args.overhead_ms / 1e3, cpu=args.device == "cpu",
                   cores=args.cores, net_cpu_s_per_gb=args.net_cpu, bucket_mb=args.bucket_mb,
                   host_memory_gib=args.host_memory, pcie_gbps=args.pcie_gbps, adamw_params_s=args.cpu_adamw)


def measured(cluster: Cluster, args: argparse.Namespace) -> Cluster:
    """`cluster` with the figures a probe measured (pipezero/probe.py) in place of the presets'. A
    preset flag given beside it would be read by nothing: refused."""
    from dataclasses import replace

    from pipezero.probe import read_probe

    given = [f for f, v, default in (("--tflops", args.tflops, 989.0), ("--mfu", args.mfu, 0.45),
                                     ("--overhead-ms", args.overhead_ms, 0.0), ("--pcie-gbps", args.pcie_gbps, PCIE_GBPS),
                                     ("--cpu-adamw", args.cpu_adamw, CPU_ADAMW_PARAMS_S)) if v != default]
    if given:
        raise ConfigError(f"--costs {args.costs} measured what {', '.join(given)} would say: drop one of them")
    found = read_probe(args.costs)
    if (found.device == "cpu") != (args.device == "cpu"):  # a CPU rank's rates are not a GPU's
        where = ("the GPU (pipezero probe --device cuda" if args.device == "cuda" else
                 "CPU ranks (pipezero probe --device cpu")
        raise ConfigError(f"--costs {args.costs} was measured on {found.device}, and plan prices --device "
                          f"{args.device}: probe on {where} --json FILE), or plan --device "
                          f"{'cpu' if found.device == 'cpu' else 'cuda'}")
    return replace(cluster, tflops=found.tflops, mfu=1.0, overhead_s=found.overhead_s,
                   pcie_gbps=found.host_copy_gbps or cluster.pcie_gbps,
                   adamw_params_s=found.host_adamw_params_s or cluster.adamw_params_s)


def parameters(n: int) -> str:
    """A parameter count as a person reads it: 1.48M, 6.74B (a tiny model is not "0.0B")."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def unit_words(c: Choice) -> str:
    """What a prefetch depth counts, as `plan` says it (and the flag that asks for parts)."""
    return "layers" if c.unit is Zero3Unit.LAYER else "units, --zero3-unit sublayer"


def host_missing(e: "Estimate", cluster: Cluster) -> str:
    """What the hosts lack where an offloaded layout fits the GPUs but not `--host-memory`."""
    need = e.host_gib / cluster.headroom  # the planner admits its headroom's share of a node's memory
    given = (f"--host-memory {cluster.host_memory_gib:g} GiB a node holds less" if cluster.host_memory_gib else
             "no --host-memory was given")
    return (f"{flags(e.layout)} fits the GPUs ({e.memory_gib:.1f} GiB a GPU) but its ranks "
            f"keep {e.host_gib:.1f} GiB in a node's host memory (16 bytes an updated parameter: fp32 master, AdamW "
            f"moments, gradient staging), and {given}: plan with --host-memory {math.ceil(need)} or more")


def device_missing(e: "Estimate", cluster: Cluster) -> str:
    """What the GPUs lack where no layout fits them, even with the optimizer offloaded."""
    limit = cluster.gpu_memory_gib * cluster.headroom
    return (f"even with --offload optimizer (AdamW's moments off the GPU) the nearest, {flags(e.layout)}, needs "
            f"{e.memory_gib:.1f} GiB a GPU ({e.model_states_gib:.1f} of fp32 weights and gradients, "
            f"{e.activations_gib:.1f} of activations and buffers) where {limit:.1f} is usable: add GPUs or GPU memory, "
            f"or lower --seq-len")


def cmd_plan(args: argparse.Namespace) -> int:
    import time

    from pipezero.config import ModelConfig
    from pipezero.models import apply_preset, param_count
    from pipezero.planner.search import model_from_params, nearby_world_sizes, plan_within, reason
    from pipezero.planner.prefetch import plan_choice

    check_ranges(args, {"params": (float, limits.PARAMS), "gpus": (int, limits.GPUS),
                        "gpu_memory": (float, limits.GPU_MEMORY_GIB), "node_size": (int, limits.GPUS),
                        "global_batch": (int, limits.GLOBAL_BATCH), "nodes": (int, limits.GPUS),
                        "seq_len": (int, POSITIVE_INT), "top": (int, POSITIVE_INT), "intra_bw": (float, limits.GBPS),
                        "inter_bw": (float, limits.GBPS), "bucket_mb": (float, POSITIVE),
                        "tflops": (float, limits.TFLOPS), "mfu": (float, Range(0, 1, open_low=True)),
                        "overhead_ms": (float, limits.OVERHEAD_MS), "cores": (int, NON_NEGATIVE),
                        "net_cpu": (float, limits.NET_CPU), "quant_block": (int, RANGES["parallel.quant_block"]),
                        "host_memory": (float, limits.HOST_MEMORY_GIB), "pcie_gbps": (float, limits.GBPS),
                        "cpu_adamw": (float, limits.PARAMS_S)})
    if args.quant_block is not None and args.quantize_weights == args.quantize_grads == args.compress == "none":
        raise ConfigError(f"--quant-block {args.quant_block} prices quantized traffic: add --quantize-weights, "
                          f"--quantize-grads or --compress auto, or drop it")
    if args.host_memory and args.device == "cpu":  # CPU ranks' device is the host: nothing to offload to it
        raise ConfigError(f"--host-memory {args.host_memory:g} prices --offload optimizer, which plan does not "
                          f"propose for --device cpu (its ranks' device is the host already): drop it")
    for flag, value, default in (("--pcie-gbps", args.pcie_gbps, PCIE_GBPS), ("--cpu-adamw", args.cpu_adamw,
                                                                                CPU_ADAMW_PARAMS_S)):
        if value != default and (not args.host_memory or args.device == "cpu"):  # nothing would price the host
            raise ConfigError(f"{flag} {value:g} prices --offload optimizer, which plan offers only with --host-memory "
                              f"(GiB a node, GPUs only): add it, or drop {flag}")
    model = apply_preset(ModelConfig(), args.preset) if args.preset else model_from_params(args.params)
    seq_len = args.seq_len or min(4096, model.max_seq_len)
    if seq_len > model.max_seq_len:  # train refuses it: a plan for it would be a layout nobody can run
        raise ConfigError(f"--seq-len {seq_len} is longer than the model's max_seq_len {model.max_seq_len} "
                          f"(train refuses it): plan with --seq-len {model.max_seq_len} or less")
    cluster = cluster_from_args(args)
    if (tokens := args.global_batch * seq_len) > limits.BATCH_TOKENS:  # train refuses every layout of it, not memory
        raise ConfigError(f"--global-batch {args.global_batch} x --seq-len {seq_len} = {tokens} tokens a step; train's "
                          f"limit is {limits.BATCH_TOKENS} (every rank holds the step's batch in memory): lower "
                          f"--global-batch or --seq-len")
    if args.costs is not None:
        cluster = measured(cluster, args)
    floor = 4 * param_count(model) / cluster.gpus / 2**30  # fp32 master weights, spread over every GPU at best
    if floor > args.gpu_memory:  # every layout was simulated first to say so: minutes (7b on 8 x 0.001 GiB)
        raise ConfigError(f"no layout fits {parameters(param_count(model))} parameters in {cluster.gpus} x "
                          f"{args.gpu_memory:g} GiB: their fp32 weights alone, spread over every GPU, take "
                          f"{floor:.3g} GiB a GPU; add GPUs or memory")
    given = [f for f, v in (("--quantize-weights", args.quantize_weights), ("--quantize-grads", args.quantize_grads),
                            ("--secondary-shard", args.secondary_shard)) if v != "none"]
    if args.compress == "auto" and given:
        raise ConfigError(f"--compress auto chooses the options itself, {' and '.join(given)} names them: give one "
                          f"or the other")
    t0 = time.perf_counter()
    bits = {"none": 0, "int8": 8, "int4": 4}
    result = plan_within(model, cluster, seq_len, args.global_batch, bits[args.quantize_weights],
                         bits[args.quantize_grads], args.quant_block or ParallelConfig.quant_block, args.secondary_shard == "node",
                         propose=args.compress == "auto", offload=True)
    fits, considered, skipped = result.fits, result.considered, result.skipped
    took = time.perf_counter() - t0
    if not considered and skipped:
        raise ConfigError(f"every layout of {cluster.gpus} GPUs at --global-batch {args.global_batch} runs more "
                          f"micro-batches a rank than the planner simulates within its time budget "
                          f"({limits.PLAN_BUDGET} actions): lower --global-batch")
    if not considered:  # no pp x dp split of the GPUs at all: more GPUs would not be the fix
        nearby = nearby_world_sizes(model.n_layers, args.global_batch, cluster.gpus)
        raise ConfigError(f"{cluster.gpus} GPUs split into no layout: pp x dp must equal --gpus with pp <= "
                          f"{model.n_layers} layers and dp dividing --global-batch {args.global_batch}; "
                          f"choose {'--gpus ' + nearby + ' or ' if nearby else ''}another --global-batch")
    if not fits:
        raise ConfigError(f"no layout of {considered} fits {parameters(param_count(model))} parameters in "
                          f"{cluster.gpus} x {args.gpu_memory:g} GiB; "
                          + (host_missing(result.host_short[0], cluster) if result.host_short else
                             device_missing(result.device_short, cluster) if result.device_short else
                             "add GPUs or memory, or lower --global-batch"))
    best = fits[0]
    limit = cluster.gpu_memory_gib * cluster.headroom
    depths = {id(e): plan_choice(model, seq_len, cluster, e.layout, (limit - e.memory_gib) * 2**30)
              for e in fits[: args.top]}  # ZeRO-3 layer by layer: the prefetch depth (planner/prefetch.py)
    rows = [{"pp": e.layout.pp, "dp": e.layout.dp, "zero": e.layout.zero, "schedule": e.layout.schedule.value,
             "virtual_stages": e.layout.virtual, "micro_batch_size": e.layout.micro_batch,
             "microbatches": e.layout.microbatches, "recompute": e.layout.recompute,
             "grad_reduce": e.layout.grad_reduce.value, "placement": e.layout.placement.value,
             "hierarchical": e.layout.hierarchical, "partition": e.layout.partition.value,
             "quantize_weights_bits": e.layout.weight_bits,
             "quantize_grads_bits": e.layout.grad_bits, "secondary_shard": e.layout.secondary,
             "node_link_bytes": e.crossing_bytes,
             "memory_gib": round(e.memory_gib, 2), "model_states_gib": round(e.model_states_gib, 2),
             "activations_gib": round(e.activations_gib, 2), "step_time_s": e.step_time_s,
             "tokens_per_s": e.tokens_per_s, "bubble": e.bubble,
             "zero3_prefetch": (c := depths[id(e)]) and c.depth, "zero3_prefetch_why": c and c.why,
             "zero3_unit": c and c.unit.value,
             "offload": "optimizer" if e.layout.offload else "none", "host_gib_per_node": round(e.host_gib, 2),
             "offload_s": e.offload_s,
             "why": reason(best, e, cluster) + (f", ZeRO-3 prefetch {c.depth} {unit_words(c)}: {c.why}" if c else "")}
            for e in fits[: args.top]]
    if args.json:
        print(json.dumps({"params": param_count(model), "considered": considered, "skipped": skipped,
                          "fit": len(fits), "seconds": took, "layouts": rows}, indent=2))
        return 0
    off = sum(e.layout.offload for e in fits)
    table = Table(title=f"{parameters(param_count(model))} params on {cluster.gpus} x {args.gpu_memory:g} GiB: "
                        f"{len(fits)} of {considered} layouts fit"
                        f"{f' ({off} only with --offload optimizer)' if off else ''} ({took:.1f} s)",
                  caption=f"{skipped} layouts of many micro-batches not simulated (the planner's time budget): "
                          f"lower --global-batch to weigh them" if skipped else None)
    for col in ("pp", "dp", "zero", "schedule", "V", "mbs", "M", "rc", "grad", "place", "hier", "off", "GiB",
                "host GiB", "step s", "GB x-node", "why"):
        table.add_column(col, justify="left" if col in ("schedule", "why") else "right")
    for r in rows:
        table.add_row(str(r["pp"]), str(r["dp"]), str(r["zero"]), r["schedule"], str(r["virtual_stages"]),
                      str(r["micro_batch_size"]), str(r["microbatches"]), "y" if r["recompute"] else "",
                      "mb" if r["grad_reduce"] == "microbatch" else "", r["placement"], "y" if r["hierarchical"] else "",
                      "opt" if r["offload"] != "none" else "", f"{r['memory_gib']:.1f}",
                      f"{r['host_gib_per_node']:.1f}" if r["offload"] != "none" else "",
                      f"{r['step_time_s']:.2f}", f"{r['node_link_bytes'] / 1e9:.2f}",
                      r["why"])
    Console(width=160, emoji=False).print(table)
    return 0
