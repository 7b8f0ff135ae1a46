"""The training loop: batches in, optimizer steps out, metrics written.

One optimizer step is: the step's global batch (a pure function of seed and step), this rank's
micro-batches, forward and backward of each (gradients accumulate), global-norm clipping, AdamW,
and one `metrics.jsonl` line. The loss of every micro-batch is divided by the token count of the
whole global batch, so the summed loss is the global mean whatever the layout.
"""

from __future__ import annotations

import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from pipezero.checkpoint import resume, save
from pipezero.config import DType, TrainConfig
from pipezero.errors import ConfigError
from pipezero.data import Corpus, load_corpus, unigram_entropy
from pipezero.data.packing import IGNORE
from pipezero.freeze import apply_freeze, frozen_params, saved_bytes, summarize
from pipezero.generate import sample
from pipezero.models import ModelSpec, build_chunk, compile_blocks, spec_of
from pipezero.optim import lr_at
from pipezero.nonfinite import finite_or_none, report_nonfinite
from pipezero.parallel.device import PeakMemory, synchronizer, use_tf32
from pipezero.parallel.mesh import Groups, Mesh, build_groups
from pipezero.parallel.process_group import init_distributed
from pipezero.parallel.partition import partition
from pipezero.runtime.executor import Executor
from pipezero.runtime.p2p import P2P
from pipezero.schedules.actions import Schedule
from pipezero.schedules.bucket_plan import BucketPlan
from pipezero.schedules.check import SimResult, simulate
from pipezero.schedules.registry import build_schedule
from pipezero.schedules.posting import plans, verify
from pipezero.schedules.program import Instr, lower
from pipezero.telemetry.metrics import MetricsLog, StepProgress
from pipezero.telemetry.tensorboard import TensorBoardLog, require_tensorboard
from pipezero.telemetry.trace import Tracer, write_trace
from pipezero.util import atomic_write_json
from pipezero.zero import layerwise, updates
from pipezero.zero.accounting import explain, held_bytes
from pipezero.zero.buckets import named_by_chunk, shared_params
from pipezero.zero.sharded import ZeroDP
from pipezero.zero.tied import TiedCopies, find_tied, tie_group


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # global, before clipping, per step
    heldout: dict[int, float] = field(default_factory=dict)  # step -> held-out loss
    unigram: float = math.nan
    sample_text: str = ""
    out: Path = Path(".")
    peak_live: int = 0  # most chunk activations this rank held at once
    measured_bubble: float = 0.0  # mean share of the schedule this rank waited on peers
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's final parameters
    resumed_from: int = 0  # the checkpoint step this run continued from (0: a fresh start)
    skipped_steps: list[int] = field(default_factory=list)  # steps skipped for a non-finite loss/gradient
    # Memory of the training steps alone, to show evaluation and the sample add nothing (ZeRO-3).
    peak_gathered_training: int = 0  # most ZeRO-3 parameter bytes gathered at once during training
    peak_rss_training: int = 0  # bytes, ru_maxrss at the end of the last training step
    peak_gathered_run: int = 0  # the same with evaluations and the end-of-run sample


def check_corpus(cfg: TrainConfig, corpus: Corpus, vocab_size: int) -> None:
    """Refuse a corpus the model (of `vocab_size` embedding rows) cannot embed, or too small for
    one global batch."""
    corpus.check_batch(cfg.global_batch)
    if corpus.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer has {corpus.vocab_size} tokens but the model only {vocab_size} rows: "
            f"set model.vocab_size >= {corpus.vocab_size} or use a smaller tokenizer (data.bpe_vocab)"
        )


def default_threads(local_world: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


def peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def all_sum(values: list[float], group: object | None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, group=group)
    return t.tolist()


@dataclass
class Stage:
    """What one rank holds: its mesh position, schedule, chunks, and the executor that runs them."""

    mesh: Mesh
    groups: Groups
    schedule: Schedule
    predicted: SimResult
    bounds: list[tuple[int, int]]  # [start, stop) layers of every chunk, in model order
    chunks: dict[int, torch.nn.Module]
    executor: Executor
    zero: ZeroDP
    tracer: Tracer
    peaks: PeakMemory
    spec: ModelSpec  # the model the chunks are slices of
    program: tuple[Instr, ...]  # this rank's lowered program for one step (schedules/program.py)


def tied_copies(spec: ModelSpec, schedule: Schedule, mesh: Mesh,
                named: dict[int, list[tuple[str, torch.nn.Parameter]]]) -> TiedCopies | None:
    """Tied embeddings whose two ends live in different chunks (pp > 1): which copies this rank
    holds and the group that sums their gradients (a collective call on every rank)."""
    names = spec.tied_names()
    if names is None or schedule.n_chunks == 1:
        return None
    apart = schedule.rank_of_chunk[0] != schedule.rank_of_chunk[schedule.n_chunks - 1]
    group = tie_group(mesh.pp, mesh.dp, mesh.rank) if apart else None
    local, head = find_tied({n: q for ps in named.values() for n, q in ps}, names)
    return TiedCopies(local, head, group) if local else None


def build_stage(cfg: TrainConfig, rank: int, tracer: Tracer | None = None,
                device: torch.device = torch.device("cpu"), spec: ModelSpec | None = None) -> Stage:
    """This rank's part of the job. `spec` is the model (models/spec.py); None: the built-in
    Llama (or Hugging Face family) that cfg.model describes."""
    p = cfg.parallel
    spec = spec or spec_of(cfg.model)
    tracer = tracer or Tracer(rank, cfg.run.trace, sync=synchronizer(device), keep_steps=cfg.run.trace_steps)
    mesh = Mesh(p.pp, p.dp, rank, p.placement)
    schedule = build_schedule(p.schedule, p.pp, p.microbatches, p.virtual_stages)
    predicted = simulate(schedule)  # proves completeness and deadlock-freedom before any transfer
    bounds = partition(spec, schedule.n_chunks, p.partition, cfg.data.seq_len, p.stage_layers)
    if bounds[0][0] == bounds[0][1] or bounds[-1][0] == bounds[-1][1]:
        raise ConfigError(f"--stage-layers {[b - a for a, b in bounds]}: the first chunk must hold the embedding "
                          f"and the last the head; only chunks in between may be empty")
    chunks = {c: build_chunk(spec, *bounds[c], cfg.run.seed, device) for c in schedule.chunks(mesh.pp_rank)}
    if cfg.model.pretrained is not None:  # this rank's layers only, tensor by tensor
        from pipezero.models.hf_weights import load_chunk

        for chunk in chunks.values():
            load_chunk(chunk, cfg.model)
    apply_freeze(chunks, spec, cfg.optim.freeze)  # before ZeRO: buckets take trainable tensors only
    if cfg.run.compile:
        for chunk in chunks.values():
            compile_blocks(chunk)
    groups = build_groups(mesh)
    rank_of_chunk = {c: mesh.global_rank(r, mesh.dp_rank) for c, r in schedule.rank_of_chunk.items()}
    wire = torch.bfloat16 if cfg.run.dtype is DType.BF16 else torch.float32  # communication dtype
    p2p = P2P(rank, rank_of_chunk, (p.micro_batch_size, cfg.data.seq_len, spec.dim), p.timeout_s,
              dtype=wire, boundary=wire, device=device, tracer=tracer)  # bf16 runs: a bf16 residual stream
    keep = p.zero3_keep_gathered if p.zero3_keep_gathered is not None else p.pp > 1
    named = named_by_chunk(chunks)
    zero = ZeroDP(named, shared_params(chunks), p.zero, p.dp, mesh.dp_rank, groups.dp, cfg.optim,
                  p.grad_reduce, p.bucket_mb, p.timeout_s, rank, keep_gathered=keep, tracer=tracer,
                  tied=tied_copies(spec, schedule, mesh, named), comm_dtype=wire, device=device,
                  overlap_gather=p.overlap_gather)
    if zero.layerwise:
        layerwise.install(zero.sharded, chunks)
    elif zero.defers_gathers:
        updates.install(zero, chunks)  # each layer waits for its own updated weights
    # Transfers are posted in one order every rank agrees on, proven not to deadlock where a rank
    # pair's transfers run in posting order (NCCL) before any is posted.
    verify(schedule, plans(schedule, predicted))
    program = rank_program(schedule, predicted, mesh, zero, cfg)
    executor = Executor(chunks, schedule.n_chunks, p2p, cfg.run.dtype, zero, p.recompute, tracer=tracer)
    return Stage(mesh, groups, schedule, predicted, bounds, chunks, executor, zero, tracer, PeakMemory(device), spec,
                 program)


def rank_program(schedule: Schedule, predicted: SimResult, mesh: Mesh, zero: ZeroDP,
                 cfg: TrainConfig) -> tuple[Instr, ...]:
    """This rank's lowered program, over the buckets ZeRO actually built (other ranks' chunks are
    left without buckets: this rank plays only its own program)."""
    sizes = tuple(tuple(b.padded for b in zero.buckets.get(c, [])) for c in range(schedule.n_chunks))
    program = lower(schedule, mesh.dp, cfg.parallel.zero, cfg.parallel.grad_reduce, BucketPlan(mesh.dp, sizes),
                    keep_gathered=not zero.layerwise, sim=predicted)
    return program.ranks[program.global_rank(mesh.pp_rank, mesh.dp_rank)]


def train(cfg: TrainConfig, snapshot: bool = False, spec: ModelSpec | None = None) -> RunResult:
    """Train as the configuration says, on one process or as one rank of a pp x dp job. With
    `snapshot`, the result holds this rank's final parameters (a full copy: tests, not big runs).
    `spec`: a model of one's own (models/spec.py, examples/own_model.py) instead of cfg.model's."""
    p, r = cfg.parallel, cfg.run
    if r.tensorboard:  # every rank, before any process group: all stop alike when it is missing
        require_tensorboard()
    rank, device = init_distributed(cfg)
    use_tf32(device)
    sync = synchronizer(device) or (lambda: None)
    torch.manual_seed(r.seed)
    torch.set_num_threads(r.threads or default_threads(int(os.environ.get("LOCAL_WORLD_SIZE", p.world_size))))
    corpus = load_corpus(cfg.data)
    model = spec or spec_of(cfg.model)
    check_corpus(cfg, corpus, model.vocab_size)
    stage = build_stage(cfg, rank, device=device, spec=model)
    mesh, groups = stage.mesh, stage.groups
    named = [(n, q) for c in sorted(stage.chunks) for n, q in stage.chunks[c].named_parameters()]  # frozen too
    frozen = frozen_params(stage.chunks)
    found = resume(cfg, stage.zero, frozen, spec)
    start, bad_in_a_row = (found.manifest["step"], found.manifest["bad_in_a_row"]) if found else (0, 0)
    seq_len, g = cfg.data.seq_len, cfg.global_batch
    # samples read before `start`: saved with the checkpoint, so a resume with another global batch
    # goes on where the data stopped (checkpoints from before this was saved: start x G)
    read = found.manifest.get("data", {}).get("samples", start * g) if found else 0
    lead = rank == 0
    out = Path(r.out)
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "config.json", cfg.to_dict())
        if cfg.model.pretrained is not None:  # what `export --format hf` writes back beside the weights
            from pipezero.models.hf import keep_metadata

            keep_metadata(Path(cfg.model.pretrained), out / "hf")
    tokens_per_step = g * seq_len
    eval_set = corpus.eval_batches(r.eval_batches, p.micro_batch_size, seq_len)
    eval_tokens = sum(int((mb[1] != IGNORE).sum()) for mb in eval_set)
    result = RunResult(unigram=unigram_entropy(corpus.train), out=out, resumed_from=start)
    show = r.progress and lead
    metrics = MetricsLog(out / "metrics.jsonl", keep_steps=start) if lead else None
    board = TensorBoardLog(out) if lead and r.tensorboard else None
    peak_live = peak_gathered_run = 0
    bubbles: list[float] = []  # per step: share of the schedule this rank spent blocked on peers
    with StepProgress(r.max_steps, start, show) as progress:
        if show:
            progress.console.print(
                f"model {cfg.model.preset if spec is None else type(spec).__name__}: "
                f"{sum(stage.spec.layer_param_counts()) / 1e6:.2f}M parameters, "
                f"{stage.spec.flops_per_token(seq_len) / 1e6:.1f} MFLOP/token; corpus {corpus.source}: "
                f"{len(corpus.train):,} train tokens, unigram baseline {result.unigram:.3f} nats; "
                f"layout pp={p.pp} dp={p.dp} zero={p.zero} schedule={p.schedule.value} M={p.microbatches}; "
                f"layers per stage chunk (embedding + blocks + head, policy {p.partition.value}): "
                f"{[b - a for a, b in stage.bounds]}")
        for step in range(start, r.max_steps):
            lr = lr_at(step, cfg.optim, r.max_steps)
            t0 = time.perf_counter()
            stage.executor.p2p.step = stage.tracer.step = step + 1
            batch = corpus.batch(step, read, r.seed, g, seq_len)
            read += g
            mbs = corpus.microbatches(batch, mesh.dp_rank, p.dp, p.microbatches)
            peak_gathered_run = max(peak_gathered_run, stage.zero.peak_gathered)  # incl. evaluations
            stage.zero.reset_peak()  # from here to the optimizer step: this step's training
            stage.zero.begin_step()
            # the mean over the global batch's targets; packing ignores those across a document boundary
            denom = max(1, int((batch[1] != IGNORE).sum()))
            stats = stage.executor.run(stage.program, mbs, denom)
            peak_live = max(peak_live, stats.peak_live)
            outcome = stage.zero.step(lr, cfg.optim.grad_clip, groups.world, stats.loss)
            bad_in_a_row = 0 if outcome.applied else 1 + bad_in_a_row
            if not outcome.applied:
                report_nonfinite(outcome, float(stats.loss), step + 1, mesh.pp_rank, bad_in_a_row, r.max_bad_steps)
                result.skipped_steps.append(step + 1)
            sync()  # the step's time includes its queued kernels (the optimizer's, the gathers')
            dt = time.perf_counter() - t0
            busy = stage.executor.clock.busy_share()  # GPU: idle time between compute actions
            bubble = 1.0 - busy if busy is not None else \
                stats.wait_s / stats.elapsed_s if stats.elapsed_s else 0.0  # CPU: share blocked on peers
            steady = step > start or r.max_steps == 1  # the first step pays one-off costs (allocations, warm-up)
            if steady:
                bubbles.append(bubble)
            stage.peaks.mark("train" if steady else None)  # not the first step's
            result.losses.append(outcome.loss)
            result.grad_norms.append(outcome.grad_norm)
            result.peak_rss_training = rss = peak_rss_bytes()  # before this step's evaluation
            record = {"step": step + 1, "loss": finite_or_none(outcome.loss), "lr": lr,
                      "grad_norm": finite_or_none(outcome.grad_norm), "tokens": tokens_per_step * (step + 1),
                      "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                      "bubble": bubble, "peak_rss_mib": rss / 2**20,  # this (the writing) rank's
                      "bytes_sent": stage.executor.p2p.bytes_sent + stage.zero.bytes_sent}  # so far, before eval
            if not outcome.applied:
                record["skipped"] = True
            result.peak_gathered_training = max(result.peak_gathered_training, stage.zero.peak_gathered)
            if (r.eval_every and (step + 1) % r.eval_every == 0) or step + 1 == r.max_steps:
                record["heldout_loss"] = result.heldout[step + 1] = evaluate(stage, eval_set, eval_tokens)
            if metrics:
                metrics.write(record)
            if board:
                board.write(record)
            if r.checkpoint_every and ((step + 1) % r.checkpoint_every == 0 or step + 1 == r.max_steps):
                save(cfg, stage.zero, step + 1, bad_in_a_row, data={"samples": read}, frozen=frozen, spec=spec)
            progress.update(step, outcome.loss, record["tokens_per_s"])
    stage.zero.settle()  # nothing in flight past the loop
    if metrics:
        metrics.close()
    if r.max_steps not in result.heldout:  # resumed from a checkpoint of the last step
        result.heldout[r.max_steps] = evaluate(stage, eval_set, eval_tokens)
    result.peak_live = peak_live
    result.measured_bubble = sum(bubbles) / len(bubbles) if bubbles else 0.0
    result.sample_text = end_sample(cfg, stage, corpus)
    result.peak_gathered_run = max(peak_gathered_run, stage.zero.peak_gathered)
    finish_run(cfg, stage, corpus, result, progress if show else None, board)
    if board:
        board.close()
    if snapshot:  # a full copy (tests); every rank takes part: ZeRO-3 gathers are collectives
        stage.zero.gather_all()
        result.params = {n: q.detach().clone() for n, q in named}
        stage.zero.release_all()
    return result


def evaluate(stage: Stage, eval_set: list, eval_tokens: int) -> float:
    """Mean held-out token loss (collective over the pipeline)."""
    total = all_sum([stage.executor.evaluate(eval_set)], stage.groups.pp)[0]
    stage.zero.release_all()
    stage.peaks.mark("eval")
    return total / eval_tokens


def will_sample(cfg: TrainConfig, corpus: Corpus) -> bool:
    """The end-of-run text sample needs the whole model in one process: only without a pipeline."""
    return bool(cfg.run.sample_tokens) and corpus.tokenizer is not None and cfg.parallel.pp == 1


def end_sample(cfg: TrainConfig, stage: Stage, corpus: Corpus) -> str:
    """The end-of-run text sample, decoded on rank 0. Layer by layer at ZeRO-3, every replica
    samples the same tokens (same parameters, same seed), so each layer is gathered and released
    around its use by the same hooks as in training and the whole model never exists at once;
    otherwise rank 0 alone samples (below stage 3 its parameters are whole, kept-gathered stage 3
    gathers its one chunk as its training steps do)."""
    if not will_sample(cfg, corpus):
        return ""
    together = stage.zero.layerwise
    if not together and stage.zero.stage == 3:
        stage.zero.gather_all()
    text = ""
    if together or stage.mesh.rank == 0:
        model = next(iter(stage.chunks.values()))
        ids = sample(model, corpus.tokenizer.encode_many(["def "])[0], cfg.run.sample_tokens,
                     stage.spec.max_seq_len or cfg.data.seq_len,
                     cfg.run.seed)
        text = corpus.tokenizer.decode(ids) if stage.mesh.rank == 0 else ""
    stage.zero.release_all()
    return text


def finish_run(cfg: TrainConfig, stage: Stage, corpus: Corpus, result: RunResult,
               progress: StepProgress | None, board: TensorBoardLog | None = None) -> None:
    """Gather per-rank figures into summary.json (rank 0) and print the end-of-run sample."""
    p, r = cfg.parallel, cfg.run
    mine = {"peak_live": result.peak_live, "measured_bubble": result.measured_bubble,
            "held_bytes": held_bytes(stage.zero.all_buckets(), stage.zero.rules, stage.zero.opt.state_bytes()), "params": sum(b.numel for b in stage.zero.all_buckets()),
            "p2p_bytes_sent": stage.executor.p2p.bytes_sent, "collective_bytes_sent": stage.zero.bytes_sent,
            "peak_rss_bytes": peak_rss_bytes(),
            "frozen": saved_bytes(p.zero, p.dp, sum(q.numel() for _, q in frozen_params(stage.chunks))),
            "peak_rss_bytes_training": result.peak_rss_training,
            "zero3_gathered_peak_bytes": {"training": result.peak_gathered_training, "run": result.peak_gathered_run}}
    if stage.peaks.phases:
        mine["peak_device_bytes"] = stage.peaks.phases  # training steps after the first, evaluation
    per_rank, events = [mine], [stage.tracer.events]
    if dist.is_initialized():
        per_rank = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(per_rank, mine)
        if r.trace:
            events = [None] * dist.get_world_size()  # type: ignore[list-item]
            dist.all_gather_object(events, stage.tracer.events)
    if stage.mesh.rank != 0:
        return
    one_replica = [stage.mesh.global_rank(s, 0) for s in range(p.pp)]  # a rank a stage, as placed
    layout = {"pp": p.pp, "dp": p.dp, "schedule": p.schedule.value, "microbatches": p.microbatches,
              "virtual_stages": p.virtual_stages}
    if board:
        board.write_ranks(per_rank, r.max_steps)
    if r.trace:
        write_trace(result.out / "trace.json", events, layout, result.out / "trace.png", step=r.max_steps)
    final = result.heldout[r.max_steps]
    atomic_write_json(result.out / "summary.json", {
        "layout": {**layout, "zero": p.zero},
        "params": sum(stage.spec.layer_param_counts()), "unigram_baseline": result.unigram, "final_heldout_loss": final,
        "final_loss": finite_or_none(result.losses[-1]) if result.losses else None, "steps": r.max_steps,
        "resumed_from": result.resumed_from, "skipped_steps": result.skipped_steps,
        "peak_live_activations": {"measured": [per_rank[r]["peak_live"] for r in one_replica],
                                  "simulated": stage.predicted.peak_activations},
        "simulated_bubble": stage.predicted.bubble,
        "measured_bubble": [x["measured_bubble"] for x in per_rank],
        "bytes_sent": {"p2p": [x["p2p_bytes_sent"] for x in per_rank],
                       "collectives": [x["collective_bytes_sent"] for x in per_rank]},
        "ranks": per_rank,
        "zero_memory": {**explain(p.zero, p.dp, r.dtype, p.grad_reduce, p.microbatches),
                        "held_bytes_per_param": [sum(x["held_bytes"].values()) / max(1, x["params"])
                                                     for x in per_rank]},
        "frozen": summarize([x["frozen"] for x in per_rank], cfg.optim.freeze, one_replica),
    })
    if progress:
        bubble = sum(x["measured_bubble"] for x in per_rank) / len(per_rank)
        sent = sum(x["p2p_bytes_sent"] + x["collective_bytes_sent"] for x in per_rank)
        progress.console.print(f"held-out loss {final:.4f} (unigram baseline {result.unigram:.4f}); measured bubble "
                               f"{bubble:.1%} (simulated {stage.predicted.bubble:.1%}); {sent / 2**20:,.1f} MiB sent; "
                               f"run in {result.out}")
        gpu = [x["peak_device_bytes"]["train"] for x in per_rank if "train" in x.get("peak_device_bytes", {})]
        if gpu:
            progress.console.print("GPU peak memory in training steps (allocated / reserved GiB, by rank): " + ", ".join(
                f"{g['allocated'] / 2**30:.2f} / {g['reserved'] / 2**30:.2f}" for g in gpu))
        if result.sample_text:
            progress.console.print("sample:\n" + result.sample_text)
