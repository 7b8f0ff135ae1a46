"""`pipezero simulate`: build a schedule, play it under a cost model, print, plot or compare."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from pipezero.coerce import Range, coerce
from pipezero.config import GradReduce, ScheduleKind
from pipezero.settings import NON_NEGATIVE, POSITIVE, POSITIVE_INT
from pipezero.errors import ConfigError
from pipezero.schedules.actions import Schedule
from pipezero.schedules.check import CostModel, simulate
from pipezero.schedules.registry import SCHEDULES, build_schedule, default_virtual, help_text

if TYPE_CHECKING:
    from pipezero.sim.layouts import Cluster


def check_ranges(args: argparse.Namespace, limits: dict[str, tuple[type, Range]]) -> None:
    """Refuse a flag value out of its range in one line, the way `train` does (settings.coerce_setting)."""
    for dest, (kind, accepted) in limits.items():
        if getattr(args, dest, None) is not None:
            coerce(f"--{dest.replace('_', '-')}", kind, getattr(args, dest), False, accepted)


def parse_cost(text: str) -> tuple[float, float, float]:
    try:
        f, b, w = (float(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--cost wants F:B:W like 1:1:1, got {text!r}") from None
    if min(f, b, w) <= 0:
        raise ConfigError("--cost entries must be positive")
    return f, b, w


def each_schedule(args: argparse.Namespace, skipped: dict[str, str]) -> Iterator[Schedule]:
    """The schedule asked for, or with --compare every schedule at the asked P and M; a schedule
    that cannot run there is one line in `skipped` under --compare, else the error."""
    for kind in list(SCHEDULES) if args.compare else [ScheduleKind(args.schedule)]:
        try:
            yield build_schedule(kind, args.pp, args.microbatches,
                                 default_virtual(kind, None if args.compare else args.virtual_stages))
        except ValueError as e:
            if not args.compare:
                raise ConfigError(str(e)) from None
            skipped[kind.value] = str(e)


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("simulate", help="play a pipeline schedule under a cost model")
    s.add_argument("--schedule", choices=[k.value for k in SCHEDULES], default="1f1b", help=help_text())
    s.add_argument("--pp", type=int, default=4)
    s.add_argument("--microbatches", type=int, default=8)
    s.add_argument("--virtual-stages", type=int, default=None, help="default: 2 for schedules that need V>1")
    s.add_argument("--cost", default="1:1:1", help="relative F:B:W cost of one stage")
    s.add_argument("--comm", type=float, default=0.0, help="time of one hop between ranks, in F units")
    s.add_argument("--json", action="store_true")
    s.add_argument("--png", help="draw the timeline to this file")
    s.add_argument("--compare", action="store_true", help="every schedule side by side")
    s.add_argument("--from-trace", help="fit the cost model to a run's trace.json and compare")
    z = s.add_argument_group("ZeRO traffic (the lowered program: gathers, reductions and the optimizer step)")
    z.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                   help="lower the schedule with this ZeRO stage's collectives and time them too")
    z.add_argument("--dp", type=int, default=1, help="data-parallel ranks a stage (with --zero)")
    z.add_argument("--grad-reduce", choices=[g.value for g in GradReduce], default=GradReduce.STEP.value)
    z.add_argument("--preset", default="small", help="model preset that sizes the buckets (default small)")
    z.add_argument("--bucket-mb", type=float, default=25.0)
    z.add_argument("--dp-comm", type=float, default=0.5,
                   help="time, in F units, for one rank's link to carry one stage's parameters (0: free)")
    z.add_argument("--zero3-layerwise", action="store_true", help="ZeRO-3 layer by layer, not a chunk kept gathered")
    z.add_argument("--zero3-prefetch", action="store_true",
                   help="what if ZeRO-3 gathered each chunk one action ahead (the runtime gathers on demand)")
    z.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16 halves reductions and ZeRO-3 gathers")
    z.add_argument("--optim-cost", type=float, default=0.0, help="time of the optimizer update, in F units")
    z.add_argument("--listing", action="store_true", help="print every rank's lowered program")
    s.set_defaults(func=cmd_simulate)


def cmd_from_trace(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pipezero.sim.calibrate import calibrate, predict, what_if

    if not Path(args.from_trace).is_file():
        raise ConfigError(f"--from-trace {args.from_trace!r} does not exist (a run with --trace writes trace.json)")
    try:
        cal = calibrate(args.from_trace)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # empty, not JSON, not a trace
        raise ConfigError(f"--from-trace {args.from_trace!r} is not a pipezero trace.json ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else 'malformed'}); pass the trace.json of a run "
                          f"trained with --trace") from None
    lay = cal.layout
    step, bubble = predict(cal, ScheduleKind(lay["schedule"]), lay["microbatches"], lay["virtual_stages"])
    others = what_if(cal)
    if args.json:
        print(json.dumps({"layout": lay, "measured": {"step_time_s": cal.measured_step_s, "bubble": cal.measured_bubble},
                          "simulated": {"step_time_s": step, "bubble": bubble}, "hop_s": cal.hop_s,
                          "per_chunk_fbw_s": cal.per_chunk,
                          "what_if": {k: (v if isinstance(v, str) else {"step_time_s": v[0], "bubble": v[1]})
                                      for k, v in others.items()}}, indent=2))
        return 0
    console = Console(width=120, emoji=False)
    console.print(f"{lay['schedule']} P={lay['pp']} D={lay['dp']} M={lay['microbatches']} V={lay['virtual_stages']}, "
                  f"{cal.steps} steps; fitted hop {cal.hop_s * 1e3:.2f} ms; per chunk F/B/W ms: " +
                  ", ".join(f"{c}: {f * 1e3:.1f}/{b * 1e3:.1f}/{w * 1e3:.1f}" for c, (f, b, w) in cal.per_chunk.items()))
    table = Table(title="measured vs simulated on the fitted costs")
    for col in ("schedule", "step time s", "bubble"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    table.add_row(f"{lay['schedule']} (measured)", f"{cal.measured_step_s:.3f}", f"{cal.measured_bubble:.1%}")
    table.add_row(f"{lay['schedule']} (simulated)", f"{step:.3f}", f"{bubble:.1%}")
    for name, v in others.items():
        if name != lay["schedule"]:
            table.add_row(f"what if {name}", *(("-", v) if isinstance(v, str) else (f"{v[0]:.3f}", f"{v[1]:.1%}")))
    console.print(table)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.from_trace:
        return cmd_from_trace(args)
    check_ranges(args, {"pp": (int, POSITIVE_INT), "microbatches": (int, POSITIVE_INT),
                        "virtual_stages": (int, POSITIVE_INT), "comm": (float, NON_NEGATIVE)})
    f, b, w = parse_cost(args.cost)
    cost = CostModel(f, b, w, args.comm)
    if args.zero is not None:
        return cmd_simulate_zero(args, cost)
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for schedule in each_schedule(args, skipped):
        kind, v, res = ScheduleKind(schedule.name), schedule.virtual, simulate(schedule, cost)
        results[kind.value] = {"schedule": kind.value, "pp": args.pp, "microbatches": args.microbatches,
                               "virtual_stages": v, **res.to_json()}
        if args.png and not args.compare:
            from pipezero.telemetry.plot import draw_timeline

            bars = [(e.rank, e.action.op.value, e.action.mb, e.start, e.end) for e in res.timeline]
            draw_timeline(bars, args.pp, f"{kind.value}  P={args.pp} M={args.microbatches} V={v}  "
                          f"bubble {res.bubble:.1%}", args.png)
    if args.json:
        print(json.dumps(results if args.compare else next(iter(results.values())), indent=2))
        return 0
    table = Table(title=f"P={args.pp} M={args.microbatches} cost F:B:W={args.cost} comm={args.comm}")
    for col in ("schedule", "V", "step time", "bubble", "peak activations per rank"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for name, r in results.items():
        table.add_row(name, str(r["virtual_stages"]), f"{r['step_time']:.2f}", f"{r['bubble']:.1%}",
                      " ".join(str(x) for x in r["peak_activations"]))
    console = Console(width=120, emoji=False)
    console.print(table)
    for name, why in skipped.items():
        console.print(f"[dim]{name}: {why}[/dim]")
    return 0


def cmd_simulate_zero(args: argparse.Namespace, cost: CostModel) -> int:
    """Every chosen schedule lowered with ZeRO's collectives: step time and bubble without and with
    their traffic (sim/program_view.py)."""
    from pipezero.sim.program_view import ZeroOptions, draw, run_program

    check_ranges(args, {"dp": (int, POSITIVE_INT), "bucket_mb": (float, POSITIVE), "dp_comm": (float, NON_NEGATIVE),
                        "optim_cost": (float, NON_NEGATIVE)})
    opt = ZeroOptions.from_args(args)
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for schedule in each_schedule(args, skipped):
        kind, v = ScheduleKind(schedule.name), schedule.virtual
        prog, res, figures = run_program(schedule, cost, opt)
        results[kind.value] = {"schedule": kind.value, "pp": args.pp, "microbatches": args.microbatches,
                               "virtual_stages": v, **figures}
        if args.listing and not args.json:
            print("\n".join(f"{kind.value} rank {r} (pp {r // args.dp}, dp {r % args.dp}): {prog.listing(r)}"
                            for r in range(len(prog.ranks))))
        if args.png and not args.compare:
            draw(prog, res, f"{kind.value}  P={args.pp} D={args.dp} M={args.microbatches} V={v}  ZeRO-{args.zero} "
                 f"{args.grad_reduce}  bubble {figures['bubble_no_zero_traffic']:.1%} -> {res.bubble:.1%} with "
                 f"ZeRO traffic (dp replica 0)", args.png)
    if args.json:
        print(json.dumps(results if args.compare else next(iter(results.values())), indent=2))
        return 0
    table = Table(title=f"P={args.pp} D={args.dp} M={args.microbatches} ZeRO-{args.zero} grad-reduce "
                        f"{args.grad_reduce}, {args.preset}, cost F:B:W={args.cost} comm={args.comm} "
                        f"dp-comm={args.dp_comm}")
    for col in ("schedule", "V", "step", "step + ZeRO", "bubble", "bubble + ZeRO", "gathers", "reductions",
                "MB sent a rank"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for name, r in results.items():
        n = r["rank0_instructions"]
        table.add_row(name, str(r["virtual_stages"]), f"{r['step_time_no_zero_traffic']:.2f}",
                      f"{r['step_time']:.2f}", f"{r['bubble_no_zero_traffic']:.1%}", f"{r['bubble']:.1%}",
                      str(n["UNSHARD"]), str(n["REDUCE_GRAD"]), f"{max(r['bytes_sent']) / 2**20:.1f}")
    console = Console(width=140, emoji=False)
    console.print(table)
    console.print("[dim]gathers, reductions: rank 0's per step; the executor does not yet play this program "
                  "(schedules/program.py)[/dim]")
    for name, why in skipped.items():
        console.print(f"[dim]{name}: {why}[/dim]")
    return 0


def _nearby_gpus(layers: int, global_batch: int, gpus: int) -> str:
    """GPU counts near `gpus` that split into some pp x dp, for the error message."""
    def splits(n: int) -> bool:
        return any(n % pp == 0 and global_batch % (n // pp) == 0 for pp in range(1, min(n, layers) + 1))

    below = next((n for n in range(gpus - 1, 0, -1) if splits(n)), None)
    above = next(n for n in range(gpus + 1, 2 * gpus + global_batch + 2) if splits(n))
    return " or ".join(str(n) for n in (below, above) if n)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("plan", help="choose a pp x dp x ZeRO x schedule layout for a cluster")
    what = s.add_mutually_exclusive_group(required=True)
    what.add_argument("--preset", help="model preset (tiny ... 70b)")
    what.add_argument("--params", type=float, help="model size in parameters, e.g. 13e9")
    s.add_argument("--gpus", type=int, help="GPUs in all (or --nodes x --gpus-per-node)")
    s.add_argument("--gpu-memory", type=float, required=True, help="GiB per GPU")
    s.add_argument("--nodes", type=int, help="nodes of --gpus-per-node GPUs each")
    s.add_argument("--node-size", "--gpus-per-node", dest="node_size", type=int, default=8)
    s.add_argument("--bandwidth", default="300,25", help="intra,inter-node GB/s per GPU")
    s.add_argument("--intra-bw", type=float, help="GB/s per GPU inside a node (overrides --bandwidth's first)")
    s.add_argument("--inter-bw", type=float, help="GB/s of a node's link to the others, shared by its GPUs "
                                                  "(overrides --bandwidth's second, which is per GPU)")
    s.add_argument("--wire-bytes", type=int, default=2, choices=(2, 4), help="bytes an element on the wire: "
                                                                          "2 (bf16) or 4 (fp32 runs)")
    s.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: ranks on gloo, whose reduce-scatter sends an all-reduce's bytes and whose "
                        "nodes share one link; --hierarchical becomes a candidate")
    s.add_argument("--bucket-mb", type=float, default=25.0,
                   help="the run's gradient bucket (train --bucket-mb): collectives hide behind compute a bucket at a time")
    s.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    s.add_argument("--seq-len", type=int, default=4096)
    s.add_argument("--top", type=int, default=10)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_plan)


def cluster_from_args(args: argparse.Namespace) -> Cluster:
    """The planner's cluster from `--gpus` or `--nodes`, and the two link classes: `--bandwidth`
    (per GPU) or `--intra-bw` / `--inter-bw` (the inter-node link is a node's, shared by its GPUs)."""
    from pipezero.sim.layouts import Cluster

    if args.nodes is not None and args.gpus is not None and args.gpus != args.nodes * args.node_size:
        raise ConfigError(f"--gpus {args.gpus} is not --nodes {args.nodes} x --gpus-per-node {args.node_size}")
    if args.nodes is None and args.gpus is None:
        raise ConfigError("say how many GPUs: --gpus N, or --nodes K --gpus-per-node N")
    gpus = args.gpus if args.gpus is not None else args.nodes * args.node_size
    try:
        intra, inter = (float(x) for x in args.bandwidth.split(","))
    except ValueError:
        raise ConfigError(f"--bandwidth wants intra,inter GB/s like 300,25, got {args.bandwidth!r}") from None
    if not (intra > 0 and inter > 0 and math.isfinite(intra + inter)):
        raise ConfigError(f"--bandwidth {args.bandwidth}: expected two numbers > 0 (intra,inter-node GB/s)")
    intra = args.intra_bw if args.intra_bw is not None else intra
    inter = args.inter_bw / args.node_size if args.inter_bw is not None else inter
    return Cluster(gpus, args.gpu_memory, args.node_size, intra, inter, wire_bytes=args.wire_bytes,
                   cpu=args.device == "cpu", bucket_mb=args.bucket_mb)


def cmd_plan(args: argparse.Namespace) -> int:
    import time

    from pipezero.config import ModelConfig
    from pipezero.models import apply_preset, param_count
    from pipezero.sim.planner import model_from_params, plan, reason

    check_ranges(args, {"params": (float, POSITIVE), "gpus": (int, POSITIVE_INT), "gpu_memory": (float, POSITIVE),
                        "node_size": (int, POSITIVE_INT), "global_batch": (int, POSITIVE_INT), "nodes": (int, POSITIVE_INT),
                        "seq_len": (int, POSITIVE_INT), "top": (int, POSITIVE_INT), "intra_bw": (float, POSITIVE),
                        "inter_bw": (float, POSITIVE), "bucket_mb": (float, POSITIVE)})
    model = apply_preset(ModelConfig(), args.preset) if args.preset else model_from_params(args.params)
    cluster = cluster_from_args(args)
    t0 = time.perf_counter()
    fits, considered = plan(model, cluster, args.seq_len, args.global_batch)
    took = time.perf_counter() - t0
    if not considered:  # no pp x dp split of the GPUs at all: more GPUs would not be the fix
        raise ConfigError(f"{cluster.gpus} GPUs split into no layout: pp x dp must equal --gpus with pp <= "
                          f"{model.n_layers} layers and dp dividing --global-batch {args.global_batch}; "
                          f"choose --gpus {_nearby_gpus(model.n_layers, args.global_batch, cluster.gpus)} "
                          f"or another --global-batch")
    if not fits:
        raise ConfigError(f"no layout of {considered} fits {param_count(model) / 1e9:.1f}B parameters in "
                          f"{cluster.gpus} x {args.gpu_memory:g} GiB; add GPUs or memory, or lower --global-batch")
    best = fits[0]
    rows = [{"pp": e.layout.pp, "dp": e.layout.dp, "zero": e.layout.zero, "schedule": e.layout.schedule.value,
             "virtual_stages": e.layout.virtual, "micro_batch_size": e.layout.micro_batch,
             "microbatches": e.layout.microbatches, "recompute": e.layout.recompute,
             "grad_reduce": e.layout.grad_reduce.value, "placement": e.layout.placement.value,
             "hierarchical": e.layout.hierarchical,
             "memory_gib": round(e.memory_gib, 2), "model_states_gib": round(e.model_states_gib, 2),
             "activations_gib": round(e.activations_gib, 2), "step_time_s": e.step_time_s,
             "tokens_per_s": e.tokens_per_s, "bubble": e.bubble, "why": reason(best, e, cluster)}
            for e in fits[: args.top]]
    if args.json:
        print(json.dumps({"params": param_count(model), "considered": considered, "fit": len(fits),
                          "seconds": took, "layouts": rows}, indent=2))
        return 0
    table = Table(title=f"{param_count(model) / 1e9:.2f}B params on {cluster.gpus} x {args.gpu_memory:g} GiB: "
                        f"{len(fits)} of {considered} layouts fit ({took:.1f} s)")
    for col in ("pp", "dp", "zero", "schedule", "V", "mbs", "M", "rc", "grad", "place", "hier", "GiB", "step s", "why"):
        table.add_column(col, justify="left" if col in ("schedule", "why") else "right")
    for r in rows:
        table.add_row(str(r["pp"]), str(r["dp"]), str(r["zero"]), r["schedule"], str(r["virtual_stages"]),
                      str(r["micro_batch_size"]), str(r["microbatches"]), "y" if r["recompute"] else "",
                      "mb" if r["grad_reduce"] == "microbatch" else "", r["placement"], "y" if r["hierarchical"] else "",
                      f"{r['memory_gib']:.1f}", f"{r['step_time_s']:.2f}", r["why"])
    Console(width=160, emoji=False).print(table)
    return 0
