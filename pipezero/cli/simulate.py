"""`pipezero simulate`: build a schedule, play it under a cost model, print, plot or compare."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from rich.console import Console
from rich.table import Table

from pipezero.coerce import Range, coerce
from pipezero.config import GradReduce, ScheduleKind
from pipezero.settings import POSITIVE, POSITIVE_INT, RANGES, unread_activation_offload
from pipezero.schedules import limits
from pipezero.errors import ConfigError
from pipezero.schedules.actions import Schedule
from pipezero.schedules.check import CostModel, simulate
from pipezero.schedules.registry import SCHEDULES, build_schedule, check_layout, default_virtual, help_text
from pipezero.schedules.zero_rules import RULES
from pipezero.cli.simulate_memory import LAYOUT, add_memory_flags, cmd_simulate_memory


def check_ranges(args: argparse.Namespace, ranges: dict[str, tuple[type, Range]]) -> None:
    """Refuse a flag value out of its range in one line, the way `train` does (settings.coerce_setting)."""
    for dest, (kind, accepted) in ranges.items():
        if getattr(args, dest, None) is not None:
            coerce(f"--{dest.replace('_', '-')}", kind, getattr(args, dest), False, accepted)


def parse_cost(text: str) -> tuple[float, float, float]:
    """`--cost F:B:W`; nan and inf parse as floats but would time every action as nan or inf (a
    table of nan% bubbles), and so would finite costs whose sum overflows (1e308), so each is held
    to limits.COST."""
    try:
        f, b, w = (float(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--cost wants F:B:W like 1:1:1, got {text!r}") from None
    if not all(math.isfinite(x) and x in limits.COST for x in (f, b, w)):
        raise ConfigError(f"--cost {text}: expected three numbers > 0 (from {limits.COST.low:g} to "
                          f"{limits.COST.high:g}: relative F:B:W times, like 1:1:1)")
    return f, b, w


# flags only the ZeRO lowering reads: given without --zero they would change nothing
ZERO_FLAGS = ("dp", "grad_reduce", "preset", "bucket_mb", "dp_comm", "zero3_layerwise", "zero3_prefetch_chunk", "zero3_prefetch",
              "zero3_unit", "dtype",
              "quantize_weights", "quantize_grads", "quant_block", "optim_cost", "listing", "offload",
              "offload_activations")


ZERO3_FLAGS = ("zero3_layerwise", "zero3_prefetch_chunk", "zero3_prefetch", "zero3_unit")  # of those, what only ZeRO-3 reads

# what --memory reads: train's layout flags (cli/simulate_memory.py)
MEMORY_FLAGS = ("memory", "json", "png", "config", *LAYOUT)
MEMORY_ONLY = ("config", "micro_batch_size", "seq_len", "recompute", "partition", "eval_batches",
               "sample_tokens")  # add_memory_flags' own: no timing run reads them


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def changed_flags(args: argparse.Namespace) -> list[str]:
    """The flags whose value differs from a bare `simulate`'s, in the parser's order."""
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    bare = vars(parser.parse_args(["simulate"]))
    return [dest for dest, value in bare.items() if dest != "func" and getattr(args, dest, value) != value]


def typed_flags(args: argparse.Namespace) -> set[str]:
    """The dests of the flags on the command line (`args.argv`, as `main` keeps it), whatever
    their value: `--pp 4` typed is given even where it equals simulate's default. Without argv (a
    namespace made in code) the flags whose value differs from a bare simulate's."""
    argv = getattr(args, "argv", None)
    if argv is None:
        return set(changed_flags(args))
    parser = argparse.ArgumentParser()
    add_simulate_parser(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["simulate"]  # type: ignore[union-attr]
    for action in sub._actions:
        action.default = argparse.SUPPRESS
    argv = list(argv)
    return set(vars(parser.parse_args(argv[argv.index("simulate"):]))) - {"func"}


def check_combination(args: argparse.Namespace) -> None:
    """Refuse flags the request would ignore: exit 0 would say they had been applied."""
    for dest in ("png", "from_trace", "config"):  # "" read as not given: the request ran without it, exit 0
        value = getattr(args, dest, None)
        if isinstance(value, str) and not value.strip():
            raise ConfigError(f"{flag(dest)} is empty: name its file, or leave {flag(dest)} out")
    read_prefetch(args)
    given = changed_flags(args)
    if args.from_trace:
        extra = [d for d in given if d not in ("from_trace", "json")]
        if extra:
            raise ConfigError(f"--from-trace takes no {flag(extra[0])}: the layout and costs come from the run's "
                              f"trace; drop {flag(extra[0])}")
    elif args.memory:
        extra = [d for d in given if d not in MEMORY_FLAGS]
        if extra:
            raise ConfigError(f"--memory takes no {flag(extra[0])}: it predicts memory, not time; drop "
                              f"{flag(extra[0])}")
    elif memory_only := [d for d in given if d in MEMORY_ONLY]:  # a timing run read none of them: exit 0
        raise ConfigError(f"{flag(memory_only[0])} applies with --memory: add --memory, or drop {flag(memory_only[0])}")
    elif args.zero is None:
        extra = [d for d in given if d in ZERO_FLAGS]
        if extra:
            raise ConfigError(f"{flag(extra[0])} applies with --zero (the lowered program's ZeRO traffic): add "
                              f"--zero 0, 1, 2 or 3, or drop {flag(extra[0])}")
    # each of the next two flags would be unread by the stage asked for: refused, as train refuses them
    elif not RULES[args.zero].sharded_params and (unread := [d for d in given if d in ZERO3_FLAGS]):
        raise ConfigError(f"{flag(unread[0])} is read only by ZeRO-3 (its parameter gathers); with --zero {args.zero} "
                          f"it changes nothing: add --zero 3, or drop {flag(unread[0])}")
    elif args.zero3_unit not in (None, "layer") and not args.zero3_layerwise:  # read only layer by layer
        raise ConfigError(f"--zero3-unit {args.zero3_unit} applies with --zero3-layerwise (a chunk kept gathered has "
                          f"one gather a step, not a unit's): add --zero3-layerwise, or drop it")
    elif args.zero3_prefetch is not None and not args.zero3_layerwise:  # the depth of layer-by-layer gathers
        raise ConfigError(f"--zero3-prefetch {args.zero3_prefetch} applies with --zero3-layerwise (a chunk kept "
                          f"gathered has one gather a step, no layer to prefetch): add --zero3-layerwise, or drop it")
    elif args.zero3_prefetch_chunk and args.zero3_layerwise:  # the kept-gathered chunk's what-if only
        raise ConfigError("--zero3-prefetch-chunk prefetches a chunk kept gathered; with --zero3-layerwise there is "
                          "none (--zero3-prefetch N sets how far layers are prefetched): drop one of them")
    elif not RULES[args.zero].gathers_weights and args.quantize_weights != "none":
        raise ConfigError(f"--quantize-weights {args.quantize_weights} with --zero 0: ZeRO-0 gathers no weights (every "
                          f"rank updates all of them), as train refuses it; use --zero 1, 2 or 3, or drop it")
    if args.compare and (unread := [d for d in given if d in ("schedule", "virtual_stages")]):
        raise ConfigError(f"{flag(unread[0])} is unread by --compare, which plays every schedule, each at its own "
                          f"default --virtual-stages: drop one of them")
    if args.json and args.listing:  # the listing is text, left out of the JSON
        raise ConfigError("--listing prints every rank's program as text, which --json leaves out: drop one of them")
    if "quant_block" in given and args.quantize_weights == args.quantize_grads == "none":
        raise ConfigError(f"--quant-block {args.quant_block} sizes the scales of quantized traffic: add "
                          f"--quantize-weights or --quantize-grads, or drop it")


def read_prefetch(args: argparse.Namespace) -> None:
    """--zero3-prefetch as a depth. `auto` is train's (it chooses for the link --link-gbps names,
    which simulate does not take): said in one line, not argparse's "invalid int value"."""
    text = args.zero3_prefetch
    if not isinstance(text, str):
        return
    if text.strip() == "auto":
        raise ConfigError("--zero3-prefetch auto is train's (it chooses the depth for the link --link-gbps names); "
                          "simulate plays a depth you give: pass a number (pipezero plan shows the depth auto picks)")
    try:
        args.zero3_prefetch = int(text.strip(), 10)
    except ValueError:
        raise ConfigError(f"--zero3-prefetch {text}: expected an integer >= 1, a depth in layers") from None


def played(args: argparse.Namespace) -> tuple[int, int]:
    """(stage micro-batches the request plays: P x M x V, x D with --zero, summed over the schedules
    it plays; how many schedules). A schedule that cannot run there is refused, or under --compare
    not played."""
    total = count = 0
    for kind in list(SCHEDULES) if args.compare else [ScheduleKind(args.schedule)]:
        v = default_virtual(kind, None if args.compare else args.virtual_stages)
        try:
            check_layout(kind, args.pp, args.microbatches, v)
        except ValueError as e:
            if not args.compare:
                raise ConfigError(str(e)) from None
            continue
        total += args.pp * args.microbatches * v * (args.dp if args.zero is not None else 1)
        count += 1
    return total, count


def check_work(args: argparse.Namespace) -> None:
    """Refuse, before any schedule is built, a request past what plays within seconds (schedules/limits.py)."""
    total, count = played(args)
    zero = args.zero is not None
    limit = limits.ZERO_PLAY_LIMIT if zero else limits.PLAY_LIMIT
    if total <= limit:
        return
    what = f"--pp {args.pp} x --microbatches {args.microbatches}"
    what += (f" over --compare's {count} schedules (x their V)" if args.compare else
             f" x V {default_virtual(ScheduleKind(args.schedule), args.virtual_stages)}")
    what += f" x --dp {args.dp}" if zero else ""
    fewer = limit * args.microbatches // total  # the micro-batches that would fit, all else kept
    fix = f"choose --microbatches {fewer} or fewer, or lower --pp" if fewer else "lower --pp"
    raise ConfigError(f"{what} = {total} stage micro-batches to play; the limit is {limit}"
                      f"{' with --zero' if zero else ''}, a few seconds' work: {fix}"
                      f"{' or --dp' if zero else ''}{', or drop --compare' if args.compare else ''}")


def check_instructions(args: argparse.Namespace, count: int) -> None:
    """Refuse a lowered program (every schedule's, every rank's) past what plays within seconds: the
    buckets a chunk (--preset, --bucket-mb, --zero3-layerwise, --grad-reduce microbatch) multiply
    P x D x M x V."""
    if count > limits.INSTRUCTION_LIMIT:
        raise ConfigError(f"the lowered program has {count} instructions over its ranks; the limit is "
                          f"{limits.INSTRUCTION_LIMIT}, a few seconds' work: lower --microbatches, --pp or --dp, "
                          f"or fewer buckets a chunk (a smaller --preset, a larger --bucket-mb, no "
                          f"--zero3-layerwise or --grad-reduce microbatch)")


def check_png(text: str, drawn: int) -> None:
    """Refuse a --png that would fail only after the simulation, or be written under another name
    (matplotlib adds .png to a folder's name), or draw for minutes."""
    from pipezero.files import unexpanded_home

    if home := unexpanded_home("--png", text):
        raise ConfigError(home)
    path = Path(text)
    if path.is_dir():
        raise ConfigError(f"--png {text} is a folder: name the .png file to write, e.g. {path / 'timeline.png'}")
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--png {text}: name a file ending .png")
    if path.is_symlink():  # the write replaces the link itself, leaving its target as it was
        raise ConfigError(f"--png {text} is a symlink (to {os.readlink(path)}): name the file to write itself")
    folder = path.parent
    if not folder.exists():  # it made every missing folder on the way, wherever a typo put them
        raise ConfigError(f"--png {text}: its folder {folder} does not exist: create it, or name a .png in a folder "
                          f"that does")
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--png {text} cannot be written: {folder} is not a folder this user can write")
    if drawn > limits.DRAW_LIMIT:
        raise ConfigError(f"--png draws at most {limits.DRAW_LIMIT} stage micro-batches (P x M x V), a bar an "
                          f"action; this has {drawn}: lower --microbatches or --pp, or drop --png")


def written(path: str, draw: Callable[[], None]) -> None:
    """Run `draw` (which replaces `path` whole or not at all); a failed write is the user's to fix."""
    try:
        draw()
    except OSError as e:
        raise ConfigError(f"--png {path} cannot be written: {e.strerror or e}") from None


def each_schedule(args: argparse.Namespace, skipped: dict[str, str]) -> Iterator[Schedule]:
    """The schedule asked for, or with --compare every schedule at the asked P and M; a schedule
    that cannot run there is one line in `skipped` under --compare, else the error (its size was
    checked before: check_work)."""
    for kind in list(SCHEDULES) if args.compare else [ScheduleKind(args.schedule)]:
        virtual = default_virtual(kind, None if args.compare else args.virtual_stages)
        try:
            schedule = build_schedule(kind, args.pp, args.microbatches, virtual)
        except ValueError as e:
            if not args.compare:
                raise ConfigError(str(e)) from None
            skipped[kind.value] = str(e)
            continue
        yield schedule


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("simulate", help="play a pipeline schedule under a cost model",
                       description="Play a schedule action by action under a cost model. A request answers "
                                   f"within seconds: it plays at most {limits.PLAY_LIMIT} stage micro-batches "
                                   f"(--pp x --microbatches x V, summed over --compare's schedules), with --zero "
                                   f"at most {limits.ZERO_PLAY_LIMIT} (that x --dp) and "
                                   f"{limits.INSTRUCTION_LIMIT} instructions of the lowered program.")
    s.add_argument("--schedule", choices=[k.value for k in SCHEDULES], default="1f1b", help=help_text())
    s.add_argument("--pp", type=int, default=4, help=f"pipeline ranks (P, {limits.PP.describe()}; default 4, with "
                                                    f"--memory train's 1)")
    s.add_argument("--microbatches", type=int, default=8, help="micro-batches a step (M; default 8, with --memory "
                                                               "train's 4)")
    s.add_argument("--virtual-stages", type=int, default=None, help="default: 2 for schedules that need V>1")
    s.add_argument("--cost", default="1:1:1", help=f"relative F:B:W cost of one stage (each {limits.COST.describe()})")
    s.add_argument("--comm", type=float, default=0.0,
                   help=f"time one transfer between ranks holds its link, in F units, every boundary alike; a link "
                        f"carries one at a time each way ({limits.TIME.describe()})")
    s.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    s.add_argument("--png", help=f"draw the timeline to this .png file (at most {limits.DRAW_LIMIT} stage "
                                 f"micro-batches, P x M x V)")
    s.add_argument("--compare", action="store_true", help="every schedule side by side")
    s.add_argument("--from-trace", help="fit the cost model to a run's trace.json and compare")
    z = s.add_argument_group("ZeRO traffic (the lowered program: gathers, reductions and the optimizer step)")
    z.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                   help="lower the schedule with this ZeRO stage's collectives and time them too")
    z.add_argument("--dp", type=int, default=1,
                   help=f"data-parallel ranks a stage (with --zero; {limits.DP.describe()})")
    z.add_argument("--grad-reduce", choices=[g.value for g in GradReduce], default=GradReduce.STEP.value,
                   help="reduce gradients once a step or every micro-batch (as train --grad-reduce)")
    z.add_argument("--preset", default="small", help="model preset that sizes the buckets (default small; with --memory "
                   "train's tiny: a flag left out takes train's default there)")
    z.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size in MB (as train --bucket-mb)")
    z.add_argument("--dp-comm", type=float, default=0.5,
                   help=f"time, in F units, for one rank's link to carry one stage's parameters (0: free; "
                        f"{limits.TIME.describe()})")
    z.add_argument("--zero3-layerwise", action="store_true", help="ZeRO-3 layer by layer, not a chunk kept gathered")
    z.add_argument("--zero3-prefetch-chunk", action="store_true",
                   help="what if ZeRO-3 kept gathered gathered each chunk one action ahead (the runtime gathers on "
                        "demand)")
    z.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16 halves reductions and ZeRO-3 gathers")
    z.add_argument("--quantize-weights", choices=("none", "int8"), default="none",
                   help="parameter gathers as int8 with a scale a block (as train --quantize-weights)")
    z.add_argument("--quantize-grads", choices=("none", "int8", "int4"), default="none",
                   help="gradient reductions quantized (as train --quantize-grads)")
    z.add_argument("--quant-block", type=int, default=256, help="elements a scale (as train --quant-block)")
    z.add_argument("--optim-cost", type=float, default=0.0, help=f"time of the optimizer update, in F units ({limits.TIME.describe()})")
    z.add_argument("--listing", action="store_true", help="print every rank's lowered program")
    add_memory_flags(s)
    s.set_defaults(func=lambda args: cmd_simulate(args))  # looked up when run: the parser is built once


def cmd_from_trace(args: argparse.Namespace) -> int:

    from pipezero.planner.calibrate import calibrate, predict_step, what_if

    if Path(args.from_trace).is_dir():
        raise ConfigError(f"--from-trace {args.from_trace!r} is a folder: pass the trace.json in it (a run with "
                          f"--trace writes OUT/trace.json)")
    if not Path(args.from_trace).is_file():
        from pipezero.settings import kind_of

        raise ConfigError(f"--from-trace {args.from_trace!r} {kind_of(Path(args.from_trace))} (a run with --trace "
                          f"writes trace.json)")
    try:
        cal = calibrate(args.from_trace)
        lay = cal.layout
        step, bubble = predict_step(cal, ScheduleKind(lay["schedule"]), lay["microbatches"], lay["virtual_stages"])
        others = what_if(cal)
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, ZeroDivisionError, RecursionError) as e:
        raise ConfigError(f"--from-trace {args.from_trace!r} is not a pipezero trace.json ({trace_fault(e)}); pass "
                          f"the trace.json of a run trained with --trace") from None
    if not all(math.isfinite(x) for x in (step, bubble, cal.measured_step_s, cal.measured_bubble)):
        raise ConfigError(f"--from-trace {args.from_trace!r}: its times overflow (step time {cal.measured_step_s:g} "
                          f"s); pass the trace.json of a run trained with --trace")
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


def trace_fault(e: Exception) -> str:
    """What a trace that failed to read lacks, in the file's terms: a KeyError's bare key ("KeyError:
    'ph'") or a Python type name tells a user nothing of their file."""
    if isinstance(e, json.JSONDecodeError):
        return f"not JSON: {e.msg} at line {e.lineno} column {e.colno}"
    if isinstance(e, KeyError):
        return f"an event or its layout lacks its {e.args[0]!r} field" if e.args else "an entry lacks a field"
    if isinstance(e, IndexError):
        return "a list in it is shorter than its layout says"
    if isinstance(e, RecursionError):
        return "it is nested too deep"
    if isinstance(e, ZeroDivisionError):
        return "its times or counts are zero where a run records some"
    if isinstance(e, (TypeError, AttributeError)):
        return "a field holds a value of the wrong kind (a number, a list, an object)"
    text = str(e).splitlines()[0] if str(e) else ""
    return text or "malformed"


def cmd_simulate(args: argparse.Namespace) -> int:
    check_combination(args)
    if args.from_trace:
        return cmd_from_trace(args)
    if args.png and args.compare:  # one timeline a picture: a table has none to draw
        raise ConfigError("--png draws one schedule's timeline, not a --compare table: drop --compare and name "
                          "the schedule with --schedule")
    check_ranges(args, {"pp": (int, limits.PP), "microbatches": (int, POSITIVE_INT),
                        "virtual_stages": (int, POSITIVE_INT), "comm": (float, limits.TIME),
                        "zero3_prefetch": (int, RANGES["parallel.zero3_prefetch"])})
    if args.memory:
        check_ranges(args, {"dp": (int, limits.DP), "bucket_mb": (float, POSITIVE)})
        check_work(args)
        if args.png:
            check_png(args.png, args.pp * args.microbatches * default_virtual(ScheduleKind(args.schedule), args.virtual_stages))
        return cmd_simulate_memory(args, typed_flags(args))
    f, b, w = parse_cost(args.cost)
    cost = CostModel(f, b, w, args.comm)
    if args.zero is not None:
        check_ranges(args, {"dp": (int, limits.DP), "bucket_mb": (float, POSITIVE), "dp_comm": (float, limits.TIME),
                            "optim_cost": (float, limits.TIME), "quant_block": (int, RANGES["parallel.quant_block"])})
    check_work(args)
    if args.png:
        check_png(args.png, args.pp * args.microbatches * default_virtual(ScheduleKind(args.schedule),
                                                                         args.virtual_stages))
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
            title = f"{kind.value}  P={args.pp} M={args.microbatches} V={v}  bubble {res.bubble:.1%}"
            written(args.png, lambda: draw_timeline(bars, args.pp, title, args.png))
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
    their traffic (cli/simulate_zero.py)."""
    from pipezero.cli.simulate_zero import ZeroOptions, draw, lower_zero, run_program

    opt = ZeroOptions.from_args(args)
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    schedules = list(each_schedule(args, skipped))
    if unread := unread_activation_offload(opt.activations, schedules):
        raise ConfigError(unread)
    # one replica first: every replica's program is as long, and lowering them all may take long
    check_instructions(args, sum(lower_zero(s, opt, replicas=(0,)).instructions for s in schedules) * opt.dp)
    lowered = [(schedule, lower_zero(schedule, opt)) for schedule in schedules]
    for schedule, low in lowered:
        kind, v, prog = ScheduleKind(schedule.name), schedule.virtual, low.prog
        res, figures = run_program(low, cost, opt)
        results[kind.value] = {"schedule": kind.value, "pp": args.pp, "microbatches": args.microbatches,
                               "virtual_stages": v, **figures}
        if args.listing and not args.json:
            print("\n".join(f"{kind.value} rank {r} (pp {r // args.dp}, dp {r % args.dp}): {prog.listing(r)}"
                            for r in range(len(prog.ranks))))
        if args.png and not args.compare:
            title = (f"{kind.value}  P={args.pp} D={args.dp} M={args.microbatches} V={v}  ZeRO-{args.zero} "
                     f"{args.grad_reduce}  bubble {figures['bubble_no_zero_traffic']:.1%} -> {res.bubble:.1%} with "
                     f"ZeRO traffic (dp replica 0)")
            written(args.png, lambda: draw(prog, res, title, args.png))
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
    console.print("[dim]gathers, reductions: rank 0's per step, compiled as a run compiles them "
                  "(schedules/compile.py)[/dim]")
    for name, why in skipped.items():
        console.print(f"[dim]{name}: {why}[/dim]")
    return 0
