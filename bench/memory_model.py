"""The memory model (pipezero/memory/model.py) against measured runs: each rank's predicted peak beside
its measured peak of the first step (`train --memory-profile`: on CPU the profiler's live tensor
bytes), for every schedule x ZeRO 0-3 x P in {1, 2, 4} x D in {1, 2}, with and without recompute,
on two models: `activations` (long sequences, few parameters) and `states` (many thin layers, eight
tokens). Ranks above --max-ranks are left out (P=4 x D=2 needs 8).

    python bench/memory_model.py [--models activations,states] [--pp 1,2,4] [--dp 1,2] [--max-ranks 4]
        [--schedules 1f1b,zb-v] [--zero 0,3] [--dtype bf16] [--eval-batches N] [--sample-tokens N]
        [--zero3-prefetch D] [--quantize-grads int8] [--quantize-weights int8] [--hierarchical]
        [--secondary-shard] [--offload]

With --offload every case runs with --offload optimizer; on CPU ranks the host is the device, so a
rank's measured peak holds its host buffers too and is held against the predicted device peak plus
host bytes (memory/offload.py), phase by phase.

A rank's measured peak is the most of its phases (the first step, the evaluation after it, the text
sample when there is one: P = 1 and --sample-tokens); each phase's figures are kept beside.

Prints one line a case (the worst rank's ratio), then the summary: cases and ranks, how many ranks
within 10%, the median error, the worst over- and under-prediction (with and without recompute), and
writes every rank's figures to bench/results/memory_model/memory_model.json, one line a case.

    python bench/memory_model.py --repredict bench/results/memory_model/memory_model.json

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
from pipezero.memory.model import predict  # noqa: E402
from pipezero.memory.runs import phase_peaks  # noqa: E402
from pipezero.files import atomic_write_bytes  # noqa: E402
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
             out: str, dtype: str = "fp32", eval_batches: int = 1, sample_tokens: int = 0, prefetch: int = 1,
             quant: dict | None = None) -> dict:
    """One case's settings; `quant`: its quantized traffic (`quantize_grads`, `quantize_weights`,
    `hierarchical`, as QUANT_KEYS), none by default."""
    return {**MODELS[model], **quant_settings(quant or {}, dp), "model.preset": "tiny", "data.path": data,
            "data.tokenizer": "bytes",
            "run.dtype": dtype,
            # read only by ZeRO-3 layer by layer (P = 1 here): elsewhere the setting is refused as unread
            **({"parallel.zero3_prefetch": prefetch} if zero == 3 and pp == 1 else {}),
            "data.packing": "concat", "parallel.pp": pp, "parallel.dp": dp, "parallel.zero": zero,
            "parallel.schedule": kind.value, "parallel.microbatches": 2 * pp,
            "parallel.virtual_stages": default_virtual(kind, None) if pp > 1 else 1, "parallel.recompute": recompute,
            "parallel.timeout_s": 120.0, "run.max_steps": 1, "run.out": out, "run.progress": False,
            "run.sample_tokens": sample_tokens if pp == 1 else 0,  # no sample with a pipeline
            "run.eval_every": 0, "run.eval_batches": eval_batches,
            "run.threads": 1}


# a case's options beyond its layout (quantized traffic, two levels, hpZ, offload), as its row keeps
# them, and the setting each becomes
QUANT_KEYS = {"quantize_grads": "parallel.quantize_grads", "quantize_weights": "parallel.quantize_weights",
              "hierarchical": "parallel.hierarchical", "secondary_shard": "parallel.secondary_shard",
              "offload": "parallel.offload"}


def quant_settings(quant: dict, dp: int) -> dict:
    """A row's quantized traffic as settings; two-level reductions and hpZ split the D replicas into
    two nodes of D / 2 (the emulated nodes of one host)."""
    out = {QUANT_KEYS[k]: v for k, v in quant.items() if v and v != "none"}
    if out.get("parallel.hierarchical") or out.get("parallel.secondary_shard"):
        out["parallel.ranks_per_node"] = max(1, dp // 2)
    return out


def row_quant(row: dict) -> dict:
    return {k: row[k] for k in QUANT_KEYS if row.get(k) not in (None, "none", False)}


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
    ap.add_argument("--quantize-grads", default="none", choices=["none", "int8", "int4"],
                    help="gradient reductions travel quantized (D > 1 cases only)")
    ap.add_argument("--quantize-weights", default="none", choices=["none", "int8", "int4"],
                    help="weight gathers travel quantized (ZeRO 1-3 cases only)")
    ap.add_argument("--hierarchical", action="store_true", help="two-level reductions, D / 2 ranks a node")
    ap.add_argument("--secondary-shard", action="store_true",
                    help="hpZ: ZeRO-3 layer by layer keeps a node's share, D / 2 ranks a node (P = 1, D > 2 cases only)")
    ap.add_argument("--offload", action="store_true", help="every case with --offload optimizer")
    ap.add_argument("--data", help="a folder of text (default: the standard library's first ~400 KB)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory_model" / "memory_model.json"))
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
                                              row.get("sample_tokens", 0), row.get("zero3_prefetch", 1),
                                              row_quant(row)))
            for r, pred in zip(row["ranks"], predict(cfg, cuda=False)):
                r.update(rank_figures(pred, r.get("measured_phases") or {"train": r["measured_peak_bytes"]}))
            show(row)
        report(rows, args.out)
        return
    kinds = [ScheduleKind(k) for k in args.schedules.split(",")] if args.schedules else None
    todo = [{**c, "dtype": args.dtype, "eval_batches": args.eval_batches, "sample_tokens": args.sample_tokens,
             "zero3_prefetch": args.zero3_prefetch, **quant_of(args, c)}
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
                                                c["sample_tokens"], c["zero3_prefetch"], row_quant(c)))
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


def quant_of(args: argparse.Namespace, case: dict) -> dict:
    """The quantized traffic --quantize-grads/--quantize-weights/--hierarchical/--secondary-shard ask
    of `case`, where the layout has it (gradients: D > 1; weights: ZeRO 1-3; two levels: D > 2; hpZ:
    ZeRO-3 layer by layer, D > 2)."""
    out: dict = {}
    if case["dp"] > 1 and args.quantize_grads != "none":
        out["quantize_grads"] = args.quantize_grads
    if case["dp"] > 1 and case["zero"] > 0 and args.quantize_weights != "none":
        out["quantize_weights"] = args.quantize_weights
    if case["dp"] > 2 and args.hierarchical:
        out["hierarchical"] = True
    if case["dp"] > 2 and case["zero"] == 3 and case["pp"] == 1 and args.secondary_shard:
        out["secondary_shard"] = "node"
    if getattr(args, "offload", False):
        out["offload"] = "optimizer"
    return out


def rank_figures(pred, measured: dict[str, int]) -> dict:
    """One rank's predicted and measured peaks (the most over phases) and each phase's. A CPU rank's
    host is its device: its host bytes (--offload optimizer's buffers, alive the whole run) are in
    every phase it measures, so they are added to each predicted one (and kept apart as well)."""
    peak = max(measured.values())
    host = getattr(pred, "host_peak_bytes", 0)
    return {"predicted_peak_bytes": pred.peak_bytes + host, "measured_peak_bytes": peak,
            "ratio": (pred.peak_bytes + host) / peak, "at": pred.at, "measured_phases": measured,
            "predicted_phases": {k: v + host for k, v in getattr(pred, "phases", {}).items()},
            "predicted_device_bytes": pred.peak_bytes, "predicted_host_bytes": host}


def show(row: dict) -> None:
    worst = max(row["ranks"], key=lambda x: abs(x["ratio"] - 1))
    print(f"{row['model']:<11} {row['schedule']:<16} P={row['pp']} D={row['dp']} Z{row['zero']} "
          f"recompute={int(row['recompute'])}{''.join(f' {k}={v}' for k, v in row_quant(row).items())}  worst rank {worst['rank']}: predicted "
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
    quant = "".join(f" {k}={v}" for k, v in row_quant(row).items())
    return (f"{row['model']} {row['schedule']} P={row['pp']} D={row['dp']} Z{row['zero']}"
            f"{' recompute' if row['recompute'] else ''}{quant} rank {rank}")


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
    quantized = any(row_quant(row) for row in results["rows"])
    for row in results["rows"]:  # with quantized traffic, by what is quantized and the ZeRO stage instead
        key = (", ".join(f"{k} {v}" for k, v in row_quant(row).items()) + f" ({row.get('dtype', 'fp32')})",
               row["zero"], row["model"]) if quantized else (row["model"], row["schedule"], row["recompute"])
        groups.setdefault(key, []).extend(r["ratio"] for r in row["ranks"])
    label = "options" if any("offload" in row_quant(row) for row in results["rows"]) else "quantized"
    head = f"| {label} | ZeRO | model |" if quantized else "| model | schedule | recompute |"
    lines = [f"{head} ranks | lowest | median | highest |", "|---|---|---|---|---|---|---|"]
    for (a, b, c), ratios in sorted(groups.items()):
        c = c if quantized else "yes" if c else "no"
        lines.append(f"| {a} | {b} | {c} | {len(ratios)} | {min(ratios):.3f} | "
                     f"{statistics.median(ratios):.3f} | {max(ratios):.3f} |")
    lines.append("")
    lines += [line + "." for line in summary_lines(results["rows"])]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
