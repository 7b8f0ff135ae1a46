"""Stages balanced by memory (`--partition memory`, pipezero/memory/partition.py) against the
default uniform cut, on a 4-stage 1F1B run where activations matter: each rank's measured peak of
the first step (`train --memory-profile`; on CPU the profiler's live tensor bytes) beside the memory
model's prediction, and the largest over the smallest per-rank peak before and after. Then how long
the policy's search takes on larger layouts (the planner and every rank's start call it).

    python bench/memory_partition.py [--preset small] [--seq-len 1024] [--microbatches 8] [--micro-batch-size 4]

Prints one line a policy and writes bench/results/memory_partition/memory_partition.json. `--repredict FILE`
predicts a results file's layouts again (after a change to the memory model), keeping its
measurements, and times the searches again; it trains nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # rank_spawner.py

from pipezero.config import Partition  # noqa: E402
from pipezero.data import write_stdlib_sample  # noqa: E402
from pipezero.settings import build_config  # noqa: E402
from pipezero.memory.model import predict  # noqa: E402
from pipezero.memory.partition import resolve, search  # noqa: E402
from pipezero.memory.runs import phase_peaks  # noqa: E402
from pipezero.files import atomic_write_json  # noqa: E402
from rank_spawner import run_ranks  # noqa: E402

MIB = 2**20
MEASURED = (Partition.UNIFORM, Partition.MEMORY)  # trained; params and cost are predicted only
# layouts the search is timed on: (name, settings) of the 7B preset at 4096 tokens
TIMED = [
    ("7b P=8 1f1b M=32", {"parallel.pp": 8, "parallel.microbatches": 32}),
    ("7b P=8 D=8 ZeRO-3 1f1b M=32", {"parallel.pp": 8, "parallel.dp": 8, "parallel.zero": 3, "parallel.microbatches": 32}),
    ("7b P=8 interleaved V=2 M=32", {"parallel.pp": 8, "parallel.microbatches": 32,
                                     "parallel.schedule": "interleaved-1f1b", "parallel.virtual_stages": 2}),
    ("7b P=4 D=16 ZeRO-2 zb-v M=64", {"parallel.pp": 4, "parallel.dp": 16, "parallel.zero": 2,
                                     "parallel.microbatches": 64, "parallel.schedule": "zb-v",
                                     "parallel.virtual_stages": 2}),
]


def settings(args: argparse.Namespace, policy: Partition, data: str, out: str) -> dict:
    return {"model.preset": args.preset, "data.path": data, "data.tokenizer": "bytes", "data.packing": "concat",
            "data.seq_len": args.seq_len, "parallel.pp": 4, "parallel.schedule": "1f1b",
            "parallel.microbatches": args.microbatches, "parallel.micro_batch_size": args.micro_batch_size,
            "parallel.partition": policy.value, "parallel.timeout_s": 600.0, "run.max_steps": 1, "run.out": out,
            "run.progress": False, "run.sample_tokens": 0, "run.eval_every": 0, "run.eval_batches": 1,
            "run.threads": 1, "run.device": "cpu"}


def spread(peaks: list[int]) -> float:
    return max(peaks) / min(peaks)


def timed_search() -> list[dict]:
    """Seconds and memory-model walks of one search from a cold cache, on layouts a planner weighs."""
    out = []
    for name, extra in TIMED:
        cfg = build_config(None, {"model.preset": "7b", "data.seq_len": 4096, "parallel.partition": "memory",
                                  **{k: str(v) for k, v in extra.items()}})
        t0 = time.perf_counter()
        chosen = search(cfg, cuda=True)
        took = time.perf_counter() - t0
        uniform = [r.peak_bytes for r in predict(replace(cfg, parallel=replace(cfg.parallel, partition=Partition.UNIFORM)),
                                                  cuda=True)]
        out.append({"layout": name, "seconds": took, "walks": chosen.walks, "counts": list(chosen.counts),
                    "largest_gib": {"uniform": max(uniform) / 2**30, "memory": max(chosen.peaks) / 2**30}})
        print(f"search {name:<32} {took:6.2f} s, {chosen.walks:4d} walks; largest predicted peak "
              f"{max(uniform) / 2**30:6.1f} GiB uniform -> {max(chosen.peaks) / 2**30:6.1f} GiB, cuts "
              f"{','.join(map(str, chosen.counts))}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--data", help="a folder of text (default: the standard library's first ~400 KB)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory_partition" /
                                          "memory_partition.json"))
    ap.add_argument("--repredict", help="a results JSON: predict its layouts again, measure nothing")
    args = ap.parse_args()
    if args.repredict:
        old = json.loads(Path(args.repredict).read_text())
        for k in ("preset", "seq_len", "microbatches", "micro_batch_size"):
            setattr(args, k, old["layout"][k])
        for row in old["rows"]:
            resolved = resolve(build_config(None, settings(args, Partition(row["policy"]), str(Path(__file__).parent),
                                                           "-")), cuda=False)
            layers = resolved.parallel.stage_layers or [b - a for a, b in _bounds(resolved)]
            predicted = [r.peak_bytes for r in predict(resolved, cuda=False)]
            if "measured_peak_bytes" in row and layers != row["stage_layers"]:
                raise SystemExit(f"{row['policy']}: the policy now cuts {layers}, measured {row['stage_layers']}: "
                                 f"measure again (without --repredict)")
            row.update(stage_layers=layers, predicted_peak_bytes=predicted, predicted_ratio=spread(predicted))
            print(f"{row['policy']:<8} layers {','.join(map(str, layers)):<9} predicted MiB "
                  f"{' '.join(f'{x / MIB:6.1f}' for x in predicted)}  largest/smallest {spread(predicted):.2f}")
        old["searches"] = timed_search()
        atomic_write_json(Path(args.out), old)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(write_stdlib_sample(Path(tmp) / "corpus"))
        cfgs = {p: build_config(None, settings(args, p, data, f"{tmp}/{p.value}")) for p in Partition}
        t0 = time.perf_counter()
        measured = run_ranks(phase_peaks, 4, [cfgs[p] for p in MEASURED], timeout=3600)
        run_s = time.perf_counter() - t0
        for p, cfg in cfgs.items():
            resolved = resolve(cfg, cuda=False)
            layers = resolved.parallel.stage_layers or [b - a for a, b in _bounds(resolved)]
            predicted = [r.peak_bytes for r in predict(resolved, cuda=False)]
            row = {"policy": p.value, "stage_layers": layers, "predicted_peak_bytes": predicted,
                   "predicted_ratio": spread(predicted)}
            if p in MEASURED:
                got = [max(measured[r][MEASURED.index(p)].values()) for r in range(4)]  # the most of its phases
                row.update(measured_peak_bytes=got, measured_ratio=spread(got))
            rows.append(row)
            print(f"{p.value:<8} layers {','.join(map(str, layers)):<9} predicted MiB "
                  f"{' '.join(f'{x / MIB:6.1f}' for x in predicted)}  largest/smallest {spread(predicted):.2f}"
                  + (f"   measured MiB {' '.join(f'{x / MIB:6.1f}' for x in row['measured_peak_bytes'])}  "
                     f"largest/smallest {row['measured_ratio']:.2f}" if p in MEASURED else ""), flush=True)
    by = {r["policy"]: r for r in rows}
    print(f"measured largest/smallest per-rank peak: {by['uniform']['measured_ratio']:.2f} (uniform) -> "
          f"{by['memory']['measured_ratio']:.2f} (memory); largest peak "
          f"{max(by['uniform']['measured_peak_bytes']) / MIB:.1f} -> {max(by['memory']['measured_peak_bytes']) / MIB:.1f} MiB "
          f"(two 1-step runs on 4 ranks, {run_s:.0f} s)")
    searches = timed_search()
    atomic_write_json(Path(args.out), {"layout": {"preset": args.preset, "pp": 4, "schedule": "1f1b",
                                                  "microbatches": args.microbatches,
                                                  "micro_batch_size": args.micro_batch_size, "seq_len": args.seq_len,
                                                  "device": "cpu", "dtype": "fp32"},
                                       "rows": rows, "searches": searches})


def _bounds(cfg):
    from pipezero.models.presets import layer_costs, layer_param_counts
    from pipezero.parallel.partition import cut_bounds

    p = cfg.parallel
    return cut_bounds(layer_param_counts(cfg.model), lambda: layer_costs(cfg.model, cfg.data.seq_len), p.pp * p.virtual_stages,
               p.partition, p.stage_layers)


if __name__ == "__main__":
    main()
