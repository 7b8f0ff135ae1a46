"""What a run returns and what it leaves in summary.json: every rank's figures, gathered to rank 0,
beside what the simulator and the ZeRO paper predict for the layout."""

from __future__ import annotations

import math
import os
import resource
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipezero.config import TrainConfig
from pipezero.planner.auto_check import summary_entry
from pipezero.freeze import frozen_params, saved_bytes, summarize
from pipezero.nonfinite import finite_or_none
from pipezero.doctor import Ranks, planned_work, stragglers
from pipezero.parallel.waits import gather_objects
from pipezero.telemetry.metrics import StepProgress
from pipezero.telemetry.tensorboard import TensorBoardLog
from pipezero.telemetry.trace import write_trace
from pipezero.files import atomic_write_json
from pipezero.zero.accounting import explain, held_bytes

if TYPE_CHECKING:
    from pipezero.data import Corpus
    from pipezero.stage import Stage


# What summary.json holds, key by key, and what each rank's entry under "ranks" holds. The reference
# page of the run's files is generated from these tables; a training test compares them with the keys
# a run writes, so neither can change without the other.
SUMMARY_FIELDS: dict[str, str] = {
    "layout": "pp, dp, zero, schedule, microbatches and virtual_stages of the run",
    "params": "parameters of the whole model (every layer counted once)",
    "unigram_baseline": "held-out loss of a model that knows only token frequencies, in nats: the bar to beat",
    "final_heldout_loss": "held-out loss after the last step",
    "final_loss": "training loss of the last step (null when non-finite)",
    "steps": "run.max_steps",
    "resumed_from": "the checkpoint step the run continued from (0: a fresh start)",
    "skipped_steps": "steps skipped for a non-finite loss or gradient norm",
    "peak_live_activations": "most chunk activations held at once, measured on one rank a stage beside the "
                             "simulator's peak for the schedule",
    "simulated_bubble": "the schedule's bubble as the simulator plays it at F:B:W = 1:1:1",
    "measured_bubble": "each rank's mean idle share over the steps after the first",
    "shared_cores": "CPU runs: the most crowded host ({host, ranks, cores}) when a host ran more ranks than it has "
                    "cores, whose measured bubble then includes waiting for a core; else null",
    "bytes_sent": "bytes each rank sent, p2p and collectives apart",
    "ranks": "every rank's own figures (the table below)",
    "zero_memory": "the ZeRO paper's and pipezero's bytes a parameter for the stage, what --grad-reduce costs, and "
                   "each rank's measured held bytes a parameter",
    "frozen": "the --freeze pattern, frozen parameters of one replica, and the gradient and optimizer bytes "
              "freezing saved over every rank",
    "memory": "ranks: each rank's predicted_peak_bytes, the most of its phases (predicted_phase_bytes: train, "
              "eval, sample), and the categories at it (memory/model.py; null for a model of one's own), and with "
              "--memory-profile its measured_peak_bytes and measured_phase_bytes: the first step, the first "
              "evaluation and the text sample (else null)",
    "zero3_prefetch": "ZeRO-3 layer by layer: the prefetch depth asked for (a number or auto), the depth the program "
                      "placed, why (auto: the planner's phrase, planner/prefetch.py) and the simulated exposed seconds a "
                      "micro-batch at depth 1, 2, ... as far as auto tried, and the unit the depth counts (layer, or "
                      "sublayer: a block's attention and MLP apart); null without layer-by-layer gathers",
    "layout_choice": "with --layout auto: the chosen layout's flags, predicted and measured step time "
                     "(median of the steps after the first) and peak GiB (measured: --memory-profile, or a GPU's "
                     "allocator), the step's terms, the runners-up and the costs chosen with; trials: the near-ties "
                     "tried in the job (flags, predicted_step_s, trial_step_s), picked_by (measured fastest in "
                     "trials, or model's choice) and trials_cut, the budget's line where it cut them short (else null)",
    "straggler": "the rank that made the others wait most a step (rank, stage, s_per_step; every rank's in "
                 "by_rank): how far its own work (compute less the waits inside it; every rank's in own_work_s, "
                 "seconds a step) ran past its stage's replicas' (compared_with; at D = 1, past the others' "
                 "through the plan's cost of each rank's work); {} for one rank (docs/how-to/hang-doctor.md)",
}
RANK_FIELDS: dict[str, str] = {
    "peak_live": "most chunk activations this rank held at once",
    "measured_bubble": "this rank's mean idle share of a step",
    "held_bytes": "bytes held on the device between steps for parameters, gradients and optimizer state, and "
                  "ZeRO-3's secondary share of each bucket with --secondary-shard node",
    "host_bytes": "with --offload optimizer: bytes held in host memory for the optimizer (fp32 copies of the "
                  "updated weights, gradient buffers, AdamW's moments); else 0",
    "host_activation_peak_bytes": "with --offload-activations: the most bytes of saved activations this rank held in "
                                  "host memory at once; else 0",
    "params": "parameters in this rank's ZeRO buckets",
    "p2p_bytes_sent": "activation and gradient bytes sent to other stages",
    "collective_bytes_sent": "bytes sent in data-parallel collectives (reductions, gathers)",
    "peak_rss_bytes": "resident-memory high-water mark of the whole run",
    "host": "the host name this rank ran on",
    "cores": "the cores this rank's process could run on",
    "two_level": "with --hierarchical: [nodes, ranks a node] of this rank's group; else null",
    "frozen": "this rank's frozen parameters and the gradient and optimizer bytes that saved",
    "peak_rss_bytes_training": "resident-memory high-water mark at the end of the last training step",
    "waits_s": "seconds this rank was blocked: on each peer's transfers (p2p, by rank), in data-parallel "
               "collectives, and in the optimizer step's all-reduce over the world",
    "work": "own_s: seconds of this rank's compute instructions (F, B, W, BW) less the waits inside them, over "
            "`steps` training steps (those after the first when there are more); planned: the plan's cost of one "
            "step of them (layer costs); for the straggler",
    "zero3_gathered_peak_bytes": "ZeRO-3: most parameter bytes gathered at once, in training and over the run",
    "measured_peak_bytes": "with --memory-profile: this rank's peak memory over the first step, the first "
                           "evaluation and the text sample (CUDA: allocator peak; CPU: live tensor bytes); else null",
    "measured_phase_bytes": "with --memory-profile: the peak of each phase measured (train: the first step, eval: the "
                            "first evaluation, sample: the text sample); else null",
    "peak_device_bytes": "on GPUs only: allocated and reserved peaks of the training steps after the first, of "
                         "evaluation and of the text sample",
}


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
    measured_peak_bytes: int | None = None  # --memory-profile: this rank's peak over the phases measured
    measured_phases: dict[str, int] = field(default_factory=dict)  # --memory-profile: each phase's peak
    layout_check: Any = None  # --layout auto: the prediction and the steps measured (planner/auto_check.py)


def peak_rss_bytes() -> int:
    """This process's resident-memory high-water mark (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_figures(cfg: TrainConfig, own_model: bool, cuda: bool, per_rank: list[dict]) -> dict:
    """summary.json's `memory`: the memory model's peak per rank beside the measured one. The model
    knows the built-in decoder's layers, not a spec of one's own (its prediction is null)."""
    from pipezero.memory.model import predict
    from pipezero.memory.partition import resolve

    predicted = None if own_model or cfg.model.spec is not None else predict(resolve(cfg, cuda), cuda)
    return {"ranks": [{"rank": r, "measured_peak_bytes": x["measured_peak_bytes"],
                       "predicted_peak_bytes": predicted[r].peak_bytes if predicted else None,
                       "measured_phase_bytes": x.get("measured_phase_bytes"),
                       "predicted_phase_bytes": predicted[r].phases if predicted else None,
                       "categories": predicted[r].categories if predicted else None}
                      for r, x in enumerate(per_rank)]}


def prefetch_figures(cfg: TrainConfig, stage: "Stage") -> dict | None:
    """summary.json's `zero3_prefetch`: what was asked, the depth the plan placed, why, and its unit."""
    if not stage.plan.layerwise:
        return None
    from pipezero.memory.model import prefetch_choice

    asked = cfg.parallel.zero3_prefetch
    choice = prefetch_choice(cfg, stage.zero.device.type == "cuda")
    return {"asked": asked, "depth": stage.plan.depth, "why": choice.why if asked == "auto" else "set",
            "exposed_s": list(choice.exposed_s), "unit": "sublayer" if stage.plan.buckets.sublayer else "layer"}


def shared_cores(per_rank: list[dict]) -> dict | None:
    """The most crowded host when some host runs more CPU ranks than it has cores: their measured
    bubble then holds time spent waiting for a core, which the simulated bubble does not model."""
    hosts: dict[str, dict] = {}
    for x in per_rank:
        h = hosts.setdefault(x["host"], {"host": x["host"], "ranks": 0, "cores": x["cores"]})
        h["ranks"] += 1
    crowded = [h for h in hosts.values() if h["ranks"] > h["cores"]]
    return max(crowded, key=lambda h: h["ranks"] / h["cores"]) if crowded else None


def own_work(cfg: TrainConfig, stage: "Stage") -> dict[str, float]:
    """This rank's own work over the run (seconds) and the plan's cost of one step of it."""
    costs = stage.spec.layer_costs(cfg.data.seq_len)
    chunks = [sum(costs[a:b]) for a, b in stage.bounds]
    return {**stage.executor.flight.work(), "planned": planned_work(stage.program, chunks)}


def finish_run(cfg: TrainConfig, stage: "Stage", corpus: "Corpus", result: RunResult,
               progress: StepProgress | None, board: TensorBoardLog | None = None, own_model: bool = False) -> None:
    """Gather per-rank figures into summary.json (rank 0) and print the end-of-run sample."""
    p, r = cfg.parallel, cfg.run
    mine = {"peak_live": result.peak_live, "measured_bubble": result.measured_bubble,
            "held_bytes": held_bytes(stage.zero.all_buckets(), stage.zero.rules,
                                     0 if (host := stage.zero.host) else stage.zero.opt.state_bytes()),
            "host_bytes": host.host_bytes() if host else 0,
            "host_activation_peak_bytes": stage.executor.host_activation_peak,
            "params": sum(b.numel for b in stage.zero.all_buckets()),
            "p2p_bytes_sent": stage.executor.p2p.bytes_sent, "collective_bytes_sent": stage.zero.bytes_sent,
            "peak_rss_bytes": peak_rss_bytes(), "host": socket.gethostname(), "cores": len(os.sched_getaffinity(0)),
            "two_level": [h.nodes, h.per_node] if (h := stage.zero.hierarchy) else None,  # --hierarchical: K x N
            "frozen": saved_bytes(p.zero, p.dp, sum(q.numel() for _, q in frozen_params(stage.chunks))),
            "peak_rss_bytes_training": result.peak_rss_training,
            "zero3_gathered_peak_bytes": {"training": result.peak_gathered_training, "run": result.peak_gathered_run},
            "measured_peak_bytes": result.measured_peak_bytes,
            "measured_phase_bytes": result.measured_phases or None,
            "waits_s": stage.executor.flight.waits(),  # blocked on each peer and in collectives
            "work": own_work(cfg, stage)}  # who is slow: the straggler
    if stage.peaks.phases:
        mine["peak_device_bytes"] = stage.peaks.phases  # training steps after the first, evaluation
    end = f"rank {stage.mesh.rank}: end of run"
    per_rank = gather_objects(mine, f"{end}: every rank's figures for summary.json")
    events = gather_objects(stage.tracer.events, f"{end}: every rank's trace") if r.trace else [stage.tracer.events]
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
    crowded = shared_cores(per_rank) if stage.executor.p2p.device.type == "cpu" else None
    atomic_write_json(result.out / "summary.json", {
        "layout": {**layout, "zero": p.zero},
        "params": sum(stage.spec.layer_param_counts()), "unigram_baseline": result.unigram, "final_heldout_loss": final,
        "final_loss": finite_or_none(result.losses[-1]) if result.losses else None, "steps": r.max_steps,
        "resumed_from": result.resumed_from, "skipped_steps": result.skipped_steps,
        "peak_live_activations": {"measured": [per_rank[r]["peak_live"] for r in one_replica],
                                  "simulated": stage.predicted.peak_activations},
        "simulated_bubble": stage.predicted.bubble,
        "measured_bubble": [x["measured_bubble"] for x in per_rank],
        "shared_cores": crowded,
        "bytes_sent": {"p2p": [x["p2p_bytes_sent"] for x in per_rank],
                       "collectives": [x["collective_bytes_sent"] for x in per_rank]},
        "ranks": per_rank,
        "zero_memory": {**explain(p.zero, p.dp, r.dtype, p.grad_reduce, p.microbatches, p.buckets_in_flight),
                        "held_bytes_per_param": [sum(x["held_bytes"].values()) / max(1, x["params"])
                                                     for x in per_rank]},
        "frozen": summarize([x["frozen"] for x in per_rank], cfg.optim.freeze, one_replica),
        "memory": memory_figures(cfg, own_model, stage.zero.device.type == "cuda", per_rank),
        "zero3_prefetch": prefetch_figures(cfg, stage),
        "straggler": stragglers([x["work"] for x in per_rank], Ranks(p.pp, p.dp, p.placement.value)),
        "layout_choice": summary_entry(result.layout_check, per_rank),
    })
    if progress:
        bubble = sum(x["measured_bubble"] for x in per_rank) / len(per_rank)
        sent = sum(x["p2p_bytes_sent"] + x["collective_bytes_sent"] for x in per_rank)
        why = (f", {crowded['ranks']} ranks shared {crowded['cores']} cores: they waited for cores as well as for "
               f"each other" if crowded else "")
        progress.console.print(f"held-out loss {final:.4f} (unigram baseline {result.unigram:.4f}); measured bubble "
                               f"{bubble:.1%} (simulated {stage.predicted.bubble:.1%}{why}); {sent / 2**20:,.1f} MiB "
                               f"sent; run in {result.out}")
        gpu = [x["peak_device_bytes"]["train"] for x in per_rank if "train" in x.get("peak_device_bytes", {})]
        if gpu:
            progress.console.print("GPU peak memory in training steps (allocated / reserved GiB, by rank): " + ", ".join(
                f"{g['allocated'] / 2**30:.2f} / {g['reserved'] / 2**30:.2f}" for g in gpu))
        if result.sample_text:
            progress.console.print("sample:\n" + printable(result.sample_text))


def printable(text: str) -> str:
    """`text` with control characters other than newline and tab escaped as Python writes them
    (\\x1b): a model's sample may draw any byte, and ESC or NUL would reach the terminal raw."""
    return "".join(c if c in "\n\t" or c.isprintable() else repr(c)[1:-1] for c in text)
