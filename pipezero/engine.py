"""The training loop: batches in, optimizer steps out, metrics written.

One optimizer step is: the step's global batch (a pure function of seed and step), this rank's
micro-batches, forward and backward of each (gradients accumulate), global-norm clipping, AdamW,
and one `metrics.jsonl` line. The loss of every micro-batch is divided by the token count of the
whole global batch, so the summed loss is the global mean whatever the layout.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from pipezero.checkpoint import resume, save, saves_after
from pipezero.config import TrainConfig
from pipezero.errors import ConfigError
from pipezero.data import Corpus, load_corpus, unigram_entropy
from pipezero.data.packing import IGNORE
from pipezero.freeze import frozen_params
from pipezero.generate import Sampler
from pipezero.models import ModelSpec, spec_of
from pipezero.optim import lr_at, short_of_peak
from pipezero.nonfinite import finite_or_none, report_nonfinite
from pipezero.parallel.device import synchronizer, use_tf32
from pipezero.parallel.process_group import init_distributed
from pipezero.parallel.waits import all_reduced
from pipezero.telemetry.memory_profile import PeakMeter
from pipezero.rundir import run_of_trial
from pipezero.runtime.watch import Watch, start_watch
from pipezero.telemetry.metrics import MetricsLog, StepProgress
from pipezero.telemetry.tensorboard import TensorBoardLog, require_tensorboard
from pipezero.files import atomic_write_json
from pipezero.stage import Stage, build_stage
from pipezero.planner.auto_check import LayoutCheck
from pipezero.summary import RunResult, finish_run, peak_rss_bytes

T = TypeVar("T")


def check_corpus(cfg: TrainConfig, corpus: Corpus, vocab_size: int) -> None:
    """Refuse a corpus the model (of `vocab_size` embedding rows) cannot embed, or too small for
    one global batch."""
    corpus.check_batch(cfg.global_batch)
    check_rows(cfg, corpus.vocab_size, corpus.tokenizer is None, vocab_size)


def check_rows(cfg: TrainConfig, needed: int, token_file: bool, vocab_size: int) -> None:
    """Refuse ids reaching `needed` - 1 (a token file's, or a tokenizer's) where the model has
    `vocab_size` embedding rows."""
    if needed > vocab_size:  # the other fix is the source's own: ids, a smaller BPE or tokenizer
        what, other = ((f"the token file's ids reach {needed - 1}", f"ids below {vocab_size}")
                       if token_file else (f"the tokenizer has {needed} tokens",
                       "a smaller data.bpe_vocab" if cfg.data.tokenizer == "bpe" else "a smaller tokenizer"))
        raise ConfigError(f"{what} but the model only {vocab_size} rows: set model.vocab_size >= {needed} "
                          f"(with --model-spec: your spec's vocab_size) or use {other}")


LONG_SAMPLE = 256  # tokens of the end-of-run sample past which it is announced (it shows no progress)
MAX_THREADS = 1024  # --threads' own bound (settings.py): OpenMP could not start 100000


def default_threads(local_world: int, env: dict[str, str] | None = None) -> int:
    """Torch threads a rank takes when --threads is not given: OMP_NUM_THREADS where it is a whole
    number (what a launcher or the user set for every OpenMP program: `pipezero train --nproc N`
    sets cores / N), else the cores shared by the node's ranks. A process that took every core
    while another busy process shared them waited at each operator's thread barrier: a tiny
    model's linear went from 18 us to over 1 ms (2 cores, 2 threads, other processes busy)."""
    text = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    if text.isdigit() and 0 < int(text) <= MAX_THREADS:  # another value: OpenMP's own to refuse or clamp
        return int(text)
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


@dataclass
class Trainer:
    """One rank's run: `set_up` once (process group, corpus, stage, resume, what the run writes),
    then `step` for each step, then `finish`. The stage is the rank's plan and the state that plays
    it; this object holds the run's own progress: data read, tokens trained, bad steps in a row,
    the figures the summary reports. `train` drives it; a step is one call, so a caller (a test, a
    notebook) can stop between any two."""

    cfg: TrainConfig
    stage: Stage
    corpus: Corpus
    spec: ModelSpec | None  # a model of one's own, else cfg.model's
    frozen: list[tuple[str, torch.nn.Parameter]]  # --freeze: saved whole, no optimizer state
    result: RunResult
    start: int  # the first step to train (a resumed run's checkpoint step)
    read: int  # samples read so far (the data position)
    trained: int  # targets trained on so far
    bad_in_a_row: int
    eval_set: list
    eval_tokens: int
    metrics: MetricsLog | None  # rank 0's
    board: TensorBoardLog | None
    sync: Callable[[], None]
    peak_live: int = 0
    peak_gathered_run: int = 0
    bubbles: list[float] = field(default_factory=list)  # per steady step: share spent blocked on peers
    # --memory-profile: open from before the model is built to the first step's end, then again
    # around the first evaluation and the text sample (telemetry/memory_profile.py)
    meter: PeakMeter | None = None
    # Writes the rank's flight record for the hang doctor when a wait stalls or fails (a thread of
    # its own: a rank blocked in a wait cannot speak); stopped by `finish`, or by `train` on failure.
    watch: Watch | None = None

    @classmethod
    def set_up(cls, cfg: TrainConfig, spec: ModelSpec | None = None, trial: bool = False) -> Trainer:
        """`trial`: steps timed and thrown away (--layout auto's trials, planner/auto_trials.py): no
        config.json, metrics or TensorBoard log written."""
        p, r = cfg.parallel, cfg.run
        if r.tensorboard:  # every rank, before any process group: all stop alike when it is missing
            require_tensorboard()
        rank, device = init_distributed(cfg)
        use_tf32(device)
        torch.manual_seed(r.seed)
        torch.set_num_threads(r.threads or default_threads(int(os.environ.get("LOCAL_WORLD_SIZE", p.world_size))))
        corpus = load_corpus(cfg.data)
        model = spec or spec_of(cfg.model)
        check_corpus(cfg, corpus, model.vocab_size)
        meter = PeakMeter(device).__enter__() if r.memory_profile else None  # from nothing: the model is built inside
        stage = build_stage(cfg, rank, device=device, spec=model)
        frozen = frozen_params(stage.chunks)
        found = resume(cfg, stage.zero, frozen, spec, corpus.record)
        start, bad_in_a_row = (found.manifest["step"], found.manifest["bad_in_a_row"]) if found else (0, 0)
        g = cfg.global_batch
        # samples read before `start`: saved with the checkpoint, so a resume with another global batch
        # goes on where the data stopped (checkpoints from before this was saved: start x G)
        read = found.manifest.get("data", {}).get("samples", start * g) if found else 0
        lead, out = rank == 0 and not trial, Path(r.out)
        if lead:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(out / "config.json", cfg.to_dict())
            if cfg.model.pretrained is not None:  # what `export --format hf` writes back beside the weights
                from pipezero.models.hf import keep_metadata

                keep_metadata(Path(cfg.model.pretrained), out / "hf")
        # The held-out windows: `eval_batches` global batches of them, spaced over the held-out data, so
        # which windows (and so the held-out loss) depends on the global batch alone, never on P, D, M
        # or B; each replica evaluates its share, cut as training cuts a batch.
        (held,) = corpus.eval_batches(1, r.eval_batches * g, cfg.data.seq_len)
        eval_set = corpus.microbatches(held, stage.mesh.dp_rank, p.dp, r.eval_batches * p.microbatches)
        metrics = MetricsLog(out / "metrics.jsonl", keep_steps=start) if lead else None
        # tokens trained on so far (targets that carry loss: not padding, not ignored boundaries);
        # without the old log's figure, the windows read so far
        trained = metrics.tokens if metrics and metrics.tokens is not None else read * cfg.data.seq_len
        result = RunResult(unigram=unigram_entropy(corpus.train), out=out, resumed_from=start)
        return cls(cfg, stage, corpus, spec, frozen, result, start, read, trained, bad_in_a_row, eval_set,
                   int((held[1] != IGNORE).sum()), metrics, TensorBoardLog(out) if lead and r.tensorboard else None,
                   synchronizer(device) or (lambda: None), meter=meter,
                   watch=start_watch(cfg, stage, run_of_trial(out) if trial else None))

    @property
    def shows_progress(self) -> bool:
        return not self.cfg.run.quiet and self.stage.mesh.rank == 0

    def announce(self, progress: StepProgress) -> None:
        """The run's opening lines: model, corpus, layout, a learning-rate warning."""
        cfg, p, stage = self.cfg, self.cfg.parallel, self.stage
        progress.console.print(
            f"model {cfg.model.preset if self.spec is None else type(self.spec).__name__}: "
            f"{sum(stage.spec.layer_param_counts()) / 1e6:.2f}M parameters, "
            f"{stage.spec.flops_per_token(cfg.data.seq_len) / 1e6:.1f} MFLOP/token; corpus {self.corpus.source}: "
            f"{len(self.corpus.train):,} train tokens, unigram baseline {self.result.unigram:.3f} nats; "
            f"layout pp={p.pp} dp={p.dp} zero={p.zero} schedule={p.schedule.value} M={p.microbatches}; "
            f"layers per stage chunk (embedding + blocks + head, policy {p.partition.value}): "
            f"{[b - a for a, b in stage.bounds]}")
        if note := short_of_peak(cfg.optim, cfg.run.max_steps):
            progress.console.print(f"warning: {note}")

    def step(self, step: int) -> dict:
        """Train step `step` (0-based), evaluate and save when due; the step's metrics record."""
        cfg, p, r, stage, result = self.cfg, self.cfg.parallel, self.cfg.run, self.stage, self.result
        lr = lr_at(step, cfg.optim, r.max_steps)
        t0 = time.perf_counter()
        stage.tracer.step = step + 1  # the one step counter: p2p's and ZeRO's messages read it too
        g = cfg.global_batch
        batch = self.corpus.batch(step, self.read, r.seed, g, cfg.data.seq_len)
        self.read += g
        mbs = self.corpus.microbatches(batch, stage.mesh.dp_rank, p.dp, p.microbatches)
        self.peak_gathered_run = max(self.peak_gathered_run, stage.zero.peak_gathered)  # incl. evaluations
        stage.zero.reset_peak()  # from here to the optimizer step: this step's training
        stage.zero.begin_step()
        # the mean over the global batch's targets; packing ignores those across a document boundary
        counted = int((batch[1] != IGNORE).sum())
        stats = stage.executor.run(stage.program, mbs, max(1, counted),
                                   lambda loss: stage.zero.step(lr, cfg.optim.grad_clip, stage.groups.world, loss))
        self.peak_live = max(self.peak_live, stats.peak_live)
        outcome = stats.outcome
        assert outcome is not None  # every program ends its step with OPTIM_STEP (the executor checks)
        if self.meter is not None and "train" not in self.meter.phases:  # the first step's peak
            stage.zero.settle("memory profile")  # the step's gathers landed within the phase measured
            self.meter.pause("train")
            self.measured()
        stage.executor.flight.outside("after OPTIM_STEP")
        self.bad_in_a_row = 0 if outcome.applied else 1 + self.bad_in_a_row
        if not outcome.applied:
            report_nonfinite(outcome, float(stats.loss), step + 1, stage.mesh.pp_rank, self.bad_in_a_row,
                             r.max_bad_steps)
            result.skipped_steps.append(step + 1)
        self.sync()  # the step's time includes its queued kernels (the optimizer's, the gathers')
        dt = time.perf_counter() - t0
        busy = stage.executor.clock.busy_share()  # GPU: idle time between compute actions
        bubble = 1.0 - busy if busy is not None else \
            stats.wait_s / stats.elapsed_s if stats.elapsed_s else 0.0  # CPU: share blocked on peers
        steady = step > self.start or r.max_steps == 1  # the first step pays one-off costs (allocations, warm-up)
        if steady:
            self.bubbles.append(bubble)
        stage.peaks.mark("train" if steady else None)  # not the first step's
        result.losses.append(outcome.loss)
        result.grad_norms.append(outcome.grad_norm)
        result.peak_rss_training = rss = peak_rss_bytes()  # before this step's evaluation
        self.trained += counted
        record = {"step": step + 1, "loss": finite_or_none(outcome.loss), "lr": lr,
                  "grad_norm": finite_or_none(outcome.grad_norm), "tokens": self.trained,
                  "step_time_s": dt, "tokens_per_s": counted / dt,
                  "bubble": bubble, "peak_rss_mib": rss / 2**20,  # this (the writing) rank's
                  "bytes_sent": stage.executor.p2p.bytes_sent + stage.zero.bytes_sent}  # so far, before eval
        if not outcome.applied:
            record["skipped"] = True
        result.peak_gathered_training = max(result.peak_gathered_training, stage.zero.peak_gathered)
        if (r.eval_every and (step + 1) % r.eval_every == 0) or step + 1 == r.max_steps:
            stage.executor.flight.outside("evaluation")
            record["heldout_loss"] = result.heldout[step + 1] = self.evaluate()
        if self.metrics:
            self.metrics.write(record)
        if self.board:
            self.board.write(record)
        if saves_after(cfg, step + 1):
            stage.executor.flight.outside("checkpoint")
            save(cfg, stage.zero, step + 1, self.bad_in_a_row, data={"samples": self.read, **self.corpus.record},
                 frozen=self.frozen, spec=self.spec)
        return record

    def evaluate(self) -> float:
        """The held-out loss; its peak memory is the phase `eval` (the meter read before the
        device's phase peaks reset)."""
        loss = self.metered("eval", lambda: evaluate(self.stage, self.eval_set, self.eval_tokens))
        self.stage.peaks.mark("eval")
        return loss

    def metered(self, phase: str, fn: Callable[[], T]) -> T:
        """`fn()`, its peak memory measured as `phase`'s the first time (--memory-profile: every
        evaluation is alike, so the first stands for all and the others run unprofiled)."""
        if self.meter is None or phase in self.meter.phases:
            return fn()
        self.meter.resume()
        try:
            return fn()
        finally:
            self.meter.pause(phase)
            self.measured()

    def measured(self) -> None:
        """The result's measured peak: the most of every phase measured so far, and each phase's."""
        assert self.meter is not None
        self.result.measured_peak_bytes = self.meter.peak_bytes
        self.result.measured_phases = dict(self.meter.phases)

    def stop_watch(self, finished: bool = True) -> None:
        if self.watch is not None:
            self.watch.stop(finished)
            self.watch = None

    def finish(self, progress: StepProgress | None, snapshot: bool = False) -> RunResult:
        """After the last step: the final evaluation if a resume skipped it, the text sample, and
        summary.json; with `snapshot`, this rank's final parameters (a full copy: tests, not big runs)."""
        cfg, stage, result = self.cfg, self.stage, self.result
        stage.executor.flight.outside("end of run")
        stage.zero.settle("end of run")  # nothing in flight past the loop (summary, snapshot)
        if self.metrics:
            self.metrics.close()
        if cfg.run.max_steps not in result.heldout:  # resumed from a checkpoint of the last step
            result.heldout[cfg.run.max_steps] = self.evaluate()
        result.peak_live = self.peak_live
        result.measured_bubble = sum(self.bubbles) / len(self.bubbles) if self.bubbles else 0.0
        if will_sample(cfg, self.corpus):
            if stage.mesh.rank == 0 and cfg.run.sample_tokens > LONG_SAMPLE:  # a token a forward: minutes, silent
                print(f"pipezero: sampling {cfg.run.sample_tokens} tokens of text (Ctrl-C skips it; summary.json is "
                      f"written either way)", file=sys.stderr, flush=True)
            try:
                result.sample_text = self.metered("sample", lambda: end_sample(cfg, stage, self.corpus))
                stage.peaks.mark("sample")
            except KeyboardInterrupt:  # a lone process: the run is trained and saved, the summary still due
                if stage.mesh.world_size > 1:  # a rank among others may be inside a gather: the job stops whole
                    raise
                print("pipezero: text sample skipped (Ctrl-C); writing summary.json", file=sys.stderr, flush=True)
        result.peak_gathered_run = max(self.peak_gathered_run, stage.zero.peak_gathered)
        finish_run(cfg, stage, self.corpus, result, progress, self.board, own_model=self.spec is not None)
        self.stop_watch()
        if self.board:
            self.board.close()
        if snapshot:  # every rank takes part: ZeRO-3 gathers are collectives
            named = [(n, q) for c in sorted(stage.chunks) for n, q in stage.chunks[c].named_parameters()]
            stage.zero.gather_all()
            result.params = {n: q.detach().clone() for n, q in named}  # frozen too
            stage.zero.release_all()
        return result


def train(cfg: TrainConfig, snapshot: bool = False, spec: ModelSpec | None = None,
          choice: dict | None = None) -> RunResult:
    """Train as the configuration says, on one process or as one rank of a pp x dp job. With
    `snapshot`, the result holds this rank's final parameters (a full copy: tests, not big runs).
    `spec`: a model of one's own (models/spec.py, examples/own_model.py) instead of cfg.model's.
    `choice`: --layout auto's (auto.LayoutChoice.to_json()), whose prediction the run checks."""
    trainer = Trainer.set_up(cfg, spec)
    check = LayoutCheck(choice) if choice is not None and trainer.stage.mesh.rank == 0 else None
    trainer.result.layout_check = check
    show = trainer.shows_progress
    if trainer.stage.mesh.rank == 0 and cfg.model.pretrained is not None:
        from pipezero.models.hf_weights import unread_blocks  # a pretrained folder's reader: only for one

        if note := unread_blocks(cfg.model):
            print(f"pipezero: warning: {note}", file=sys.stderr, flush=True)
    try:
        with StepProgress(cfg.run.max_steps, trainer.start, show, bar=cfg.run.progress) as progress:
            if show:
                trainer.announce(progress)
            for step in range(trainer.start, cfg.run.max_steps):
                record = trainer.step(step)
                if check and (said := check.observe(record, step == trainer.start, step + 1 == cfg.run.max_steps)):
                    print(f"pipezero: warning: {said}", file=sys.stderr, flush=True)
                progress.update(step, trainer.result.losses[-1], record["tokens_per_s"])
        result = trainer.finish(progress if show else None, snapshot)
    finally:
        trainer.stop_watch(finished=False)  # a failed run's: its records stay as they were written
    release(trainer.stage, cfg.parallel.timeout_s)
    return result


def release(stage: Stage, timeout_s: float) -> None:
    """A finished run's process groups destroyed and its threads stopped, once every rank is past its
    last collective (an all-reduce over the world, bounded as every wait is). Left alive, each gloo
    group's transport thread wakes every 10 ms for the life of the process (~1 ms of CPU a second a
    group): a process that trains again and again (a notebook, a sweep, the tests' ranks) would keep
    every earlier run's groups polling. A failed run keeps its groups: a peer may be gone, and the
    process is ending."""
    for h in (stage.zero.hierarchy, stage.zero.node):
        if h is not None:
            h.close()  # its thread: nothing more to run on it
    if stage.groups.world is None:  # one process: no group
        return
    if (sync := synchronizer(stage.zero.device)) is not None:
        sync()  # NCCL's waits order the stream: its last collectives may still run on the device
    all_reduced([0.0], stage.groups.world, timeout_s,
            f"rank {stage.mesh.rank}: end of run: every rank past its last collective before the run's groups close")
    for g in {id(g): g for g in stage.subgroups}.values():
        dist.destroy_process_group(g)


def evaluate(stage: Stage, eval_set: list, eval_tokens: int) -> float:
    """Mean held-out token loss over every replica's share (collective over all ranks: each
    replica's last stage holds its share's summed loss, every other rank zero)."""
    p2p = stage.executor.p2p
    what = (f"rank {p2p.rank}, step {stage.tracer.step}: held-out evaluation: all-reduce of the loss across "
            f"{stage.mesh.world_size} ranks")
    total = stage.executor.evaluate(stage.evaluation(len(eval_set)), eval_set,
                                    lambda local: all_reduced([float(local)], stage.groups.world, p2p.timeout_s, what)[0])
    return total / eval_tokens


def will_sample(cfg: TrainConfig, corpus: Corpus) -> bool:
    """The end-of-run text sample needs the whole model in one process: only without a pipeline."""
    return bool(cfg.run.sample_tokens) and corpus.tokenizer is not None and cfg.parallel.pp == 1


def end_sample(cfg: TrainConfig, stage: Stage, corpus: Corpus) -> str:
    """The end-of-run text sample, decoded on rank 0: the executor plays the rank's sample program
    (schedules/forward_only.py: one forward a token; layer by layer at ZeRO-3 every replica samples
    the same tokens, each forward gathering and releasing its layers, so the whole model never exists
    at once; otherwise rank 0 samples, kept-gathered ZeRO-3's ranks all gathering around it)."""
    if not will_sample(cfg, corpus):
        return ""
    sampler = Sampler(corpus.tokenizer.encode_many(["def "])[0], stage.spec.max_seq_len or cfg.data.seq_len,
                      cfg.run.seed, vocab=corpus.vocab_size)
    stage.executor.sample(stage.sample(cfg.run.sample_tokens), sampler)
    return corpus.tokenizer.decode(sampler.ids) if stage.mesh.rank == 0 else ""
