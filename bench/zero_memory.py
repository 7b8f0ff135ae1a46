"""Peak resident memory of each rank per ZeRO stage, measured from outside, beside the paper's formula.

    python bench/zero_memory.py [--preset base] [--dp 2] [--pp 1] [--microbatches 1] [--grad-reduce step]
    python bench/zero_memory.py --preset small --pp 2 --microbatches 4 --stages "" --torch "" --schedules 1f1b,zb-h1,zb-v

For each ZeRO stage a fresh `pipezero train --nproc P*D` job runs a few steps in fp32; this script
polls every rank process's VmHWM (the kernel's high-water mark of resident memory, /proc/PID/status)
until it exits. The saving of stage z against stage 0, per parameter of the rank's stage, is printed
beside the ZeRO paper's prediction for plain fp32 Adam (stage 1: 8/D... see zero/accounting.py).
Results go to bench/results/zero_memory/zero_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipezero.config import ModelConfig  # noqa: E402
from pipezero.models import apply_preset, param_count  # noqa: E402
from pipezero.zero.accounting import paper_bytes_per_param  # noqa: E402


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def vm_hwm(pid: int) -> tuple[int, int | None]:
    """(peak RSS bytes, pipezero rank or None) of a process."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return 0, None
    hwm = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    rank = next((int(e.split(b"=")[1]) for e in environ if e.startswith(b"RANK=")), None)
    return hwm, rank


def poll(cmd: list[str], what: str) -> dict[int, int]:
    """Run `cmd`, polling the peak RSS of every rank process below it until it exits."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))  # same allocator setting for every run
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        for pid in descendants(proc.pid):
            hwm, rank = vm_hwm(pid)
            if rank is not None:
                peaks[rank] = max(peaks.get(rank, 0), hwm)
        time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(f"{what} failed:\n{proc.stderr.read().decode()[-3000:]}")
    return peaks


def run_torch(args: argparse.Namespace, mode: str) -> dict[int, int]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.dp}",
           str(Path(__file__).parent / "torch_baselines.py"), "--mode", mode, "--preset", args.preset,
           "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    return poll(cmd, f"torch {mode}")


def run_stage(args: argparse.Namespace, zero: int, out: Path, schedule: str = "1f1b",
              layerwise: bool = False) -> dict[int, int]:
    """One `pipezero train` job; `layerwise` gathers ZeRO-3 layer by layer even inside a pipeline."""
    extra = ["--schedule", schedule, "--virtual-stages", "2" if schedule in V_SHAPED else "1"]
    if layerwise:
        out.mkdir(parents=True, exist_ok=True)
        (out / "layerwise.toml").write_text("[parallel]\nzero3_keep_gathered = false\n")
        extra += ["--config", str(out / "layerwise.toml")]
    cmd = [sys.executable, "-m", "pipezero.cli", "train", *extra, "--preset", args.preset, "--nproc", str(args.pp * args.dp),
           "--pp", str(args.pp), "--dp", str(args.dp), "--zero", str(zero), "--microbatches", str(args.microbatches),
           "--micro-batch-size", "1", "--seq-len", str(args.seq_len), "--max-steps", str(args.steps),
           "--tokenizer", "bytes", "--eval-every", "0", "--sample-tokens", "0", "--no-save-final", "--grad-reduce", args.grad_reduce, "--out", str(out),
           "--bucket-mb", str(args.bucket_mb), "--no-progress"]
    return poll(cmd, f"zero {zero} {schedule}")


V_SHAPED = ("zb-v", "dualpipe-v", "interleaved-1f1b", "looped-bfs")


def schedules_side_by_side(args: argparse.Namespace, tmp: str) -> dict:
    """ZeRO-3 per schedule of `--schedules`, the chunk kept gathered over its micro-batches (the
    default with P > 1) and layer by layer: peak RSS per rank, and the most parameter bytes each rank
    held gathered at once (summary.json, exact where RSS also holds the corpus and torch). Split
    backward (zb-*) releases what B gathered after B and W, as a fused backward does."""
    rows = {}
    print(f"\nZeRO-3, P={args.pp} D={args.dp} M={args.microbatches}: per rank, MiB")
    print(f"{'schedule':>10}  {'mode':<15}{'peak RSS':>28}{'peak gathered params':>36}")
    for schedule in args.schedules.split(","):
        for mode in ("kept gathered", "layer by layer"):
            out = Path(tmp) / f"{schedule}-{mode.replace(' ', '-')}"
            rss = run_stage(args, 3, out, schedule, layerwise=mode == "layer by layer")
            summary = json.loads((out / "summary.json").read_text())
            gathered = [r["zero3_gathered_peak_bytes"]["run"] for r in summary["ranks"]]
            rows.setdefault(schedule, {})[mode] = {"peak_rss_bytes_per_rank": rss, "peak_gathered_bytes_per_rank": gathered}
            show_rss = " ".join(f"{rss[r] / 2**20:.0f}" for r in sorted(rss))
            show_gathered = " ".join(f"{g / 2**20:.1f}" for g in gathered)
            print(f"{schedule:>10}  {mode:<15}{show_rss:>28}{show_gathered:>36}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="base")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--grad-reduce", default="step", choices=["step", "microbatch"])
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="gradient bucket size: up to two full buckets are in flight at stages 2-3")
    ap.add_argument("--schedules", default="",
                    help="also ZeRO-3 per schedule side by side, e.g. 1f1b,zb-h1,zb-v (needs --pp > 1)")
    ap.add_argument("--torch", default="ddp,zero1,fsdp2", help="torch baselines to run beside (P=1 only; '' for none)")
    args = ap.parse_args()
    model = apply_preset(ModelConfig(), args.preset)
    psi = param_count(model) / args.pp  # parameters per pipeline stage (uniform split, approximate)
    peaks, by_schedule = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.schedules:
            by_schedule = schedules_side_by_side(args, tmp)
        for z in (int(x) for x in args.stages.split(",") if x):
            peaks[z] = run_stage(args, z, Path(tmp) / f"z{z}")
            print(f"zero {z}: peak RSS per rank (MiB): {[round(peaks[z][r] / 2**20) for r in sorted(peaks[z])]}",
                  flush=True)
    base = peaks.get(0)
    rows = {}
    print(f"\n{args.preset}: {param_count(model) / 1e6:.1f}M params, P={args.pp} D={args.dp} M={args.microbatches} "
          f"fp32, grad-reduce={args.grad_reduce}, buckets of {args.bucket_mb:g} MB")
    print(f"{'stage':>5}{'peak MiB (max rank)':>21}{'saved B/param':>15}{'predicted':>11}{'ratio':>8}")
    for z, per_rank in peaks.items():
        peak = max(per_rank.values())
        predicted = paper_bytes_per_param(0, args.dp, False) - paper_bytes_per_param(z, args.dp, False)
        saved = (max(base.values()) - peak) / psi if base else float("nan")
        ratio = saved / predicted if predicted else float("nan")
        rows[z] = {"peak_rss_bytes_per_rank": per_rank, "saved_bytes_per_param": saved,
                   "predicted_saved_bytes_per_param": predicted, "measured_over_predicted": ratio}
        print(f"{z:>5}{peak / 2**20:>21.0f}{saved:>15.2f}{predicted:>11.2f}{ratio:>8.2f}")
    theirs = {}
    if args.torch and args.pp == 1 and args.microbatches == 1:
        print(f"\ntorch on the same model, D={args.dp}: saved vs pipezero stage 0, bytes a parameter")
        for mode in args.torch.split(","):
            per_rank = run_torch(args, mode)
            peak = max(per_rank.values())
            saved = (max(base.values()) - peak) / psi if base else float("nan")
            theirs[mode] = {"peak_rss_bytes_per_rank": per_rank, "saved_bytes_per_param_vs_our_stage0": saved}
            print(f"{mode:>6}{peak / 2**20:>21.0f}{saved:>15.2f}")
    suffix = "" if args.bucket_mb == 25 else f"_bucket{args.bucket_mb:g}"
    out = Path(__file__).parent / "results" / "zero_memory" / \
        f"zero_memory_{args.preset}_pp{args.pp}_dp{args.dp}_{args.grad_reduce}{suffix}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "params_per_stage": psi, "stages": rows, "torch": theirs,
                               "zero3_by_schedule": by_schedule},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
