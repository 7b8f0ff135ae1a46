"""`train --layout auto`: the planner (planner/search.py) chooses the layout the run trains with.

The choice reads three things: the world size the launcher gave (`--nproc`, torchrun's or srun's
WORLD_SIZE), a rank's memory limit (`--gpu-memory`; on CPU ranks, whose device is the host, the
host's memory shared by its ranks) and this machine's costs (a probe run inside the job,
pipezero/probe.py, or a file of them, `--costs FILE`). Layout flags given beside it (`--pp`,
`--zero`, `--schedule`, ...) are constraints: only layouts with those values are weighed. The global
batch is `--global-batch` (sequences a step; the default M x B x D of the settings otherwise),
the same for every candidate, so any of them trains the same sequences a step.

Every rank must train the same layout, and a probe's figures differ by rank (its own timings, its
own load). So the choice is made once: by rank 0 from its probe and the links all ranks timed
together, then sent to every rank as JSON (never a pickle). Without a probe (`--costs FILE`) the
same inputs give every rank the same answer. This module is the choice itself, pure and testable in
one process; `choose_in_job` is the part that runs inside the job.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

from pipezero.config import GradReduce, Placement, TrainConfig
from pipezero.errors import ConfigError
from pipezero.planner.layouts import Cluster, Layout

# Layout settings the choice sets; any of them given (a flag, or a key of --config's file) is a
# constraint the chosen layout keeps.
CHOSEN = ("parallel.pp", "parallel.dp", "parallel.zero", "parallel.schedule", "parallel.virtual_stages",
          "parallel.micro_batch_size", "parallel.microbatches", "parallel.recompute", "parallel.grad_reduce",
          "parallel.placement", "parallel.hierarchical")
# Layout settings the planner does not choose between: with --layout auto they are refused.
NOT_CHOSEN = ("parallel.stage_layers", "parallel.partition", "parallel.offload", "parallel.offload_activations")
# What a probe inside the job may take, each figure's repetitions (probe.py `budget_s`): the block's
# four timings, the two links' two sizes and the host's two figures, a few seconds in all.
PROBE_BUDGET_S = 0.15
SEARCH_BUDGET = 100_000  # schedule actions the search simulates (schedules/limits.py PLAN_BUDGET's half)
RUNNERS_UP = 3
MODELS_CHOICE = "model's choice"  # why the first of a choice's ranked layouts is trained, without trials' word


@dataclass(frozen=True)
class LayoutChoice:
    """The layouts that fit, fastest first (the chosen one first), and what the search did."""

    ranked: list[dict[str, Any]]  # `describe_estimate` of the chosen layout and the next RUNNERS_UP (`runners_up`)
    fitting: int  # layouts that fit
    weighed: int  # layouts estimated
    skipped: int  # layouts left out by the search's budget
    seconds: float  # the search's time
    costs: dict[str, Any]  # the cluster the choice priced (rates, links, memory limit)
    # the trial steps that settled near-ties (planner/auto_trials.py): each tried layout's flags, prediction and
    # trial step; why the first of `ranked` is trained; the budget's line where it cut the trials short
    trials: list[dict[str, Any]] = field(default_factory=list)
    picked_by: str = MODELS_CHOICE
    trials_cut: str | None = None

    @property
    def chosen(self) -> dict[str, Any]:
        return self.ranked[0]

    def to_json(self) -> dict[str, Any]:
        return {"ranked": self.ranked, "fitting": self.fitting, "weighed": self.weighed, "skipped": self.skipped,
                "seconds": self.seconds, "costs": self.costs, "trials": self.trials, "picked_by": self.picked_by,
                "trials_cut": self.trials_cut}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LayoutChoice:
        return cls(d["ranked"], d["fitting"], d["weighed"], d["skipped"], d["seconds"], d["costs"],
                   d.get("trials", []), d.get("picked_by", MODELS_CHOICE), d.get("trials_cut"))


def layout_settings(lay: Layout) -> dict[str, Any]:
    """`lay` as train's settings (values as text, as flags give them); those left at their default
    are not named, as train refuses a setting the layout does not read (placement at P = 1)."""
    out = {"parallel.pp": str(lay.pp), "parallel.dp": str(lay.dp), "parallel.zero": str(lay.zero),
           "parallel.schedule": lay.schedule.value, "parallel.virtual_stages": str(lay.virtual),
           "parallel.micro_batch_size": str(lay.micro_batch), "parallel.microbatches": str(lay.microbatches)}
    if lay.recompute:
        out["parallel.recompute"] = True
    if lay.grad_reduce is not GradReduce.STEP:
        out["parallel.grad_reduce"] = lay.grad_reduce.value
    if lay.pp > 1 and lay.dp > 1:
        out["parallel.placement"] = lay.placement.value
    if lay.hierarchical:
        out["parallel.hierarchical"] = True
    out["parallel.quantize_weights"] = f"int{lay.weight_bits}" if lay.weight_bits else "none"
    out["parallel.quantize_grads"] = f"int{lay.grad_bits}" if lay.grad_bits else "none"
    return out


def layout_flags(lay: Layout) -> str:
    """The train flags that reproduce `lay` (memory/fit.py `flags`, with what else the choice sets)."""
    from pipezero.memory.fit import flags

    out = flags(lay)
    if lay.placement is not Placement.DP_INNER:
        out += f" --placement {lay.placement.value}"
    if lay.hierarchical:
        out += " --hierarchical"
    if lay.weight_bits:
        out += f" --quantize-weights int{lay.weight_bits}"
    if lay.grad_bits:
        out += f" --quantize-grads int{lay.grad_bits}"
    return out


def describe_estimate(e: Any) -> dict[str, Any]:
    """One ranked layout: its flags and settings and the figures the prediction check compares."""
    busy = e.step_time_s - e.dp_comm_s - e.offload_s
    return {"flags": layout_flags(e.layout), "settings": layout_settings(e.layout),
            "quantize_weights_bits": e.layout.weight_bits, "quantize_grads_bits": e.layout.grad_bits,
            "predicted_step_s": e.step_time_s, "predicted_peak_gib": e.memory_gib, "bubble": e.bubble,
            "exposed_comm_s": e.dp_comm_s, "predicted_compute_s": busy * (1 - e.bubble),
            "predicted_idle_s": busy * e.bubble + e.dp_comm_s}


def constrained(lay: Layout) -> dict[str, Any]:
    """`lay`'s value of every setting a constraint may name (`parallel.x` -> its typed value)."""
    return {"parallel.pp": lay.pp, "parallel.dp": lay.dp, "parallel.zero": lay.zero,
            "parallel.schedule": lay.schedule, "parallel.virtual_stages": lay.virtual,
            "parallel.micro_batch_size": lay.micro_batch, "parallel.microbatches": lay.microbatches,
            "parallel.recompute": lay.recompute, "parallel.grad_reduce": lay.grad_reduce,
            "parallel.placement": lay.placement, "parallel.hierarchical": lay.hierarchical}


def matches(lay: Layout, wanted: dict[str, Any]) -> bool:
    """Whether `lay` keeps every constraint (`parallel.x` -> the typed value given)."""
    have = constrained(lay)
    return all(have[k] == v for k, v in wanted.items())


def never_weighed(every: list[Any], wanted: dict[str, Any]) -> str:
    """For a constraint whose value no layout weighed has (the search tries micro-batches of 1 to 8
    sequences only, say), the values it has: ": it weighs --x 1, 2 here; drop --x ..."; else ""
    (each value exists, just not together). "No layout has micro_batch_size = 16" alone read as if
    none could, where the search never tried one."""
    for key, value in wanted.items():
        seen = {constrained(e.layout)[key] for e in every}
        if value not in seen:
            flag = "--" + key.split(".")[1].replace("_", "-")
            words = (str(getattr(v, "value", v)) for v in seen)
            shown = ", ".join(sorted(words, key=lambda w: w.zfill(8)))  # numbers in their order, names alphabetically
            yourself = ("" if key in ("parallel.pp", "parallel.dp")  # a pp x dp not the world's runs nowhere
                        else ", or give the layout yourself (without --layout auto)")
            return f": it weighs {flag} {shown} here; drop {flag}{yourself}"
    return ""


def constraints(cfg: TrainConfig, given: set[str]) -> dict[str, Any]:
    """The layout settings the user gave (`given`: their keys), as the typed values `cfg` holds."""
    p = cfg.parallel
    values = {"parallel.pp": p.pp, "parallel.dp": p.dp, "parallel.zero": p.zero, "parallel.schedule": p.schedule,
              "parallel.virtual_stages": p.virtual_stages, "parallel.micro_batch_size": p.micro_batch_size,
              "parallel.microbatches": p.microbatches, "parallel.recompute": p.recompute,
              "parallel.grad_reduce": p.grad_reduce, "parallel.placement": p.placement,
              "parallel.hierarchical": p.hierarchical}
    return {k: values[k] for k in CHOSEN if k in given}


def cluster_for(cfg: TrainConfig, world: int, local: int, limit_gib: float, cuda: bool,
                costs: Any | None = None) -> Cluster:
    """The planner's cluster for this job: `world` ranks, `local` a node, `limit_gib` a rank, and
    `costs` (a Probe) in place of the presets where given. The planner admits the same share of
    the limit as train's fit check (schedules/limits.py FIT_MARGIN), so a chosen layout is never refused."""
    from pipezero.config import DType
    from pipezero.schedules.limits import FIT_MARGIN

    # CPU ranks: a probe's count of the job's cores (its nodes may share one host: the emulated
    # cluster), else this host's for every node
    cores = len(os.sched_getaffinity(0)) * max(1, world // max(1, local)) if not cuda else 0
    if not cuda and costs is not None and costs.cores:
        cores = costs.cores
    cluster = Cluster(gpus=world, gpu_memory_gib=limit_gib, node_size=max(1, min(local, world)), cpu=not cuda,
                      headroom=1 - FIT_MARGIN, wire_bytes=2 if cfg.run.dtype is DType.BF16 else 4,
                      bucket_mb=cfg.parallel.bucket_mb, cores=cores if cores and world > cores else 0,
                      tflops=0.05 if not cuda else 989.0, mfu=1.0 if not cuda else 0.45,
                      intra_gbps=1.0 if not cuda else 300.0, inter_gbps=0.1 if not cuda else 25.0)
    if costs is None:
        return cluster
    node, across = costs.links.get("node"), costs.links.get("across")
    intra = node.gbps if node else cluster.intra_gbps
    intra_latency = node.latency_s if node else 0.0
    return replace(cluster, tflops=costs.tflops, mfu=1.0, overhead_s=costs.overhead_s, intra_gbps=intra,
                   inter_gbps=across.gbps if across else intra, intra_latency_s=intra_latency,
                   inter_latency_s=across.latency_s if across else intra_latency,
                   net_cpu_s_per_gb=across.cpu_s_per_gb if across and not cuda else 0.0,
                   pcie_gbps=costs.host_copy_gbps or cluster.pcie_gbps,
                   adamw_params_s=costs.host_adamw_params_s or cluster.adamw_params_s)


BITS = {"none": 0, "int8": 8, "int4": 4}


def choose_layout(cfg: TrainConfig, cluster: Cluster, global_batch: int, wanted: dict[str, Any],
           bits: tuple[int, int] = (0, 0), budget: int = SEARCH_BUDGET) -> LayoutChoice:
    """The fastest layout of `cluster` that fits and keeps `wanted`, and the next RUNNERS_UP;
    ConfigError in one line where none does (what would fit, where something would). `bits`: the
    (weight, gradient) bits of the traffic the user allowed with --quantize-weights / --quantize-grads
    (0: none): quantized traffic changes the numbers trained, so the choice never adds it on its own;
    allowed, it is priced on every layout that has such traffic."""
    from pipezero.planner.search import plan_within

    t0 = time.perf_counter()
    wbits, gbits = bits
    result = plan_within(cfg.model, cluster, cfg.data.seq_len, global_batch, wbits, gbits,
                         cfg.parallel.quant_block, budget=budget, offload=False,
                         in_flight=cfg.parallel.buckets_in_flight)
    fits = [e for e in result.fits if matches(e.layout, wanted) and not e.layout.offload
            and (not cfg.run.compile or compiles(e.layout))]
    took = time.perf_counter() - t0
    if not fits:
        raise ConfigError(no_layout_reason(cfg, cluster, global_batch, wanted, bits, result.considered, budget))
    costs = {"ranks": cluster.gpus, "ranks_per_node": cluster.node_size, "limit_gib": cluster.gpu_memory_gib,
             "admitted_gib": cluster.gpu_memory_gib * cluster.headroom, "tflops": cluster.tflops,
             "overhead_s": cluster.overhead_s, "intra_gbps": cluster.intra_gbps, "inter_gbps": cluster.inter_gbps,
             "intra_latency_s": cluster.intra_latency_s, "inter_latency_s": cluster.inter_latency_s,
             "net_cpu_s_per_gb": cluster.net_cpu_s_per_gb,
             "cores": cluster.cores, "device": "cpu" if cluster.cpu else "cuda", "global_batch": global_batch}
    return LayoutChoice([describe_estimate(e) for e in runners_up(fits)], len(fits), result.considered,
                  result.skipped, took, costs)


def compiles(lay: Layout) -> bool:
    """Whether --compile runs layout `lay` (settings.py refuses the rest): no split backward, whose
    weight operations a compiled block hides, and no --recompute, whose rerun of a compiled block
    does not recompute what its forward saved."""
    from pipezero.schedules.registry import SPLIT_BACKWARD

    return lay.schedule not in SPLIT_BACKWARD and not lay.recompute


def runners_up(fits: list[Any]) -> list[Any]:
    """The fastest and the next RUNNERS_UP of other shapes (P, D, schedule, V, M, B): a layout that
    differs from a faster one only in its ZeRO stage, gradient reduction or placement often ties
    with it, and three such ties would show no alternative at all."""
    out, shapes = [], set()
    for e in fits:
        lay = e.layout
        shape = (lay.pp, lay.dp, lay.schedule, lay.virtual, lay.microbatches, lay.micro_batch)
        if shape not in shapes:
            shapes.add(shape)
            out.append(e)
        if len(out) > RUNNERS_UP:
            break
    return out


def no_layout_reason(cfg: TrainConfig, cluster: Cluster, global_batch: int, wanted: dict[str, Any], bits: tuple[int, int],
            considered: int, budget: int) -> str:
    """Why no layout was chosen, and what would change that: the world size, the global batch,
    the constraints, or the memory (the least a rank would need, from the same search without a limit)."""
    from pipezero.planner.search import nearby_world_sizes
    from pipezero.planner.search import plan_within

    world, layers = cluster.gpus, cfg.model.n_layers
    ranks = f"{world} rank{'s' * (world != 1)}"
    asked = "".join(f" and {k.split('.')[1]} = {getattr(v, 'value', v)}" for k, v in wanted.items())
    if not considered:
        nearby = nearby_world_sizes(layers, global_batch, world)
        return (f"--layout auto: {ranks} split into no layout: pp x dp must be {world} with pp <= {layers} "
                f"layers and dp dividing --global-batch {global_batch}; start {nearby + ' ranks' if nearby else 'other'}"
                f" or give another --global-batch")
    wbits, gbits = bits
    unlimited = replace(cluster, gpu_memory_gib=1e6)
    every = plan_within(cfg.model, unlimited, cfg.data.seq_len, global_batch, wbits, gbits, cfg.parallel.quant_block,
                        budget=budget, in_flight=cfg.parallel.buckets_in_flight).fits
    kept = [e for e in every if matches(e.layout, wanted)]
    if not kept:
        return (f"--layout auto: no layout of {ranks} has{asked[4:]} (global batch {global_batch})"
                f"{never_weighed(every, wanted) or ': drop one of those flags'}")
    least = min(kept, key=lambda e: e.memory_gib)
    need = least.memory_gib / cluster.headroom
    return (f"--layout auto: no layout of {ranks}{' with' + asked[4:] if asked else ''} fits "
            f"{cluster.gpu_memory_gib:.3g} GiB a rank; the smallest, {layout_flags(least.layout)}, needs "
            f"{need:.3g} GiB a rank ({least.memory_gib:.3g} predicted and the fit check's margin): give {more_memory(cfg, cluster, need)}"
            f" or more, more ranks, or a smaller --global-batch or --seq-len")


def more_memory(cfg: TrainConfig, cluster: Cluster, need: float) -> str:
    """The flag that sets a rank's limit: --gpu-memory on GPUs (or where given); else, on CPU ranks, the
    node's host memory, which its ranks share (auto_job.request: --host-memory over the node's ranks)."""
    if cluster.cpu and cfg.run.gpu_memory_gib is None:
        n = cluster.node_size
        return f"--host-memory {math.ceil(need * n * 100) / 100:g} (this node's, shared by its {n} rank{'s' * (n != 1)})"
    return f"--gpu-memory {math.ceil(need * 100) / 100:g}"


def summary_lines(choice: LayoutChoice, probe_s: float | None, cut: str | None = None) -> list[str]:
    """What the run prints before training: the search, the chosen layout and the runners-up."""
    c = choice.costs
    where = (f"{c['ranks']} rank{'s' * (c['ranks'] != 1)} ({c['device']}), {c['limit_gib']:.3g} GiB a rank, "
             f"global batch {c['global_batch']}")
    measured = f"probe {probe_s:.1f} s" if probe_s is not None else "costs from --costs"
    lines = [f"layout auto: {where}; {measured}; {choice.fitting} of {choice.weighed} layouts fit "
             f"({choice.seconds:.1f} s)" + (f"; {choice.skipped} of many micro-batches not weighed (the search's "
                                             f"budget)" if choice.skipped else "")]
    for i, r in enumerate(choice.ranked):
        lines.append(f"  {'chosen' if i == 0 else f'{i + 1}.':>6} {r['flags']}: step {r['predicted_step_s']:.3g} s, "
                     f"peak {r['predicted_peak_gib']:.3g} GiB a rank, bubble {r['bubble']:.1%}, exposed "
                     f"communication {r['exposed_comm_s'] * 1e3:.3g} ms")
    if cut:
        lines.append(cut)
    return lines


def global_batch_of(cfg: TrainConfig, given: int | None) -> int:
    """Sequences a step every candidate trains: --global-batch, else the settings' M x B x D."""
    return given if given is not None else cfg.global_batch


def encode_choice(choice: LayoutChoice) -> bytes:
    return json.dumps(choice.to_json(), sort_keys=True).encode()


def decode_choice(data: bytes) -> LayoutChoice:
    return LayoutChoice.from_json(json.loads(data.decode()))
