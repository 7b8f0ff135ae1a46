"""Does a preset's default learning-rate schedule train without an early loss spike, and which
weights make its first steps jumpy?

Two measurements on the same model, batches and seed:

- `curves`: short training runs, one per variant (`--variant "optim.warmup_steps=200"`, several
  allowed; the first is always the defaults). For each: the losses, the gradient norms, whether any
  step's loss rose above the first step's (the spike the preset's test forbids), and the largest
  rise between consecutive steps.
- `--probe LR`: one Adam step taken by one group of weights at a time (each weight moved by LR
  against its gradient's sign, which is what AdamW's bias-corrected first step is), and the change
  in the loss on the same batch and on the next one, in the curves' precision. It names the
  weights whose first steps move the loss most: the rate a warm-up should start from is set by them.

    python bench/lr_stability.py --preset 1b --layers 4 --seq-len 256 --micro-batch-size 4 --steps 12 \
        --variant optim.warmup_steps=20 --probe 1e-5     # a CPU-sized slice of the 1b width
    python bench/lr_stability.py --preset 1b --seq-len 2048 --micro-batch-size 4 --microbatches 2 \
        --steps 25 --dtype bf16 --variant optim.warmup_steps=20   # one GPU, the bench's shape

Writes bench/results/lr_stability/lr_stability.json (or --json).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipezero.config import TrainConfig  # noqa: E402
from pipezero.data import global_batch, load_corpus  # noqa: E402
from pipezero.engine import train  # noqa: E402
from pipezero.models import build_chunk, lm_loss  # noqa: E402
from pipezero.parallel.device import device_kind  # noqa: E402
from pipezero.runtime.autocast import autocast  # noqa: E402
from pipezero.settings import build_config  # noqa: E402


def config(args: argparse.Namespace, out: str, extra: dict[str, str]) -> TrainConfig:
    overrides = {"model.preset": args.preset, "data.seq_len": args.seq_len, "data.tokenizer": "bytes",
                 "data.max_bytes": 20_000_000, "parallel.micro_batch_size": args.micro_batch_size,
                 "parallel.microbatches": args.microbatches, "run.dtype": args.dtype, "run.device": args.device,
                 "run.max_steps": args.steps, "run.out": out, "run.progress": False, "run.eval_every": 0,
                 "run.save_final": False,
                 "run.eval_batches": 1, "run.sample_tokens": 0, **extra}
    if args.layers:
        overrides["model.n_layers"] = args.layers
    return build_config(None, overrides)


def curve(args: argparse.Namespace, extra: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cfg = config(args, out, extra)
        t0 = time.perf_counter()
        res = train(cfg)
    losses = res.losses
    rises = [b - a for a, b in zip(losses, losses[1:])]
    return {"variant": extra, "lr": cfg.optim.lr, "warmup_steps": cfg.optim.warmup_steps, "losses": losses,
            "grad_norms": res.grad_norms, "spike": max(losses[1:]) > losses[0], "largest_rise": max(rises),
            "seconds": time.perf_counter() - t0}


def weight_group(name: str) -> str:
    """`layers.3.mlp.w2.weight` -> `w2`; norms together; the first and last layers by their role."""
    if name.startswith("layers.0."):
        return "embedding"
    if "norm" in name:
        return "norms"
    if "proj" in name:
        return "head"
    return name.split(".")[-2]


def probe(args: argparse.Namespace, lr: float) -> dict:
    cfg = config(args, "unused", {})
    device = torch.device(device_kind(cfg.run.device))
    corpus = load_corpus(cfg.data)
    model = build_chunk(cfg.model, 0, cfg.model.n_layers + 2, cfg.run.seed, device)
    n = cfg.parallel.micro_batch_size
    batches = [tuple(t.to(device) for t in global_batch(corpus.train, s, cfg.run.seed, n, cfg.data.seq_len))
               for s in (0, 1)]

    def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # in the curves' precision
        with autocast(cfg.run.dtype, device.type):
            return lm_loss(model(x), y, y.numel())

    def losses() -> list[float]:
        with torch.no_grad():
            return [loss(x, y).item() for x, y in batches]

    loss(*batches[0]).backward()
    base = losses()
    groups: dict[str, list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        groups.setdefault(weight_group(name), []).append(p)
    rows = []
    for key, params in [*groups.items(), ("all", list(model.parameters()))]:
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad.sign()
        moved = losses()
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        rows.append({"weights": key, "params": sum(p.numel() for p in params),
                     "grad_norm": math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params)),
                     "loss_change": moved[0] - base[0], "next_batch_change": moved[1] - base[1]})
        print(f"  {key:10s} {rows[-1]['params'] / 1e6:8.1f}M  grad norm {rows[-1]['grad_norm']:8.3f}  "
              f"loss {rows[-1]['loss_change']:+.3f}  next batch {rows[-1]['next_batch_change']:+.3f}", flush=True)
    return {"lr": lr, "loss": base[0], "next_batch_loss": base[1], "groups": rows}


def brief(losses: list[float]) -> str:
    """The first ten losses, then every tenth step's: a long run on one line."""
    shown = losses[:10] + [f"{i + 1}:{v:.2f}" for i, v in enumerate(losses) if i >= 10 and (i + 1) % 10 == 0]
    return " ".join(v if isinstance(v, str) else f"{v:.2f}" for v in shown)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--layers", type=int, default=0, help="blocks (default: the preset's); fewer keep its width")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--variant", action="append", default=[],
                    help="KEY=VALUE[,KEY=VALUE] settings for one more run beside the defaults, e.g. "
                         "optim.warmup_steps=200")
    ap.add_argument("--probe", type=float, default=0.0, help="also probe one Adam step of this size per weight group")
    ap.add_argument("--no-curves", action="store_true", help="only the probe")
    ap.add_argument("--json", default="bench/results/lr_stability/lr_stability.json")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps: at least 2 (a spike is a later step's loss above the first's)")
    report: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "args": vars(args), "curves": []}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.probe:
        print(f"one Adam step of {args.probe:g} per weight group (loss change on this batch and the next):")
        report["probe"] = probe(args, args.probe)
        path.write_text(json.dumps(report, indent=1))
    variants = [] if args.no_curves else [{}] + [dict(kv.split("=", 1) for kv in v.split(",")) for v in args.variant]
    for extra in variants:
        row = curve(args, extra)
        report["curves"].append(row)
        path.write_text(json.dumps(report, indent=1))
        print(f"{json.dumps(extra) if extra else 'defaults':32s} lr {row['lr']:.1e} warm-up {row['warmup_steps']:4d} | "
              f"spike above step 1: {'YES' if row['spike'] else 'no '} | largest rise {row['largest_rise']:+.2f} | "
              f"losses {brief(row['losses'])} | {row['seconds']:.0f} s", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
