"""Fit the simulator's cost model to a measured trace, and compare prediction with measurement.

From the compute rows of `trace.json` (steps after the first, which pays one-off costs) we take each
chunk's mean F, B and W time; a fused BW is split evenly into B and W when the run never split them.
The hop time is the 10th percentile of the gaps between a forward ending on one rank and the next
chunk's forward of the same micro-batch starting on another rank while that rank was idle. The
measured step time and bubble use the simulator's definitions (makespan of the schedule's compute,
idle share over all ranks), so the two columns compare like with like.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from pipezero.config import ScheduleKind
from pipezero.errors import ConfigError
from pipezero.schedules.check import CostModel, simulate
from pipezero.schedules.registry import SCHEDULES, build_schedule, check_layout, default_virtual
from pipezero.schedules import limits
from pipezero.telemetry.trace import load_trace, parse_action

OPS = ("F", "B", "W", "BW")
SIZES = ("pp", "dp", "microbatches", "virtual_stages")


@dataclass
class Calibration:
    layout: dict  # pp, dp, schedule, microbatches, virtual_stages of the traced run
    per_chunk: dict[int, tuple[float, float, float]]  # seconds
    hop_s: float
    measured_step_s: float
    measured_bubble: float
    steps: int

    def stage_costs(self) -> list[tuple[float, float, float]]:
        """(F, B, W) of each pipeline rank: the sum over the chunks it held."""
        lay = self.layout
        measured = build_schedule(ScheduleKind(lay["schedule"]), lay["pp"], lay["microbatches"], lay["virtual_stages"])
        return [tuple(sum(self.per_chunk[c][i] for c in measured.chunks(r)) for i in range(3))  # type: ignore[misc]
                for r in range(lay["pp"])]


def check_trace(layout: object, compute: list[tuple[int, dict]]) -> None:
    """Refuse (ValueError: the trace is not one pipezero wrote) a layout that is missing or
    impossible, events outside it, times that are not finite and >= 0, and (ConfigError) a layout
    past what simulate plays in seconds: a hand-edited trace with pp = M = 100000 grew past 3 GB,
    and one of 2 ranks' events under pp = 1 printed a comparison of nothing, exit 0."""
    if not isinstance(layout, dict) or not all(k in layout for k in ("schedule", *SIZES)):
        raise ValueError(f"otherData.layout lacks schedule, {', '.join(SIZES)}")
    if not all(type(layout[k]) is int and layout[k] >= 1 for k in SIZES):
        raise ValueError(f"otherData.layout's {', '.join(SIZES)} must be integers >= 1, not {layout}")
    if layout["schedule"] not in {k.value for k in SCHEDULES}:
        raise ValueError(f"otherData.layout's schedule {layout['schedule']!r} is none of pipezero's")
    pp, m, v = layout["pp"], layout["microbatches"], layout["virtual_stages"]
    check_layout(ScheduleKind(layout["schedule"]), pp, m, v)
    played = pp * m * (v + sum(default_virtual(k) for k in SCHEDULES))
    if played > limits.PLAY_LIMIT:
        raise ConfigError(f"--from-trace: the trace's layout (pp {pp}, {m} micro-batches) asks for {played} stage micro-batches "
                          f"over the traced schedule and every what-if; simulate plays at most {limits.PLAY_LIMIT}, "
                          f"a few seconds' work")
    for rank, e in compute:
        if not 0 <= rank < pp * layout["dp"]:
            raise ValueError(f"an event of rank {rank}, but the layout has pp x dp = {pp * layout['dp']} ranks")
        if not all(isinstance(e[k], (int, float)) and math.isfinite(e[k]) and e[k] >= 0 for k in ("ts", "dur")):
            raise ValueError(f"event {e['name']!r} has ts {e['ts']!r} and dur {e['dur']!r}: finite times >= 0 only")
    chunks = {parse_action(e["name"], e["cat"])[0] for _, e in compute}
    if chunks != set(range(pp * v)):
        raise ValueError(f"compute events of chunks {sorted(chunks)[:8]}, but the layout has chunks 0 to {pp * v - 1}")


def calibrate(trace_path: str | Path) -> Calibration:
    layout, by_rank = load_trace(Path(trace_path))
    compute = [(rank, e) for rank, evs in by_rank.items() for e in evs if e["cat"] in OPS]
    check_trace(layout, compute)
    steps = sorted({e["args"]["step"] for _, e in compute})
    use = [s for s in steps if s > steps[0]] or steps
    samples: dict[tuple[int, str], list[float]] = {}
    for _, e in compute:
        if e["args"]["step"] in use:
            chunk, _ = parse_action(e["name"], e["cat"])
            samples.setdefault((chunk, e["cat"]), []).append(e["dur"] / 1e6)
    per_chunk = {}
    for chunk in sorted({c for c, _ in samples}):
        mean = {op: statistics.fmean(samples[(chunk, op)]) for op in OPS if (chunk, op) in samples}
        f = mean.get("F", 0.0)
        if "BW" in mean and "B" not in mean:
            b = w = mean["BW"] / 2
        else:
            b, w = mean.get("B", 0.0), mean.get("W", 0.0)
        per_chunk[chunk] = (f, b, w)
    step_times, bubbles, gaps = [], [], []
    for s in use:
        evs = [(r, e) for r, e in compute if e["args"]["step"] == s]
        start = min(e["ts"] for _, e in evs)
        end = max(e["ts"] + e["dur"] for _, e in evs)
        span = (end - start) / 1e6
        ranks = sorted({r for r, _ in evs})
        busy = sum(e["dur"] for _, e in evs) / 1e6
        step_times.append(span)
        bubbles.append(1 - busy / (span * len(ranks)))
        gaps.extend(_hop_gaps(evs))
    hop = sorted(gaps)[len(gaps) // 10] if gaps else 0.0
    return Calibration(layout, per_chunk, hop, statistics.fmean(step_times), statistics.fmean(bubbles), len(use))


def _hop_gaps(evs: list[tuple[int, dict]]) -> list[float]:
    """Gaps between F(c-1, m) ending and F(c, m) starting on another rank that was idle meanwhile."""
    forward = {}
    by_rank: dict[int, list[dict]] = {}
    for r, e in evs:
        by_rank.setdefault(r, []).append(e)
        if e["cat"] == "F":
            forward[parse_action(e["name"], "F")] = (r, e)
    for lst in by_rank.values():
        lst.sort(key=lambda e: e["ts"])
    prev_end = {}
    for lst in by_rank.values():
        for a, b in zip(lst, lst[1:]):
            prev_end[id(b)] = a["ts"] + a["dur"]
    gaps = []
    for (c, m), (r, e) in forward.items():
        if (c - 1, m) in forward and forward[(c - 1, m)][0] != r:
            producer = forward[(c - 1, m)][1]
            ready = producer["ts"] + producer["dur"]
            if prev_end.get(id(e), 0.0) <= ready:  # this rank was idle, waiting for the activation
                gaps.append(max(0.0, (e["ts"] - ready) / 1e6))
    return gaps


def predict_step(cal: Calibration, kind: ScheduleKind, m: int, v: int) -> tuple[float, float]:
    """(step time s, bubble) of schedule `kind` with M micro-batches and V chunks a rank on the
    calibrated costs: each rank's measured stage cost is spread evenly over its V new chunks."""
    stages = cal.stage_costs()
    schedule = build_schedule(kind, len(stages), m, v)
    per_chunk = tuple(tuple(x / v for x in stages[schedule.rank_of_chunk[c]]) for c in range(schedule.n_chunks))
    res = simulate(schedule, CostModel(comm=cal.hop_s, per_chunk=per_chunk))  # type: ignore[arg-type]
    return res.step_time, res.bubble


def what_if(cal: Calibration) -> dict[str, tuple[float, float] | str]:
    """Every schedule on the same costs and M (V=2 where a schedule needs more than one chunk)."""
    out: dict[str, tuple[float, float] | str] = {}
    for kind in SCHEDULES:
        v = default_virtual(kind)
        try:
            out[kind.value] = predict_step(cal, kind, cal.layout["microbatches"], v)
        except ValueError as e:
            out[kind.value] = str(e)
    return out

