"""The planner's speed, and proof that a faster planner answers the same.

    python bench/planner_speed.py --save bench/results/planner_speed/planner_answers.json   # answers + timings, once
    python bench/planner_speed.py --check bench/results/planner_speed/planner_answers.json  # again: same answers?

Runs each request below as its own `pipezero` process (a cold process, as a user runs it: no cache
carried over) and measures its user CPU seconds (the process's rusage) and wall seconds. Each
answer is the command's stdout with the planner's own `"seconds"` (its wall clock) removed, its
stderr and exit status. `--save` writes the answers and timings; `--check` compares the answers
byte for byte with a saved file (exit 1 naming each that differs) and puts the saved timings beside
the new ones, with their ratio. Writes bench/results/planner_speed/planner_speed.json (or --out).

The requests: the planner on 7b/64, 70b/1024, small/8 and base/2 on CPU; the two of
tests/test_planner.py::test_plan_cli_json (the second finds nothing fits, so it also tries memory
cuts); a cluster of emulated ranks (cores, per-action overhead, network CPU, two-level reductions);
quantized traffic with a secondary shard; and `simulate --memory --json` on layouts of schedules
1f1b, zb-v, interleaved, dualpipe-v with ZeRO 0-3, recompute, bf16 and memory cuts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL = ["--top", "100000"]  # every fitting layout, not the ten shown: the whole answer is compared

REQUESTS: dict[str, list[str]] = {
    "plan 7b/64/80": ["plan", "--preset", "7b", "--gpus", "64", "--gpu-memory", "80", "--json", *ALL],
    "plan 70b/1024/80": ["plan", "--preset", "70b", "--gpus", "1024", "--gpu-memory", "80", "--json", *ALL],
    "plan small/8/16": ["plan", "--preset", "small", "--gpus", "8", "--gpu-memory", "16", "--json", *ALL],
    "plan base/2/80 cpu": ["plan", "--preset", "base", "--gpus", "2", "--gpu-memory", "80", "--device", "cpu",
                           "--seq-len", "128", "--global-batch", "2", "--json", *ALL],
    "plan 7b/64/80 gb256 T2048 (test)": ["plan", "--preset", "7b", "--gpus", "64", "--gpu-memory", "80",
                                         "--global-batch", "256", "--seq-len", "2048", "--json", "--top", "3"],
    "plan 70b/2/16 nothing fits (test)": ["plan", "--preset", "70b", "--gpus", "2", "--gpu-memory", "16"],
    "plan 7b/16/24 memory cuts": ["plan", "--preset", "7b", "--gpus", "16", "--gpu-memory", "24",
                                  "--global-batch", "64", "--json", *ALL],
    "plan small/8/2 emulated": ["plan", "--preset", "small", "--nodes", "2", "--gpus-per-node", "4", "--gpu-memory",
                                "2", "--device", "cpu", "--cores", "8", "--overhead-ms", "2", "--net-cpu", "10",
                                "--bandwidth", "10,0.05", "--seq-len", "256", "--global-batch", "16", "--json", *ALL],
    "plan 7b/64/40 quantized": ["plan", "--preset", "7b", "--nodes", "8", "--gpu-memory", "40", "--quantize-weights",
                                "int8", "--quantize-grads", "int4", "--secondary-shard", "node", "--global-batch",
                                "128", "--json", *ALL],
}
_MEM = ["simulate", "--memory", "--json", "--preset", "small", "--seq-len", "256", "--micro-batch-size", "2"]
REQUESTS.update({
    "simulate --memory 1f1b z0": [*_MEM, "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--zero", "0",
                                  "--dp", "2"],
    "simulate --memory zb-v z1 bf16": [*_MEM, "--schedule", "zb-v", "--pp", "4", "--microbatches", "8", "--zero", "1",
                                       "--dp", "2", "--dtype", "bf16"],
    "simulate --memory interleaved z2 recompute": [*_MEM, "--schedule", "interleaved-1f1b", "--pp", "2",
                                                   "--virtual-stages", "2", "--microbatches", "4", "--zero", "2",
                                                   "--dp", "4", "--recompute"],
    "simulate --memory dualpipe-v z3": [*_MEM, "--schedule", "dualpipe-v", "--pp", "4", "--microbatches", "8",
                                        "--zero", "3", "--dp", "2"],
    "simulate --memory P=1 z3 layerwise mb": [*_MEM, "--schedule", "1f1b", "--pp", "1", "--microbatches", "4",
                                              "--zero", "3", "--dp", "4", "--grad-reduce", "microbatch"],
    "simulate --memory zb-h1 z2 partition memory": [*_MEM, "--schedule", "zb-h1", "--pp", "4", "--microbatches", "8",
                                                    "--zero", "2", "--dp", "2", "--partition", "memory"],
})


def answer(out: str) -> str:
    """The command's stdout without the planner's wall clock (the only part that varies by run)."""
    try:
        data = json.loads(out)
    except ValueError:
        return out
    if isinstance(data, dict):
        data.pop("seconds", None)
    return json.dumps(data, indent=1, sort_keys=True)


def run(argv: list[str]) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "pipezero.cli", *argv], capture_output=True, text=True, env=env,
                       cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"argv": argv, "rc": p.returncode, "stdout": answer(p.stdout), "stderr": p.stderr,
            "user_s": round(after.ru_utime - before.ru_utime, 2), "wall_s": round(wall, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", type=Path, help="write the answers and timings here")
    ap.add_argument("--check", type=Path, help="compare the answers with this saved file")
    ap.add_argument("--only", help="run only requests whose name contains this")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/planner_speed/planner_speed.json")
    args = ap.parse_args()
    saved = json.loads(args.check.read_text()) if args.check else {}
    results, differ = {}, []
    for name, argv in REQUESTS.items():
        if args.only and args.only not in name:
            continue
        r = results[name] = run(argv)
        line = f"{name:45s} user {r['user_s']:6.2f} s  wall {r['wall_s']:6.2f} s  rc {r['rc']}"
        if name in saved:
            old = saved[name]
            same = all(old[k] == r[k] for k in ("argv", "rc", "stdout", "stderr"))
            if not same:
                differ.append(name)
            r["before_user_s"], r["before_wall_s"] = old["user_s"], old["wall_s"]
            r["speedup_user"] = round(old["user_s"] / max(r["user_s"], 1e-3), 2)
            r["same_answer"] = same
            line += f"  | before user {old['user_s']:6.2f} s ({r['speedup_user']:.1f}x)  " + \
                    ("same answer" if same else "ANSWER DIFFERS")
        print(line, flush=True)
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(json.dumps(results, indent=1) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {name: {k: v for k, v in r.items() if k not in ("stdout", "stderr")} for name, r in results.items()}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    if args.check:
        missing = [n for n in results if n not in saved]
        print(f"answers: {len(results) - len(differ) - len(missing)} of {len(results)} byte-identical"
              + (f"; DIFFER: {', '.join(differ)}" if differ else "") + (f"; not saved: {', '.join(missing)}"
                                                                          if missing else ""))
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
