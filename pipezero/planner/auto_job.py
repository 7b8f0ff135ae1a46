"""`train --layout auto` from the command line to the ranks (the choice itself: planner/auto.py).

Two passes. Before any rank starts (the launcher, or each rank of an outside torchrun or srun as it
reads its command line), `request` turns the flags into what the choice needs and makes a
provisional choice from the presets or `--costs FILE`: every check train runs before training
(the fit check, the host's memory, the data) then runs on a real layout, and a request that no
layout can satisfy is refused there, in one line. Inside the job, `decide` measures this machine
(pipezero/probe.py: the links on every rank together, the compute on rank 0 alone, so that no
rank's timing is slowed by the others' probing) and rank 0 chooses and sends its choice to every
rank as JSON. With `--costs FILE` the provisional choice is the choice: the same inputs on every
rank, no probe.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from pipezero.config import TrainConfig
from pipezero.errors import ConfigError
from pipezero.planner.auto_refusals import check_batch_tokens, check_measured_here, check_quantized_read
from pipezero.planner.auto import (BITS, CHOSEN, NOT_CHOSEN, PROBE_BUDGET_S, LayoutChoice, choose_layout, cluster_for, decode_choice,
                                  encode_choice, summary_lines)

# the trivial layout the base configuration is built with (its model, data and run settings are what
# the choice reads; its layout is replaced by the chosen one)
BASE = {"parallel.pp": "1", "parallel.dp": "1", "parallel.zero": "0", "parallel.schedule": "1f1b",
        "parallel.virtual_stages": "1", "parallel.microbatches": "1", "parallel.micro_batch_size": "1"}
QUANT = ("parallel.quantize_weights", "parallel.quantize_grads")
DEFAULT_TRIALS = 3  # --layout-trials: near-tied layouts tried in the job, the chosen one included (auto_trials.py)
# Settings read only at some ZeRO stage, replica count or pipeline depth (settings.py `unread_setting`),
# each with the layout settings that decide whether it is read: beside --layout auto they need those
# as constraints, or the choice (made inside the job, after the probe) could leave them unread.
LAYOUT_READ = {
    "parallel.zero3_unit": ("parallel.zero", "parallel.pp", "parallel.dp"),
    "parallel.zero3_prefetch": ("parallel.zero", "parallel.pp", "parallel.dp"),
    "parallel.zero3_keep_gathered": ("parallel.zero", "parallel.pp", "parallel.dp"),
    "parallel.secondary_shard": ("parallel.zero", "parallel.pp", "parallel.dp"),
    "parallel.overlap_gather": ("parallel.zero", "parallel.dp"),
    "parallel.buckets_in_flight": ("parallel.zero", "parallel.dp"),
}


@dataclass
class Request:
    """What the choice reads, the same on every rank."""

    config: str | None  # --config's file
    base: TrainConfig  # the run's settings with a trivial layout
    settings: dict[str, Any]  # the flags given, less the layout's
    wanted: dict[str, Any]  # layout constraints: setting -> typed value
    bits: tuple[int, int]  # quantized traffic allowed (weights, gradients)
    global_batch: int
    world: int
    local: int
    limit_gib: float
    cuda: bool
    costs: Any | None  # a Probe read from --costs FILE, or None: probe inside the job
    trials: int = DEFAULT_TRIALS  # --layout-trials: near-tied layouts tried in the job (planner/auto_trials.py)

    def cluster(self, costs: Any | None) -> Any:
        return cluster_for(self.base, self.world, self.local, self.limit_gib, self.cuda, costs)


def world_of(nproc: int | None) -> tuple[int, int]:
    """(ranks of the job, ranks on this node): --nproc's, or torchrun's (srun's, adopted) variables."""
    from pipezero.launch import under_torchrun

    if nproc is not None:
        return nproc, nproc
    if under_torchrun():
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return world, int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    return 1, 1


def request(config: str | None, settings: dict[str, Any], names: dict[str, str], nproc: int | None,
            global_batch: int | None, costs_file: str | None, ranks: tuple[int, int] | None = None,
            trials: int | None = None) -> Request:
    """The choice's inputs from train's flags (ConfigError in one line for a request it cannot take);
    `ranks`: (world, a node's) where the caller knows them (`pipezero cluster`), else `world_of`;
    `trials`: --layout-trials (None: DEFAULT_TRIALS)."""
    from pipezero.settings import build_config, check_compiles, coerce_setting, load_toml
    from pipezero.memory.fit import rank_limit_gib

    if trials is not None and trials < 0:
        raise ConfigError(f"--layout-trials {trials}: expected how many near-tied layouts to try in the job, 0 (off) "
                          f"or more")
    toml = load_toml(config) if config else {}
    refused = [names.get(k, k) for k in NOT_CHOSEN if k in settings] + [k for k in NOT_CHOSEN if k in toml]
    if refused:
        raise ConfigError(f"--layout auto chooses uniform cuts without offload; {refused[0]} is none of its "
                          f"choices: drop it, or drop --layout auto and give the layout yourself")
    wanted = {k: coerce_setting(k, v, from_text=True, name=names.get(k)) for k, v in settings.items() if k in CHOSEN}
    wanted.update({k: coerce_setting(k, v) for k, v in toml.items() if k in CHOSEN and k not in wanted})
    check_layout_read({**toml, **settings}, wanted, names)
    quant = {k: coerce_setting(k, v, from_text=True, name=names.get(k)) for k, v in settings.items() if k in QUANT}
    quant.update({k: coerce_setting(k, v) for k, v in toml.items() if k in QUANT and k not in quant})
    bits = tuple(BITS[quant[k].value] if k in quant else 0 for k in QUANT)
    rest = {k: v for k, v in settings.items() if k not in CHOSEN and k not in QUANT}
    base = build_config(config, {**rest, **base_layout({**toml, **settings}, settings)}, names)
    if "parallel.schedule" in wanted or "parallel.recompute" in wanted:  # else the choice weighs only what compiles
        check_compiles(base.run.compile, wanted.get("parallel.schedule", base.parallel.schedule),
                       wanted.get("parallel.recompute", False))
    if global_batch is None:  # the settings' M x B x D, as a run of them would train
        m, b, d = (wanted.get(f"parallel.{k}", toml.get(f"parallel.{k}", default)) for k, default in
                   (("microbatches", 4), ("micro_batch_size", 4), ("dp", 1)))
        global_batch = int(m) * int(b) * int(d)
    elif global_batch < 1:
        raise ConfigError(f"--global-batch {global_batch}: expected sequences a step, 1 or more")
    check_batch_tokens(global_batch, base.data.seq_len)
    world, local = ranks or world_of(nproc)
    check_quantized_read(QUANT, bits, world, wanted, names)  # type: ignore[arg-type]
    limit, cuda = rank_limit_gib(base, local)
    if limit is None:  # CPU ranks: the host's memory, shared by the node's ranks
        host = base.run.host_memory_gib
        limit = (host if host is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30) / local
    from pipezero.probe import read_probe

    probe = read_probe(costs_file) if costs_file is not None else None
    if probe is not None:
        check_measured_here(costs_file, probe, base, cuda)  # type: ignore[arg-type]
    return Request(config, base, rest, wanted, bits, global_batch, world, local, limit, cuda,  # type: ignore[arg-type]
                   probe, DEFAULT_TRIALS if trials is None else trials)


def base_layout(given: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The layout the base configuration is built with: BASE, less the constraints that decide a
    layout-read setting given (LAYOUT_READ), which the flags (or the TOML) then supply: checked
    against BASE's ZeRO-0, `--zero 3 --dp 2 --zero3-unit sublayer` would be refused as read by nothing."""
    deciders = {d for key, ds in LAYOUT_READ.items() if key in given for d in ds}
    return {**{k: v for k, v in BASE.items() if k not in deciders},
            **{k: settings[k] for k in deciders if k in settings}}


def check_layout_read(given: dict[str, Any], wanted: dict[str, Any], names: dict[str, str]) -> None:
    """Refuse a setting only some layouts read (LAYOUT_READ) without the constraints that decide it:
    checked against the provisional layout alone, it would be refused naming a --zero the user never
    gave, or accepted there and refused on every rank after the probe chose another layout."""
    for key, deciders in LAYOUT_READ.items():
        if key not in given:
            continue
        missing = [names.get(k, "--" + k.split(".")[1].replace("_", "-")) for k in deciders if k not in wanted]
        if missing:
            flag = names.get(key, key)
            raise ConfigError(f"--layout auto with {flag}: {flag} is read only in some layouts, and the choice, made "
                              f"after the probe, could leave it unread; give {' '.join(missing)} as constraints too "
                              f"(the layout that reads it), or drop {flag}")


def provisional(req: Request) -> LayoutChoice:
    """The choice from the presets (or --costs): checked before any rank starts, and the layout the
    checks before training run on."""
    return choose_layout(req.base, req.cluster(req.costs), req.global_batch, req.wanted, req.bits)


def settings_of(req: Request, choice: LayoutChoice) -> dict[str, Any]:
    """train's settings for the chosen layout: the flags given and the chosen layout's."""
    return {**req.settings, **choice.chosen["settings"]}


def decide(req: Request, first: LayoutChoice, cfg: TrainConfig) -> tuple[LayoutChoice, float | None]:
    """The choice every rank trains with, and the probe's seconds (None: --costs). Inside the job:
    every rank calls it alike (the links are timed by collectives); rank 0 chooses and broadcasts."""
    if req.costs is not None:
        return first, None
    import torch

    from pipezero.engine import default_threads
    from pipezero.parallel.process_group import init_distributed
    from pipezero.probe import ProbeError, block_together, effective_cores, job_cores, probe, probe_link

    rank, device = init_distributed(cfg)  # the group the run then trains in (the provisional layout's world)
    torch.set_num_threads(cfg.run.threads or default_threads(req.local))
    t0 = time.perf_counter()
    links = {kind: probe_link(group, device, PROBE_BUDGET_S) for kind, group in link_groups(req.world, req.local)}
    cpu = device.type == "cpu" and req.world > 1  # GPU ranks compute each on its own device
    # the cores the hosts have, and the block with every rank computing at once, against rank 0's alone
    cores = job_cores(cfg.parallel.timeout_s) if cpu else None
    together = block_together(cfg, device, PROBE_BUDGET_S, cfg.parallel.timeout_s) if cpu else None
    data = b""
    if rank == 0:
        try:
            found = probe(cfg, device, budget_s=PROBE_BUDGET_S)
        except ProbeError as e:  # sent as the choice is: every rank stops with its line, none waits out --timeout
            data = json.dumps({"probe_error": str(e)}).encode()
        else:
            found.links = links
            if cores is not None and together is not None:
                found.cores = effective_cores(req.world, sum(found.block_s.values()), together, cores)
            choice = choose_layout(req.base, req.cluster(found), req.global_batch, req.wanted, req.bits)
            choice.costs["probe_s"] = time.perf_counter() - t0 - choice.seconds  # the links' and rank 0's figures
            data = encode_choice(choice)
    took = time.perf_counter() - t0
    if req.world > 1:
        data = broadcast_bytes(data, rank, cfg.parallel.timeout_s)
    if "probe_error" in (sent := json.loads(data.decode())):
        raise ProbeError(sent["probe_error"])
    return decode_choice(data), took


def link_groups(world: int, local: int) -> list[tuple[str, Any]]:
    """The process groups the probe times: the ranks of one node ("node") and one rank a node
    ("across"), each as torchrun numbers ranks (node by node). Every rank makes every group."""
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return []
    if world <= local:
        return [("node", dist.group.WORLD)]
    rank, nodes = dist.get_rank(), world // local
    out = []
    node_groups = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(nodes)] if local > 1 else []
    across = [dist.new_group([n * local + i for n in range(nodes)]) for i in range(local)]
    if node_groups:
        out.append(("node", node_groups[rank // local]))
    out.append(("across", across[rank % local]))
    # every rank times each kind of group at once: groups of one kind run side by side
    return out


def broadcast_bytes(data: bytes, rank: int, timeout_s: float, src: int = 0,
                    what: str = "--layout auto choice (its probe and search)", group: Any = None) -> bytes:
    """Rank `src`'s `data` on every rank of `group` (default: all; a length, then the bytes; CPU
    tensors, which gloo carries on every backend), each wait bounded by `timeout_s` and named by `what`."""
    import torch
    import torch.distributed as dist

    from pipezero.parallel.waits import wait_or_raise

    size = torch.tensor([len(data)], dtype=torch.int64)
    wait_or_raise(dist.broadcast(size, src, group=group, async_op=True), timeout_s,
                  f"rank {rank}: waiting for rank {src}'s {what}")
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank == src else torch.empty(int(size.item()),
                                                                                               dtype=torch.uint8)
    wait_or_raise(dist.broadcast(buf, src, group=group, async_op=True), timeout_s,
                  f"rank {rank}: receiving rank {src}'s {what}")
    return bytes(buf.numpy().tobytes())


def announce(choice: LayoutChoice, probe_s: float | None) -> None:
    """Rank 0 prints the choice and the runners-up before training."""
    print("\n".join(summary_lines(choice, probe_s)), flush=True)
