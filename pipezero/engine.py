"""The training loop: batches in, optimizer steps out, metrics written.

One optimizer step is: the step's global batch (a pure function of seed and step), this rank's
micro-batches, forward and backward of each (gradients accumulate), global-norm clipping, AdamW,
and one `metrics.jsonl` line. The loss of every micro-batch is divided by the token count of the
whole global batch, so the summed loss is the global mean whatever the layout.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipezero.config import ConfigError, DType, TrainConfig
from pipezero.data import Corpus, global_batch, heldout_batches, load_corpus, microbatches_for_rank, unigram_entropy
from pipezero.generate import sample
from pipezero.models import build_chunk, flops_per_token, lm_loss, param_count
from pipezero.optim import build_adamw, lr_at
from pipezero.telemetry.metrics import MetricsLog, StepProgress
from pipezero.util import atomic_write_json


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    heldout: dict[int, float] = field(default_factory=dict)  # step -> held-out loss
    unigram: float = math.nan
    sample_text: str = ""
    out: Path = Path(".")


def autocast(dtype: DType) -> contextlib.AbstractContextManager:
    """bf16 autocast for matmuls; parameters, gradients and the loss stay fp32."""
    if dtype is DType.BF16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def check_vocab(cfg: TrainConfig, corpus: Corpus) -> None:
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the tokenizer has {corpus.vocab_size} tokens but the model only {cfg.model.vocab_size} rows: "
            f"set model.vocab_size >= {corpus.vocab_size} or use a smaller tokenizer (data.bpe_vocab)"
        )


def default_threads(local_world: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], dtype: DType) -> float:
    total, count = 0.0, 0
    for x, y in batches:
        with autocast(dtype):
            logits = model(x)
        total += float(lm_loss(logits, y, denom=1.0))
        count += y.numel()
    return total / count


def train(cfg: TrainConfig) -> RunResult:
    """Train one process (`--pp 1 --dp 1`) as the configuration says; returns what it measured."""
    p, r = cfg.parallel, cfg.run
    if p.world_size > 1:
        raise ConfigError(f"--pp {p.pp} --dp {p.dp} needs the pipeline engine (not yet built); use --pp 1 --dp 1")
    torch.manual_seed(r.seed)
    torch.set_num_threads(r.threads or default_threads(1))
    corpus = load_corpus(cfg.data)
    check_vocab(cfg, corpus)
    n_layers = cfg.model.n_layers + 2
    model = build_chunk(cfg.model, 0, n_layers, r.seed)
    optimizer = build_adamw(model.named_parameters(), cfg.optim)
    assert optimizer is not None  # the whole model always has parameters
    params = [q for q in model.parameters() if q.requires_grad]

    out = Path(r.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "config.json", cfg.to_dict())
    seq_len, g = cfg.data.seq_len, cfg.global_batch
    tokens_per_step = g * seq_len
    eval_set = heldout_batches(corpus.heldout, r.eval_batches, p.micro_batch_size, seq_len)
    result = RunResult(unigram=unigram_entropy(corpus.train), out=out)
    n_params = param_count(cfg.model)
    console_info = (f"model {cfg.model.preset}: {n_params / 1e6:.2f}M parameters, "
                    f"{flops_per_token(cfg.model, seq_len) / 1e6:.1f} MFLOP/token; corpus {corpus.source}: "
                    f"{len(corpus.train):,} train tokens, unigram baseline {result.unigram:.3f} nats")
    metrics = MetricsLog(out / "metrics.jsonl")
    with StepProgress(r.max_steps, 0, r.progress) as progress:
        if r.progress:
            progress.console.print(console_info)
        for step in range(r.max_steps):
            lr = lr_at(step, cfg.optim, r.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            batch = global_batch(corpus.train, step, r.seed, g, seq_len)
            loss = 0.0
            for x, y in microbatches_for_rank(batch, 0, 1, p.microbatches):
                with autocast(r.dtype):
                    logits = model(x)
                mb_loss = lm_loss(logits, y, denom=tokens_per_step)
                mb_loss.backward()
                loss += float(mb_loss.detach())
            max_norm = cfg.optim.grad_clip or math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens": tokens_per_step * (step + 1), "step_time_s": dt, "tokens_per_s": tokens_per_step / dt}
            if (r.eval_every and (step + 1) % r.eval_every == 0) or step + 1 == r.max_steps:
                record["heldout_loss"] = result.heldout[step + 1] = heldout_loss(model, eval_set, r.dtype)
            metrics.write(record)
            result.losses.append(loss)
            progress.update(step, loss, record["tokens_per_s"])
    metrics.close()
    if r.sample_tokens and corpus.tokenizer is not None:
        prompt = corpus.tokenizer.encode_many(["def "])[0]
        ids = sample(model, prompt, r.sample_tokens, cfg.model.max_seq_len, r.seed)
        result.sample_text = corpus.tokenizer.decode(ids)
    final = result.heldout[r.max_steps]
    atomic_write_json(out / "summary.json", {
        "layout": {"pp": 1, "dp": 1, "zero": p.zero, "schedule": p.schedule.value, "microbatches": p.microbatches},
        "params": n_params, "unigram_baseline": result.unigram, "final_heldout_loss": final,
        "final_loss": result.losses[-1], "steps": r.max_steps,
    })
    if r.progress:
        progress.console.print(f"held-out loss {final:.4f} (unigram baseline {result.unigram:.4f}); run in {out}")
        if result.sample_text:
            progress.console.print("sample:\n" + result.sample_text)
    return result
