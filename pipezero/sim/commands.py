"""`pipezero simulate`: build a schedule, play it under a cost model, print, plot or compare."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from rich.console import Console
from rich.table import Table

from pipezero.coerce import Range, coerce
from pipezero.config import GradReduce, ScheduleKind
from pipezero.settings import NON_NEGATIVE, POSITIVE, POSITIVE_INT
from pipezero.errors import ConfigError
from pipezero.schedules.actions import Schedule
from pipezero.schedules.check import CostModel, simulate
from pipezero.schedules.registry import SCHEDULES, build_schedule, default_virtual, help_text


def check_ranges(args: argparse.Namespace, limits: dict[str, tuple[type, Range]]) -> None:
    """Refuse a flag value out of its range in one line, the way `train` does (settings.coerce_setting)."""
    for dest, (kind, accepted) in limits.items():
        if getattr(args, dest, None) is not None:
            coerce(f"--{dest.replace('_', '-')}", kind, getattr(args, dest), False, accepted)


MAX_COST = 1e6  # relative times: a million to one is beyond any real F:B:W


def parse_cost(text: str) -> tuple[float, float, float]:
    """`--cost F:B:W`; nan and inf parse as floats but would time every action as nan or inf (a
    table of nan% bubbles), so only finite positive costs pass."""
    try:
        f, b, w = (float(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--cost wants F:B:W like 1:1:1, got {text!r}") from None
    if not all(0 < x <= MAX_COST for x in (f, b, w)):  # larger: a step's sum of costs overflows to inf
        raise ConfigError(f"--cost {text}: expected three numbers > 0 and at most {MAX_COST:g} (relative F:B:W "
                          f"times, like 1:1:1)")
    return f, b, w


# How large a schedule `simulate` plays. The simulator keeps every action (~0.5 KB each, about 3
# a cell of P x M x V) and takes 10-25 us an action, growing with P (measured on the 2-core machine:
# 1f1b P=256 M=256 3.2 s and 88 MB; P=16 M=32768 13.9 s and 612 MB; P=10^6 never answered), so
# these bounds answer in seconds and a few hundred MB. Real pipelines are far smaller.
MAX_PP = 256
MAX_CELLS = 65_536


def check_size(pp: int, microbatches: int, virtual: int) -> None:
    """Refuse, in one line, a schedule too large to simulate in seconds."""
    if pp > MAX_PP:
        raise ConfigError(f"--pp {pp}: simulate plays at most {MAX_PP} pipeline ranks; choose --pp {MAX_PP} or fewer")
    if pp * microbatches * virtual > MAX_CELLS:
        raise ConfigError(f"--pp {pp} x --microbatches {microbatches} x {virtual} virtual stages is "
                          f"{pp * microbatches * virtual:,} cells; simulate plays at most {MAX_CELLS:,}: choose "
                          f"--microbatches {max(1, MAX_CELLS // (pp * virtual))} or fewer")


def each_schedule(args: argparse.Namespace, skipped: dict[str, str]) -> Iterator[Schedule]:
    """The schedule asked for, or with --compare every schedule at the asked P and M; a schedule
    that cannot run there, or is too large to simulate, is one line in `skipped` under --compare,
    else the error."""
    for kind in list(SCHEDULES) if args.compare else [ScheduleKind(args.schedule)]:
        virtual = default_virtual(kind, None if args.compare else args.virtual_stages)
        try:
            check_size(args.pp, args.microbatches, virtual)
            schedule = build_schedule(kind, args.pp, args.microbatches, virtual)
        except ValueError as e:  # ConfigError too
            if not args.compare:
                raise ConfigError(str(e)) from None
            skipped[kind.value] = str(e)
            continue
        yield schedule


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("simulate", help="play a pipeline schedule under a cost model")
    s.add_argument("--schedule", choices=[k.value for k in SCHEDULES], default="1f1b", help=help_text())
    s.add_argument("--pp", type=int, default=4, help="pipeline ranks (P)")
    s.add_argument("--microbatches", type=int, default=8, help="micro-batches a step (M)")
    s.add_argument("--virtual-stages", type=int, default=None, help="default: 2 for schedules that need V>1")
    s.add_argument("--cost", default="1:1:1", help="relative F:B:W cost of one stage")
    s.add_argument("--comm", type=float, default=0.0, help="time of one hop between ranks, in F units")
    s.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    s.add_argument("--png", help="draw the timeline to this file")
    s.add_argument("--compare", action="store_true", help="every schedule side by side")
    s.add_argument("--from-trace", help="fit the cost model to a run's trace.json and compare")
    z = s.add_argument_group("ZeRO traffic (the lowered program: gathers, reductions and the optimizer step)")
    z.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                   help="lower the schedule with this ZeRO stage's collectives and time them too")
    z.add_argument("--dp", type=int, default=1, help="data-parallel ranks a stage (with --zero)")
    z.add_argument("--grad-reduce", choices=[g.value for g in GradReduce], default=GradReduce.STEP.value,
                   help="reduce gradients once a step or every micro-batch (as train --grad-reduce)")
    z.add_argument("--preset", default="small", help="model preset that sizes the buckets (default small)")
    z.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MB (as train --bucket-mb)")
    z.add_argument("--dp-comm", type=float, default=0.5,
                   help="time, in F units, for one rank's link to carry one stage's parameters (0: free)")
    z.add_argument("--zero3-layerwise", action="store_true", help="ZeRO-3 layer by layer, not a chunk kept gathered")
    z.add_argument("--zero3-prefetch", action="store_true",
                   help="what if ZeRO-3 gathered each chunk one action ahead (the runtime gathers on demand)")
    z.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16 halves reductions and ZeRO-3 gathers")
    z.add_argument("--quantize-weights", choices=("none", "int8"), default="none",
                   help="parameter gathers as int8 with a scale a block (as train --quantize-weights)")
    z.add_argument("--quantize-grads", choices=("none", "int8", "int4"), default="none",
                   help="gradient reductions quantized (as train --quantize-grads)")
    z.add_argument("--quant-block", type=int, default=256, help="elements a scale (as train --quant-block)")
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
    if args.png and args.compare:  # one timeline a picture: it used to exit 0 having drawn nothing
        raise ConfigError("--png draws one schedule's timeline, not a --compare table: drop --compare and name "
                          "the schedule with --schedule")
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
                        "optim_cost": (float, NON_NEGATIVE), "quant_block": (int, POSITIVE_INT)})
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
