"""One GPU: pipezero's whole training step beside a plain PyTorch loop on the same model and batches.

Both sides train the same decoder (pipezero's own layers, same seed, same initial weights) on the
same global batches with the same AdamW settings, bf16 autocast with fp32 weights and optimizer
state, gradient clipping, and one host read of the loss a step. The plain loop is what a careful
user writes by hand: torch's fused AdamW, `clip_grad_norm_(foreach=True)`, gradient accumulation
over the micro-batches; with `--compile` both sides compile every block. Step times are medians of
the steps after the warm-up, each closed by a device synchronisation. MFU counts 6 FLOPs per
non-embedding parameter and token (the head's matmul included) against the bf16 matmul rate
measured at the start of the same run; the model's own FLOPs (attention included) are given too.

Also recorded: which attention kernels SDPA ran (from the profiler, not assumed), each side's peak
device memory after the first step, and the losses (pipezero's first-step loss must equal the plain
loop's: both see the same weights and batch).

    python bench/gpu_step.py                       # base (seq 1024) and 1b (seq 2048), eager and compiled
    python bench/gpu_step.py --cases base --steps 8 --json /tmp/g.json

Sized for a short loan of a GPU machine: under 5 minutes on one H200 (`--budget-s` skips what
would not fit). On a machine without a GPU it runs on CPU at a toy size, to check the script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pipezero.config import TrainConfig
from pipezero.settings import build_config
from pipezero.data import global_batch, load_corpus, microbatches_for_rank
from pipezero.engine import train
from pipezero.models import build_chunk, compile_blocks, flops_per_token, lm_loss, param_count
from pipezero.optim import lr_at
from pipezero.runtime.autocast import autocast


@dataclass(frozen=True)
class Case:
    preset: str
    seq_len: int
    micro_batch_size: int
    microbatches: int
    compile: bool

    @property
    def name(self) -> str:
        return f"{self.preset} T={self.seq_len} {self.microbatches}x{self.micro_batch_size}" + (
            " compiled" if self.compile else "")


GPU_CASES = {  # the shapes: base 4 x 8 x 1024 tokens a step, 1b 2 x 4 x 2048
    "base": dict(preset="base", seq_len=1024, micro_batch_size=8, microbatches=4),
    "1b": dict(preset="1b", seq_len=2048, micro_batch_size=4, microbatches=2),
    # base's same 32k tokens a step as one micro-batch: a quarter of the launches a token. base is
    # bound by the host launching kernels (an eager micro-batch of 8 x 1024 kept the GPU busy 27 of
    # 117 ms), so this shape asks how much of its gap to 30% MFU is launch overhead.
    "base-1x32": dict(preset="base", seq_len=1024, micro_batch_size=32, microbatches=1),
}
CPU_CASES = {"tiny": dict(preset="tiny", seq_len=64, micro_batch_size=4, microbatches=2)}


def config(case: Case, steps: int, out: str, device: str) -> TrainConfig:
    return build_config(None, {
        "model.preset": case.preset, "data.seq_len": case.seq_len, "data.tokenizer": "bytes",
        "data.max_bytes": 20_000_000, "parallel.micro_batch_size": case.micro_batch_size,
        "parallel.microbatches": case.microbatches, "run.dtype": "bf16" if device == "cuda" else "fp32",
        "run.device": device, "run.compile": case.compile, "run.max_steps": steps, "run.out": out,
        "run.save_final": False,
        "run.progress": False, "run.eval_every": 0, "run.eval_batches": 1, "run.sample_tokens": 0,
    })


def matmul_tflops(device: torch.device) -> float:
    """bf16 8192^3 products on random data: the rate MFU is measured against (fp32 on CPU)."""
    n = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * n**3 / (time.perf_counter() - t0) / 1e12


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_pipezero(case: Case, steps: int, warm: int, device: torch.device) -> dict:
    with tempfile.TemporaryDirectory() as out:
        res = train(config(case, steps, out, device.type))
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(out) / "summary.json").read_text())
    peak = summary["ranks"][0].get("peak_device_bytes", {}).get("train", {})
    return {"step_s": statistics.median(r["step_time_s"] for r in rows[warm:]), "losses": res.losses,
            "peak_allocated": peak.get("allocated"), "peak_reserved": peak.get("reserved"),
            "measured_bubble": summary["measured_bubble"][0]}


def run_plain(case: Case, steps: int, warm: int, device: torch.device) -> dict:
    """The hand-written loop: same model, batches, optimizer settings and precision."""
    cfg = config(case, steps, "unused", device.type)
    corpus = load_corpus(cfg.data)
    torch.manual_seed(cfg.run.seed)
    model = build_chunk(cfg.model, 0, cfg.model.n_layers + 2, cfg.run.seed, device)
    if case.compile:
        compile_blocks(model)
    o = cfg.optim
    params = list(model.parameters())
    groups = [{"params": [q for q in params if q.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=fused, foreach=not fused)
    g, t = cfg.global_batch, cfg.data.seq_len
    times, losses = [], []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o, steps)
        if step == warm and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        batch = global_batch(corpus.train, step, cfg.run.seed, g, t)
        loss = torch.zeros((), device=device)
        for x, y in microbatches_for_rank(batch, 0, 1, cfg.parallel.microbatches):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast(cfg.run.dtype, device.type):
                part = lm_loss(model(x), y, g * t)
            part.backward()
            loss += part.detach()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync(device)
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)) \
        if device.type == "cuda" else (None, None)
    return {"step_s": statistics.median(times[warm:]), "losses": losses,
            "peak_allocated": peak[0], "peak_reserved": peak[1]}


def attention_kernels(case: Case, device: torch.device) -> list[str]:
    """Names of the CUDA kernels one block's forward and backward ran for attention."""
    if device.type != "cuda":
        return []
    cfg = config(case, 1, "unused", device.type)
    block = build_chunk(cfg.model, 1, 2, cfg.run.seed, device)
    x = torch.randn(case.micro_batch_size, case.seq_len, cfg.model.dim, device=device,
                    dtype=torch.bfloat16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with autocast(cfg.run.dtype, device.type):
            y = block(x)
        y.float().sum().backward()
        sync(device)
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if any(k in n.lower() for k in ("flash", "fmha", "cudnn", "attention", "efficient")))


def kernel_profile(case: Case, device: torch.device, top: int = 12) -> dict:
    """Where one eager forward and backward of the whole model spends the GPU's time: the busiest
    kernels, and the GPU's busy share of the wall time (well below 1: the CPU cannot launch kernels
    fast enough, so fewer, larger kernels would pay)."""
    cfg = config(case, 1, "unused", device.type)
    model = build_chunk(cfg.model, 0, cfg.model.n_layers + 2, cfg.run.seed, device)
    corpus = load_corpus(cfg.data)
    x, y = global_batch(corpus.train, 0, cfg.run.seed, case.micro_batch_size, case.seq_len)
    x, y = x.to(device), y.to(device)

    def fwd_bwd() -> None:
        with autocast(cfg.run.dtype, device.type):
            loss = lm_loss(model(x), y, x.numel())
        loss.backward()

    fwd_bwd()
    sync(device)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fwd_bwd()
        sync(device)
    wall = time.perf_counter() - t0
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    kernels = [(e.key[:90], e.count, e.device_time_total / 1e3) for e in rows if e.device_time_total > 0]
    busy = sum(ms for _, _, ms in kernels) / 1e3
    return {"wall_s": wall, "gpu_busy_s": busy, "top": kernels[:top]}


def mfu(case: Case, step_s: float, peak_tflops: float) -> dict:
    cfg = config(case, 1, "unused", "cpu")
    m = cfg.model
    tokens = cfg.global_batch * case.seq_len
    non_embedding = param_count(m) - m.vocab_size * m.dim
    return {"tokens_per_s": tokens / step_s,
            "mfu_6n": tokens / step_s * 6 * non_embedding / (peak_tflops * 1e12),
            "mfu_model_flops": tokens / step_s * flops_per_token(m, case.seq_len) / (peak_tflops * 1e12)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=None, help="comma-separated shapes (default: base,1b on a GPU, tiny on CPU)")
    ap.add_argument("--compile", choices=["off", "on", "both"], default="both")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warm", type=int, default=5, help="steps left out of the timing (compilation, allocation)")
    ap.add_argument("--budget-s", type=float, default=270.0, help="skip cases that start after this many seconds")
    ap.add_argument("--json", default="bench/results/gpu_step/gpu_step.json")
    ap.add_argument("--profile", action="store_true", help="also list the busiest kernels of each eager shape")
    args = ap.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    table = GPU_CASES if device.type == "cuda" else CPU_CASES
    names = args.cases.split(",") if args.cases else list(table)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    cases = [Case(**{**GPU_CASES, **CPU_CASES}[n], compile=c) for c in modes for n in names]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    started = time.perf_counter()
    peak = matmul_tflops(device)
    report = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "matmul_tflops": peak, "cases": [], "skipped": []}
    print(f"{report['device']}, torch {torch.__version__}: matmul {peak:.0f} TFLOP/s", flush=True)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    for case in cases:
        if time.perf_counter() - started > args.budget_s:
            report["skipped"].append(case.name)
            continue
        t0 = time.perf_counter()
        row: dict = {"case": asdict(case), "name": case.name}
        try:
            row["attention_kernels"] = attention_kernels(case, device) if not case.compile else None
            ours = run_pipezero(case, args.steps, args.warm, device)
            plain = run_plain(case, args.steps, args.warm, device)
            row.update(pipezero={**ours, **mfu(case, ours["step_s"], peak)},
                       plain={**plain, **mfu(case, plain["step_s"], peak)},
                       ratio=plain["step_s"] / ours["step_s"],
                       first_loss_diff=abs(ours["losses"][0] - plain["losses"][0]),
                       spike=max(ours["losses"][1:]) > ours["losses"][0])
            print(f"{case.name:28s} pipezero {ours['step_s'] * 1e3:7.1f} ms  MFU {row['pipezero']['mfu_6n']:6.1%} | "
                  f"plain {plain['step_s'] * 1e3:7.1f} ms  MFU {row['plain']['mfu_6n']:6.1%} | "
                  f"ours/plain throughput {row['ratio']:.3f} | first loss {ours['losses'][0]:.4f} vs "
                  f"{plain['losses'][0]:.4f} | peak alloc GiB {_gib(ours['peak_allocated'])} vs "
                  f"{_gib(plain['peak_allocated'])} | {time.perf_counter() - t0:.0f} s", flush=True)
            if row["attention_kernels"] is not None:
                print(f"{'':28s} attention kernels: {row['attention_kernels']}", flush=True)
            if args.profile and device.type == "cuda" and not case.compile:
                row["profile"] = prof = kernel_profile(case, device)
                print(f"{'':28s} one micro-batch forward+backward: wall {prof['wall_s'] * 1e3:.1f} ms, GPU busy "
                      f"{prof['gpu_busy_s'] * 1e3:.1f} ms; busiest kernels (name, count, ms):", flush=True)
                for name, count, ms in prof["top"]:
                    print(f"{'':30s}{ms:8.2f} {count:5d}  {name}", flush=True)
        except Exception as e:  # noqa: BLE001 - a failed case is reported and the others still run
            row["error"] = f"{type(e).__name__}: {e}"
            print(f"{case.name}: FAILED {row['error']}", flush=True)
        report["cases"].append(row)
        path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}; {time.perf_counter() - started:.0f} s; skipped: {report['skipped'] or 'none'}")
    return 0


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


if __name__ == "__main__":
    sys.exit(main())
