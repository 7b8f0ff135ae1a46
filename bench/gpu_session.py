"""The parts of bench/gpu_session.sh: what one GPU can prove about layouts, each part its own JSON.

    python bench/gpu_session.py layouts --json F --out DIR   # (a) layouts of 2-4 ranks sharing the GPU
    python bench/gpu_session.py fit --json F --out DIR       # (b) the fit check's boundary
    python bench/gpu_session.py offload --json F --out DIR   # (d) --offload optimizer: its memory and cost
    python bench/gpu_session.py summary --dir DIR            # one table of every part, and DIR/summary.json

(c) is bench/gpu_step.py. `--dry-run` runs each part on CPU ranks at a toy size with the shared-GPU
path forced (`--share-device on`): the same commands and checks, so the script cannot rot.

Every run goes through the `pipezero` command as a user would start it (`--nproc N` ranks; with one
GPU and N > 1 they share it, `--share-device auto`), so what is proven is what a user gets.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GIB = 2**30
MEMORY_TOLERANCE = 0.10  # each rank's predicted peak within 10% of the measured one (issue 45)


# --- (a) layouts -------------------------------------------------------------------------------
# 2-4 ranks on the one GPU: every schedule family the runtime plays differently (plain, V-shaped,
# split backward, interleaved), every ZeRO stage, fp32 and bf16.
LAYOUTS = [
    dict(pp=2, dp=1, schedule="1f1b", m=4, zero=0, dtype="fp32"),
    dict(pp=2, dp=1, schedule="zb-v", m=4, zero=1, dtype="bf16"),
    dict(pp=2, dp=1, schedule="dualpipe-v", m=4, zero=0, dtype="bf16"),
    dict(pp=1, dp=2, schedule="1f1b", m=2, zero=2, dtype="bf16"),
    dict(pp=3, dp=1, schedule="gpipe", m=6, zero=0, dtype="fp32"),
    dict(pp=1, dp=4, schedule="1f1b", m=2, zero=3, dtype="bf16"),
    dict(pp=2, dp=2, schedule="interleaved-1f1b", m=4, zero=1, dtype="bf16"),
    dict(pp=2, dp=2, schedule="zb-h1", m=4, zero=3, dtype="fp32"),
]
GPU_MODEL = ["--preset", "base", "--seq-len", "512", "--micro-batch-size", "4"]
CPU_MODEL = ["--preset", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--device", "cpu",
             "--share-device", "on"]  # the shared-GPU path forced on CPU ranks
DATA = ["--tokenizer", "bytes"]


def pipezero(args: list[str], timeout_s: float) -> dict[str, Any]:
    """Run `pipezero ARGS`; its exit code, seconds and the tail of what it printed. Past `timeout_s`
    it gets SIGTERM, on which the launcher stops its ranks (pipezero/job.py): none is left holding
    the GPU for the next run."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "pipezero.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            text, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        code, text = 124, f"{text or ''}\ntimed out after {timeout_s:g} s"
    return {"code": code, "seconds": round(time.perf_counter() - t0, 1), "tail": text[-3000:],
            "shared_line": next((ln for ln in text.splitlines() if ln.startswith("pipezero: ") and (
                " ranks share " in ln or "--share-device on with CPU ranks" in ln)), None)}


def layout_flags(lay: dict) -> list[str]:
    from pipezero.config import ScheduleKind
    from pipezero.schedules.registry import default_virtual

    v = default_virtual(ScheduleKind(lay["schedule"])) if lay["pp"] > 1 else 1
    if lay["schedule"] == "interleaved-1f1b":
        v = 2
    return ["--nproc", str(lay["pp"] * lay["dp"]), "--pp", str(lay["pp"]), "--dp", str(lay["dp"]),
            "--schedule", lay["schedule"], "--microbatches", str(lay["m"]), "--zero", str(lay["zero"]),
            "--dtype", lay["dtype"], "--virtual-stages", str(v)]


def memory_rows(summary: dict, with_host: bool = False) -> list[dict]:
    """Each rank's predicted and measured peak (summary.json `memory`, --memory-profile) and their error;
    `with_host`: the prediction plus the rank's --offload host bytes (a CPU rank's one memory)."""
    rows = []
    host = {r.get("rank", i): r.get("host_bytes") or 0 for i, r in enumerate(summary.get("ranks", []))}
    for r in summary.get("memory", {}).get("ranks", []):
        pred, meas = r.get("predicted_peak_bytes"), r.get("measured_peak_bytes")
        pred = pred + host.get(r["rank"], 0) if pred and with_host else pred
        err = None if not pred or not meas else (pred - meas) / meas
        rows.append({"rank": r["rank"], "predicted_gib": pred and pred / GIB, "measured_gib": meas and meas / GIB,
                     "error": err, "within": err is not None and abs(err) <= MEMORY_TOLERANCE})
    return rows


def part_layouts(args: argparse.Namespace) -> dict:
    model = CPU_MODEL if args.dry_run else GPU_MODEL
    layouts = LAYOUTS[:args.layouts]
    rows = []
    for i, lay in enumerate(layouts):
        out = Path(args.out) / f"layout{i}"
        run = pipezero(["verify", *layout_flags(lay), *model, *DATA, "--steps", str(args.steps), "--memory-profile",
                        "--out", str(out)], args.each_s)
        verdict = _read(out / "verify.json") or {}
        memory = memory_rows(_read(out / "layout" / "summary.json") or {})
        row = {"layout": lay, **run, "matches_one_process": bool(verdict.get("ok")), "memory": memory,
               "memory_within": bool(memory) and all(m["within"] for m in memory),
               "worst_memory_error": max((abs(m["error"]) for m in memory if m["error"] is not None), default=None)}
        row["shared"] = run["shared_line"] is not None  # rank 0's line: the ranks did share the device
        row["ok"] = row["code"] == 0 and row["shared"] and row["matches_one_process"] and row["memory_within"]
        rows.append(row)
        _write(args.json, {"part": "a", "ok": False, "partial": True, "rows": rows})  # what a timeout leaves
        print(f"(a) {describe(lay)}: {'ok' if row['ok'] else 'FAILED'} (shared: {row['shared']}, matches one "
              f"process: {row['matches_one_process']}, worst memory error {_pct(row['worst_memory_error'])}, "
              f"{run['seconds']} s)", flush=True)
        if not row["ok"] and row["code"]:
            print(run["tail"][-1500:], flush=True)
    return {"part": "a", "what": f"{len(layouts)} layout{'s' * (len(layouts) != 1)} of 2-4 ranks sharing one device, "
                                 f"each against one process, "
                                 f"each rank's predicted peak within {MEMORY_TOLERANCE:.0%}",
            "ok": bool(rows) and all(r["ok"] for r in rows), "rows": rows}


# --- (b) the fit check's boundary --------------------------------------------------------------
def predicted_peak(flags: dict[str, Any], cuda: bool) -> int:
    """The memory model's largest rank peak for a layout given as settings."""
    from pipezero.settings import build_config
    from pipezero.memory.model import predict
    from pipezero.memory.partition import resolve

    cfg = build_config(None, flags)
    return max(r.peak_bytes for r in predict(resolve(cfg, cuda), cuda))


def boundary_layouts(base: dict[str, Any], cap_bytes: float, admitted_bytes: float, cuda: bool) -> tuple[int, int]:
    """(micro-batch size predicted well over the rank's real cap, the largest predicted to fit with
    10% to spare): the first must run out of memory when forced, the second must train."""
    over = fits = None
    for b in range(1, 257):
        peak = predicted_peak({**base, "parallel.micro_batch_size": b}, cuda)
        if peak <= 0.9 * admitted_bytes:
            fits = b
        if peak > 1.25 * cap_bytes:
            over = b
            break
    if over is None or fits is None:
        raise SystemExit(f"no micro-batch size from 1 to 256 crosses the cap of {cap_bytes / GIB:.2f} GiB")
    return over, fits


def part_fit(args: argparse.Namespace) -> dict:
    from pipezero.schedules.limits import FIT_MARGIN

    ranks = 1 if args.dry_run else 2
    base = {"model.preset": "tiny" if args.dry_run else "1b", "data.seq_len": 32 if args.dry_run else 2048,
            "data.tokenizer": "bytes", "parallel.dp": ranks, "parallel.microbatches": 1,
            "run.dtype": "fp32" if args.dry_run else "bf16"}
    if args.dry_run:  # no allocator cap on CPU: a made-up one, to exercise the check's two sides
        cap = 1.5 * predicted_peak({**base, "parallel.micro_batch_size": 2}, False)
    else:
        import torch

        cap = torch.cuda.get_device_properties(0).total_memory / ranks  # each rank's share (parallel/device.py)
    admitted = cap * (1 - FIT_MARGIN)
    over, fits = boundary_layouts(base, cap, admitted, not args.dry_run)
    common = ["--nproc", str(ranks), "--dp", str(ranks), "--microbatches", "1", "--max-steps", "2", "--no-progress",
              "--eval-every", "0", "--sample-tokens", "0", "--no-save-final", "--memory-profile", *DATA,
              "--preset", base["model.preset"], "--seq-len", str(base["data.seq_len"]), "--dtype", base["run.dtype"]]
    if args.dry_run:  # one rank has nothing to share: the path is forced only where ranks are several
        common += ["--device", "cpu", *(["--share-device", "on"] if ranks > 1 else [])]
    cap_flag = ["--gpu-memory", f"{cap / GIB:.6g}"] if args.dry_run else []
    out = Path(args.out)
    refused = pipezero(["train", *common, "--micro-batch-size", str(over), *cap_flag, "--out", str(out / "over")],
                       args.each_s)
    # forced past the check: --gpu-memory far above the share lets the layout start; the allocator's
    # cap (torch.cuda.set_per_process_memory_fraction, 1/ranks of the GPU) still holds each rank
    forced = pipezero(["train", *common, "--micro-batch-size", str(over), "--gpu-memory", "100000",
                       "--out", str(out / "forced")], args.each_s)
    fitting = pipezero(["train", *common, "--micro-batch-size", str(fits), *cap_flag, "--out", str(out / "fits")],
                       args.each_s)
    oom = "out of memory" in forced["tail"].lower() or "OutOfMemoryError" in forced["tail"]
    rows = [
        {"check": f"predicted over its cap (B={over}): refused before start", **refused,
         "ok": refused["code"] == 2 and "does not fit" in refused["tail"]},
        {"check": "the same forced past the check (--gpu-memory 100000): " + (
            "trains (CPU ranks have no allocator cap; on a GPU: out of memory)" if args.dry_run else "out of memory"),
         **forced, "ok": (forced["code"] == 0) if args.dry_run else (forced["code"] != 0 and oom)},
        {"check": f"predicted to fit with 10% to spare (B={fits}): trains", **fitting,
         "ok": fitting["code"] == 0,
         "memory": memory_rows(_read(out / "fits" / "summary.json") or {})},
    ]
    for r in rows:
        print(f"(b) {r['check']}: {'ok' if r['ok'] else 'FAILED'} (exit {r['code']}, {r['seconds']} s)", flush=True)
        if not r["ok"]:
            print(r["tail"][-1500:], flush=True)
    return {"part": "b", "what": f"the fit check's boundary, {ranks} rank(s), cap {cap / GIB:.2f} GiB a rank",
            "cap_gib": cap / GIB, "admitted_gib": admitted / GIB, "ok": all(r["ok"] for r in rows), "rows": rows}


# --- (d) offload -------------------------------------------------------------------------------
def part_offload(args: argparse.Namespace) -> dict:
    """--offload optimizer on one device: (1) `1b` plain and offloaded side by side, each rank's
    predicted device peak against the allocator's and the step time of each; (2) a model that does
    not fit the device without offload (`7b` at 1,024 tokens; the limit is the device's memory, or
    the midpoint of the two predictions where the device holds both): plain refused by the fit
    check before start, offloaded admitted and training its first steps within the limit."""
    if args.dry_run:
        model = ["--preset", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--device", "cpu"]
        big = model
    else:
        model = ["--preset", "1b", "--seq-len", "2048", "--micro-batch-size", "2", "--dtype", "bf16"]
        big = ["--preset", "7b", "--seq-len", "1024", "--micro-batch-size", "1", "--dtype", "bf16"]
    common = ["--nproc", "1", *DATA, "--max-steps", "3", "--no-progress", "--eval-every", "0", "--sample-tokens", "0",
              "--no-save-final", "--memory-profile"]
    out, rows = Path(args.out), []
    for offload in ("none", "optimizer"):
        run = pipezero(["train", *common, *model, "--offload", offload, "--out", str(out / f"1b-{offload}")],
                       args.each_s)
        summary = _read(out / f"1b-{offload}" / "summary.json") or {}
        # CPU ranks' one memory holds the host's buffers too: measured against device + host bytes there
        memory = memory_rows(summary, with_host=args.dry_run)
        rows.append({"check": f"{model[1]} --offload {offload}: trains, each rank's device peak within "
                              f"{MEMORY_TOLERANCE:.0%} of predicted", **run, "memory": memory,
                     "step_s": _step_s(out / f"1b-{offload}"),
                     "host_bytes": [r.get("host_bytes") for r in summary.get("ranks", [])],
                     "ok": run["code"] == 0 and bool(memory) and all(m["within"] for m in memory)})
    plain_s, off_s = (r["step_s"] for r in rows)
    ratio = off_s / plain_s if plain_s and off_s else None
    flags = _settings(big)
    plain_peak, off_peak = (predicted_peak({**flags, "parallel.offload": o}, not args.dry_run) for o in ("none", "optimizer"))
    limit = (plain_peak + off_peak) / 2
    if not args.dry_run:
        import torch

        limit = min(limit, torch.cuda.get_device_properties(0).total_memory)
    cap = ["--gpu-memory", f"{limit / GIB:.6g}"]
    refused = pipezero(["train", *common, *big, *cap, "--offload", "none", "--out", str(out / "big-none")], args.each_s)
    trained = pipezero(["train", *common, *big, *cap, "--offload", "optimizer", "--max-steps", "2",
                        "--out", str(out / "big-optimizer")], args.each_s)
    memory = memory_rows(_read(out / "big-optimizer" / "summary.json") or {})
    rows += [{"check": f"{big[1]} plain, predicted {plain_peak / GIB:.1f} GiB: refused under {limit / GIB:.1f} GiB",
              **refused, "ok": refused["code"] == 2 and "does not fit" in refused["tail"]},
             {"check": f"{big[1]} --offload optimizer, predicted {off_peak / GIB:.1f} GiB: trains its first steps",
              **trained, "memory": memory,
              # on CPU ranks host and device are one memory: the measured peak holds both (no allocator cap)
              "ok": trained["code"] == 0 and bool(memory) and (
                  args.dry_run or all(m["measured_gib"] * GIB <= limit for m in memory))}]
    for r in rows:
        print(f"(d) {r['check']}: {'ok' if r['ok'] else 'FAILED'} (exit {r['code']}, {r['seconds']} s)", flush=True)
        if not r["ok"]:
            print(r["tail"][-1500:], flush=True)
    print(f"(d) step time offloaded / plain: {ratio:.2f}" if ratio else "(d) step time: not measured", flush=True)
    return {"part": "d", "what": "--offload optimizer: device peak predicted, step time beside plain, a model that "
                                 "fits only offloaded", "offload_over_plain_step": ratio,
            "ok": all(r["ok"] for r in rows), "rows": rows}


def _step_s(run: Path) -> float | None:
    """Mean step time of a run's steps after the first (metrics.jsonl), None where it has none."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    times = [r["step_time_s"] for r in map(json.loads, lines) if r.get("step", 0) > 1 and "step_time_s" in r]
    return sum(times) / len(times) if times else None


def _settings(flags: list[str]) -> dict[str, Any]:
    """`--preset 7b --seq-len 1024 ...` as the settings predicted_peak takes."""
    keys = {"--preset": "model.preset", "--seq-len": "data.seq_len", "--micro-batch-size": "parallel.micro_batch_size",
            "--dtype": "run.dtype", "--device": "run.device"}
    out = {keys[f]: v for f, v in zip(flags[::2], flags[1::2])}
    return {**out, "data.tokenizer": "bytes"}


def _help_text() -> str:
    done = subprocess.run([sys.executable, "-m", "pipezero.cli", "train", "--help"], capture_output=True, text=True)
    return done.stdout


# --- the summary -------------------------------------------------------------------------------
PARTS = {"a": "layouts.json", "b": "fit.json", "c": "gpu_step.json", "d": "offload.json"}


def step_rows(report: dict) -> tuple[bool, list[str]]:
    """(c): each shape's MFU beside the plain loop's."""
    lines = []
    ok = bool(report.get("cases"))
    for c in report.get("cases", []):
        if "error" in c:
            ok = False
            lines.append(f"{c['name']}: FAILED {c['error'][:80]}")
            continue
        lines.append(f"{c['name']}: MFU {c['pipezero']['mfu_6n']:.1%} (plain {c['plain']['mfu_6n']:.1%}), "
                     f"throughput {c['ratio']:.3f} of plain")
    lines += [f"skipped (budget): {n}" for n in report.get("skipped", [])]
    return ok, lines


def part_summary(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    codes = dict(kv.split("=", 1) for kv in args.codes.split(",") if kv) if args.codes else {}
    summary: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "dry_run": args.dry_run, "parts": {}}
    summary.update(_machine())
    table = []
    for part, name in PARTS.items():
        report = _read(folder / name)
        code = codes.get(part)
        if report is None:
            why = "timed out" if code in ("124", "137") else f"exited {code}" if code else "not run"
            summary["parts"][part] = {"ok": False, "result": f"no result ({why})"}
            table.append((part, "FAILED", f"no {name} ({why})"))
            continue
        if part == "c":
            ok, lines = step_rows(report)
            ok = ok and code in (None, "0")
        else:
            ok = bool(report.get("ok")) and code in (None, "0")
            lines = [report.get("skipped") or report.get("what", "")]
            lines += [_row_line(part, r) for r in report.get("rows", []) if _row_line(part, r)]
        if code in ("124", "137"):
            lines.append("timed out: the part's limit ended it (the rows above are what it finished)")
        summary["parts"][part] = {"ok": ok, "file": name, "lines": lines}
        table.append((part, "ok" if ok else "FAILED", lines[0] if lines else ""))
        table += [("", "", ln) for ln in lines[1:]]
    summary["ok"] = all(p["ok"] for p in summary["parts"].values())
    print(f"\n{'part':5s}{'result':8s}figures  ({summary.get('device')}, torch {summary.get('torch')}, "
          f"commit {summary.get('commit')})")
    for part, result, text in table:
        print(f"{part:5s}{result:8s}{text}")
    path = folder / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(path)
    print(f"{'all parts ok' if summary['ok'] else 'SOME PARTS FAILED'}; wrote {path}")
    return 0 if summary["ok"] else 1


def _row_line(part: str, r: dict) -> str:
    if part == "a":
        return (f"{describe(r['layout'])}: one process {'=' if r['matches_one_process'] else '!='}, memory worst "
                f"{_pct(r['worst_memory_error'])}{'' if r['memory_within'] else ' (over 10%)'}, {r['seconds']} s")
    if part == "b":
        return f"{r['check']}: {'ok' if r['ok'] else 'FAILED'} (exit {r['code']})"
    return f"exit {r.get('code')}, {r.get('seconds')} s"


def describe(lay: dict) -> str:
    return f"P{lay['pp']} D{lay['dp']} {lay['schedule']} ZeRO-{lay['zero']} {lay['dtype']} M={lay['m']}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}" if x < 0 else f"{x:.1%}"


def _machine() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "commit": commit or None}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: str, report: dict) -> None:
    """Whole or not at all: a part killed by its timeout leaves no half-written file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps({**report, **_machine()}, indent=1))
    tmp.replace(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", choices=["layouts", "fit", "offload", "summary"])
    ap.add_argument("--json", help="the part's result file")
    ap.add_argument("--out", default="runs/gpu_session", help="the part's run folders")
    ap.add_argument("--dir", help="summary: the folder of the parts' result files")
    ap.add_argument("--codes", help="summary: each part's exit code, a=0,b=124,...")
    ap.add_argument("--dry-run", action="store_true", help="CPU ranks, toy shapes, the shared-GPU path forced")
    ap.add_argument("--layouts", type=int, default=len(LAYOUTS), help="(a): the first N layouts")
    ap.add_argument("--steps", type=int, default=2, help="(a): steps each layout and its one process train")
    ap.add_argument("--each-s", type=float, default=120.0, help="seconds any one pipezero command may take")
    args = ap.parse_args(argv)
    if args.part == "summary":
        return part_summary(args)
    report = {"layouts": part_layouts, "fit": part_fit, "offload": part_offload}[args.part](args)
    _write(args.json, report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
