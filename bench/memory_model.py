"""The memory model (pipezero/sim/memory.py) against measured runs: each rank's predicted peak beside
its measured peak of the first step (`train --memory-profile`: on CPU the profiler's live tensor
bytes), for every schedule x ZeRO 0-3 x P in {1, 2, 4} x D in {1, 2}, with and without recompute,
on two models: `activations` (long sequences, few parameters) and `states` (many thin layers, eight
tokens). Ranks above --max-ranks are left out (P=4 x D=2 needs 8).

    python bench/memory_model.py [--models activations,states] [--pp 1,2,4] [--dp 1,2] [--max-ranks 4]
        [--schedules 1f1b,zb-v] [--zero 0,3] [--dtype bf16] [--eval-batches N] [--sample-tokens N]
        [--zero3-prefetch D]

A rank's measured peak is the most of its phases (the first step, the evaluation after it, the text
sample when there is one: P = 1 and --sample-tokens); each phase's figures are kept beside.

Prints one line a case (the worst rank's ratio), then the summary: cases and ranks, how many ranks
within 10%, the median error, the worst over- and under-prediction (with and without recompute), and
writes every rank's figures to bench/results/memory_model.json, one line a case.

    python bench/memory_model.py --repredict bench/results/memory_model.json

predicts the stored measurements again (after a change to the model), measuring nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # rank_spawner.py

from pipezero.config import ScheduleKind  # noqa: E402
from pipezero.data import write_stdlib_sample  # noqa: E402
from pipezero.schedules.registry import SCHEDULES, check_layout, default_virtual  # noqa: E402
from pipezero.settings import build_config  # noqa: E402
from pipezero.sim.memory import predict  # noqa: E402
from pipezero.sim.memory_runs import phase_peaks  # noqa: E402
from pipezero.util import atomic_write_bytes  # noqa: E402
from rank_spawner import run_ranks  # noqa: E402

MODELS = {
    # activations dominate: 6 blocks of width 64 over 2 x 512 tokens a micro-batch
    "activations": {"model.n_layers": 6, "model.dim": 64, "model.n_heads": 4, "model.vocab_size": 256,
                    "data.seq_len": 512, "parallel.micro_batch_size": 2, "parallel.bucket_mb": 0.25},
    # model state dominates: 8 blocks of width 128 over 16 tokens
    "states": {"model.n_layers": 8, "model.dim": 128, "model.n_heads": 4, "model.vocab_size": 256,
               "data.seq_len": 16, "parallel.micro_batch_size": 1, "parallel.bucket_mb": 0.5},
}


def settings(model: str, kind: ScheduleKind, pp: int, dp: int, zero: int, recompute: bool, data: str,
             out: str, dtype: str = "fp32", eval_batches: int = 1, sample_tokens: int = 0, prefetch: int = 1) -> dict:
    return {**MODELS[model], "model.preset": "tiny", "data.path": data, "data.tokenizer": "bytes",
            "run.dtype": dtype, "parallel.zero3_prefetch": prefetch,
            "data.packing": "concat", "parallel.pp": pp, "parallel.dp": dp, "parallel.zero": zero,
            "parallel.schedule": kind.value, "parallel.microbatches": 2 * pp,
            "parallel.virtual_stages": default_virtual(kind, None) if pp > 1 else 1, "parallel.recompute": recompute,
            "parallel.timeout_s": 120.0, "run.max_steps": 1, "run.out": out, "run.progress": False,
            "run.sample_tokens": sample_tokens, "run.eval_every": 0, "run.eval_batches": eval_batches,
            "run.threads": 1}


def cases(models: list[str], pps: list[int], dps: list[int], max_ranks: int, kinds: list[ScheduleKind] | None = None,
          zeros: tuple[int, ...] = (0, 1, 2, 3)) -> list[dict]:
    out = []
    for model in models:
        for pp in pps:
            for dp in dps:
                if pp * dp > max_ranks:
                    continue
                for kind in SCHEDULES if pp > 1 else [ScheduleKind.ONE_F_ONE_B]:
                    if kinds is not None and kind not in kinds:
                        continue
                    try:
                        check_layout(kind, pp, 2 * pp, default_virtual(kind, None))
                    except ValueError:
                        continue
                    for zero in [z for z in zeros if dp > 1 or z == 0]:
                        for recompute in (False, True):
                            out.append({"model": model, "schedule": kind.value, "pp": pp, "dp": dp, "zero": zero,
                                        "recompute": recompute})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="activations,states")
    ap.add_argument("--pp", default="1,2,4")
    ap.add_argument("--dp", default="1,2")
    ap.add_argument("--max-ranks", type=int, default=4)
    ap.add_argument("--schedules", help="only these schedules (comma-separated; default: every one)")
    ap.add_argument("--zero", default="0,1,2,3", help="ZeRO stages (D > 1; D = 1 runs stage 0)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--eval-batches", type=int, default=1, help="global batches the evaluation after the step reads")
    ap.add_argument("--sample-tokens", type=int, default=0, help="the text sample's length (P = 1 only)")
    ap.add_argument("--zero3-prefetch", type=int, default=1,
                    help="ZeRO-3 layer by layer: layers a gather starts ahead (and d - 1 kept across actions)")
    ap.add_argument("--data", help="a folder of text (default: the standard library's first ~400 KB)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory_model.json"))
    ap.add_argument("--markdown", help="a results JSON: print its table by model, schedule and recompute (docs)")
    ap.add_argument("--repredict", help="a results JSON: predict its measured cases again (the model changed), "
                                        "measure nothing")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    if args.repredict:
        rows = json.loads(Path(args.repredict).read_text())["rows"]
        for row in rows:
            cfg = build_config(None, settings(row["model"], ScheduleKind(row["schedule"]), row["pp"], row["dp"],
                                              row["zero"], row["recompute"], str(Path(__file__).parent), "-",
                                              row.get("dtype", "fp32"), row.get("eval_batches", 1),
                                              row.get("sample_tokens", 0), row.get("zero3_prefetch", 1)))
            for r, pred in zip(row["ranks"], predict(cfg, cuda=False)):
                r.update(rank_figures(pred, r.get("measured_phases") or {"train": r["measured_peak_bytes"]}))
            show(row)
        report(rows, args.out)
        return
    kinds = [ScheduleKind(k) for k in args.schedules.split(",")] if args.schedules else None
    todo = [{**c, "dtype": args.dtype, "eval_batches": args.eval_batches, "sample_tokens": args.sample_tokens,
             "zero3_prefetch": args.zero3_prefetch}
            for c in cases(args.models.split(","), [int(x) for x in args.pp.split(",")],
                           [int(x) for x in args.dp.split(",")], args.max_ranks, kinds,
                           tuple(int(z) for z in args.zero.split(",")))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(write_stdlib_sample(Path(tmp) / "corpus"))
        by_world: dict[int, list[dict]] = {}
        for c in todo:
            by_world.setdefault(c["pp"] * c["dp"], []).append(c)
        for world, group in sorted(by_world.items()):
            cfgs = [build_config(None, settings(c["model"], ScheduleKind(c["schedule"]), c["pp"], c["dp"], c["zero"],
                                                c["recompute"], data, f"{tmp}/run{i}", c["dtype"], c["eval_batches"],
                                                c["sample_tokens"], c["zero3_prefetch"]))
                    for i, c in enumerate(group)]
            t0 = time.perf_counter()
            measured = run_ranks(phase_peaks, world, cfgs, timeout=3600)
            print(f"# {len(group)} cases on {world} ranks in {time.perf_counter() - t0:.0f} s", flush=True)
            for i, (c, cfg) in enumerate(zip(group, cfgs)):
                pred = predict(cfg, cuda=False)
                ranks = [{"rank": r, **rank_figures(pred[r], measured[r][i])} for r in range(world)]
                rows.append({**c, "ranks": ranks})
                show(rows[-1])
    report(rows, args.out)


def rank_figures(pred, measured: dict[str, int]) -> dict:
    """One rank's predicted and measured peaks (the most over phases) and each phase's."""
    peak = max(measured.values())
    return {"predicted_peak_bytes": pred.peak_bytes, "measured_peak_bytes": peak, "ratio": pred.peak_bytes / peak,
            "at": pred.at, "measured_phases": measured, "predicted_phases": dict(getattr(pred, "phases", {}))}


def show(row: dict) -> None:
    worst = max(row["ranks"], key=lambda x: abs(x["ratio"] - 1))
    print(f"{row['model']:<11} {row['schedule']:<16} P={row['pp']} D={row['dp']} Z{row['zero']} "
          f"recompute={int(row['recompute'])}  worst rank {worst['rank']}: predicted "
          f"{worst['predicted_peak_bytes'] / 2**20:7.2f} MiB, measured "
          f"{worst['measured_peak_bytes'] / 2**20:7.2f} MiB, ratio {worst['ratio']:.3f} (at {worst['at']})", flush=True)


def summarize(rows: list[dict]) -> dict:
    """Over every rank of `rows`: how many, how many within 10%, the median |error|, the worst
    over- and under-prediction and where they are."""
    ranks = [(row, r) for row in rows for r in row["ranks"]]
    if not ranks:
        return {"cases": len(rows), "ranks": 0}
    errors = [abs(r["ratio"] - 1) for _, r in ranks]
    over = max(ranks, key=lambda x: x[1]["ratio"])
    under = min(ranks, key=lambda x: x[1]["ratio"])
    return {"cases": len(rows), "ranks": len(ranks), "within_10pct": sum(e <= 0.10 for e in errors),
            "median_abs_error": statistics.median(errors),
            "worst_over": over[1]["ratio"], "worst_over_case": case_name(over[0], over[1]["rank"]),
            "worst_under": under[1]["ratio"], "worst_under_case": case_name(under[0], under[1]["rank"])}


def case_name(row: dict, rank: int) -> str:
    return (f"{row['model']} {row['schedule']} P={row['pp']} D={row['dp']} Z{row['zero']}"
            f"{' recompute' if row['recompute'] else ''} rank {rank}")


def summary_lines(rows: list[dict]) -> list[str]:
    out = []
    for what, part in (("all", rows), ("without recompute", [r for r in rows if not r["recompute"]]),
                       ("with recompute", [r for r in rows if r["recompute"]])):
        s = summarize(part)
        if not s["ranks"]:
            continue
        out.append(f"{what}: {s['cases']} cases, {s['ranks']} ranks, {s['within_10pct']}/{s['ranks']} within 10%, "
                   f"median |error| {s['median_abs_error']:.1%}, worst over {s['worst_over']:.3f} "
                   f"({s['worst_over_case']}), worst under {s['worst_under']:.3f} ({s['worst_under_case']})")
    return out


def report(rows: list[dict], out: str) -> None:
    for line in summary_lines(rows):
        print(line)
    # one line a case: the file stays readable and diffs show which cases moved
    body = ",\n".join("  " + json.dumps(row, sort_keys=True) for row in rows)
    text = f'{{"summary": {json.dumps(summarize(rows), sort_keys=True)},\n "rows": [\n{body}\n]}}\n'
    atomic_write_bytes(Path(out), text.encode())


def markdown(results: dict) -> str:
    """Predicted / measured per rank, grouped by model, schedule and recompute: cases, ranks, the
    lowest, median and highest ratio."""
    groups: dict[tuple, list[float]] = {}
    for row in results["rows"]:
        groups.setdefault((row["model"], row["schedule"], row["recompute"]), []).extend(
            r["ratio"] for r in row["ranks"])
    lines = ["| model | schedule | recompute | ranks | lowest | median | highest |", "|---|---|---|---|---|---|---|"]
    for (model, kind, rec), ratios in sorted(groups.items()):
        lines.append(f"| {model} | {kind} | {'yes' if rec else 'no'} | {len(ratios)} | {min(ratios):.3f} | "
                     f"{statistics.median(ratios):.3f} | {max(ratios):.3f} |")
    lines.append("")
    lines += [line + "." for line in summary_lines(results["rows"])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
