"""This machine's costs, measured in seconds, for the planner to plan with instead of presets.

The planner (planner/search.py) prices a layout from a cluster's figures: the FLOP rate one rank
achieves, a fixed cost every action pays beyond its FLOPs, the two link classes' bandwidth and, for
offload, the host copies and the host's AdamW. Presets guess them; a probe measures them where the
run will train, at the run's shapes and dtype, in seconds:

- compute: one decoder block's forward, input gradient and weight gradient at the run's micro-batch
  (B x T), timed over repetitions; the achieved FLOP rate is the block's FLOPs (models/presets.py
  `layer_costs`) over that time, and the fixed cost an action pays is the same block's forward at
  one row of eight tokens, where FLOPs are nothing;
- links: an all-reduce at two sizes inside a node and across nodes, on the ranks this job has (a
  latency and a bandwidth from the two), bus bandwidth as a ring sees it. The small size is fixed;
  the large one is as large as a call of `LARGE_S` allows at the small one's rate (a 4 MB all-reduce
  over 100 Mbit took 0.6 s a call, and a figure takes four calls at least), and never under four
  times the small, so that its time is mostly bandwidth;
- cores (CPU ranks): the cores the job's ranks get. Its hosts have so many (every host's once: ranks
  whose kernel is the same, as the emulated cluster's nodes, namespaces of one host, share its
  cores, however many torchrun nodes they were started as); of those the job gets what its block
  says when every rank computes it at once against rank 0's alone (other jobs on the host, and the
  host's own work, take the rest);
- host (`pipezero probe`; `host=True`): a bucket-sized copy from the device to host memory and back,
  and AdamW's step on the host (zero/adamw.py, the kernel --offload optimizer runs there), in
  parameters a second. `train --layout auto` never offloads, so its probe leaves them out.

Every figure is a median over repetitions bounded in time (`budget_s` each) and in count (`MOST`):
the probe answers in seconds, not minutes. `Probe.to_json` is what `pipezero probe` writes and `plan --costs` reads.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pipezero.config import OptimConfig, TrainConfig

LINK_KINDS = ("node", "across")  # the link classes a probe times (planner/auto.py `cluster_for` reads them)
SMALL = 1 << 16  # bytes of the all-reduce whose time is mostly a link's latency
LARGEST = 1 << 22  # bytes of the largest all-reduce a link's bandwidth is timed with
LARGE_S = 0.03  # seconds one call of the bandwidth's all-reduce may take, at the small one's rate


@dataclass
class LinkCost:
    # one message's fixed seconds: the small all-reduce's time less its bytes at `gbps`, over the
    # 2(n - 1) messages one after another of a ring of n
    latency_s: float
    gbps: float  # GB/s of bus bandwidth: what a ring all-reduce moves through each rank's link
    # CPU-seconds a rank's process (gloo's threads and the kernel's network path in its context)
    # spends a GB it sends and receives: on CPU ranks sharing cores, taken from compute
    cpu_s_per_gb: float = 0.0


@dataclass
class Probe:
    device: str  # "cpu" or the GPU's name
    dtype: str
    micro_batch: int
    seq_len: int
    block_s: dict[str, float]  # one block at the run's micro-batch: F, B (input gradient), W (weight gradient)
    tflops: float  # achieved by the block's forward and backward at that shape
    overhead_s: float  # a block's forward at one row of eight tokens: what an action costs beyond FLOPs
    links: dict[str, LinkCost] = field(default_factory=dict)  # "node" (inside one), "across" (between nodes)
    host_copy_gbps: float | None = None  # device -> host -> device, GB/s each way
    host_adamw_params_s: float | None = None  # AdamW on the host, parameters a second
    seconds: float = 0.0  # what the probe itself took
    cores: float | None = None  # CPU cores the job's ranks get, all its hosts together (effective_cores); None: not probed

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Probe:
        if not isinstance(d, dict):  # the file is anyone's: a list or a number is no probe
            raise TypeError(f"a JSON object was expected, not a {'list' if isinstance(d, list) else type(d).__name__}")
        if not isinstance(d.get("device"), str):  # "cpu" or a GPU's name: plan matches it to --device
            raise TypeError(f"device: a string was expected, not {d.get('device')!r}")
        links = d.get("links", {})
        if not isinstance(links, dict) or not all(isinstance(v, dict) for v in links.values()):
            raise TypeError("links: an object of {latency_s, gbps} objects was expected")
        links = {k: LinkCost(**v) for k, v in links.items()}
        return cls(**{**d, "links": links})


def read_probe(path: str) -> Probe:
    """A probe `pipezero probe --json FILE` wrote, for `plan --costs` and `train --layout auto --costs`:
    refused in one line where it is not one, or where its figures are outside what the flags they
    stand for accept (a busy machine's probe once said 7.5e5 TFLOP/s). A link the user made to a
    probe's file is followed: only the file itself is checked."""
    import json
    import math
    from pathlib import Path

    from pipezero.errors import ConfigError
    from pipezero.flight_files import RecordError, read_json
    from pipezero.schedules import limits

    try:
        target = Path(path).resolve()
    except (RuntimeError, OSError):  # Python 3.11 says a link loop as RuntimeError, later ones as OSError
        raise ConfigError(f"--costs {path}: a link that leads back to itself: name the probe's file "
                          f"(pipezero probe --json FILE)") from None
    try:
        found = Probe.from_json(read_json(target, 1 << 20))
    except RecordError as e:  # said of the file read: the path given, and where a link to it leads
        link = f" (a link to {Path(path).resolve()})" if Path(path).is_symlink() else ""
        raise ConfigError(f"--costs {path}{link}: {e}") from None
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"--costs {path}: not a probe pipezero wrote ({e}): make one with pipezero probe "
                          f"--json FILE") from None
    figures = [("tflops", "--tflops", found.tflops, 1, limits.TFLOPS),
               ("overhead_s", "--overhead-ms", found.overhead_s, 1e3, limits.OVERHEAD_MS),
               ("host_copy_gbps", "--pcie-gbps", found.host_copy_gbps, 1, limits.GBPS),
               ("host_adamw_params_s", "--cpu-adamw", found.host_adamw_params_s, 1, limits.PARAMS_S)]
    if unknown := sorted(set(found.links) - set(LINK_KINDS)):  # never looked up: the links read as none
        raise ConfigError(f'--costs {path}: links: "{unknown[0][:40]}" is no link a probe times ({", ".join(LINK_KINDS)})'
                          f": probe again (pipezero probe --json FILE)")
    figures += [(f"links.{kind}.gbps", "a link's GB/s", c.gbps, 1, limits.GBPS) for kind, c in found.links.items()]
    figures += [(f"links.{kind}.latency_s", "a link's latency (s)", c.latency_s, 1, limits.TIME)
                for kind, c in found.links.items()]
    figures += [(f"links.{kind}.cpu_s_per_gb", "--net-cpu", c.cpu_s_per_gb, 1, limits.NET_CPU)
                for kind, c in found.links.items()]
    if found.cores is not None and (not isinstance(found.cores, (int, float)) or isinstance(found.cores, bool)
                                    or not 0 < found.cores < math.inf):
        raise ConfigError(f"--costs {path}: cores {json.dumps(found.cores)} is not a count of cores (more than 0): "
                          f"probe again (pipezero probe --json FILE)")
    for name, flag, value, scale, allowed in figures:
        if value is None and name.startswith("host_"):
            continue  # an older probe without the host's figures: the flags' defaults stand
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"--costs {path}: {name} {json.dumps(value)} is not a number: probe again "
                              f"(pipezero probe --json FILE)")
        if not (math.isfinite(value) and value * scale in allowed):
            raise ConfigError(f"--costs {path}: {name} {value:.8g} is outside what {flag} accepts "
                              f"({allowed.low:g} to {allowed.high:g}{' ms' if scale != 1 else ''}): probe again "
                              f"(pipezero probe --json FILE), on an idle machine")
    return found


# repetitions of one figure at the most: a median of 15 moves less than the host's own noise, and a
# budget of 0.5 s ran a 2 ms block's forward 200 times
MOST = 15
MOST_S = 120.0  # seconds a probe may take: past it (a 7b block on CPU), refused after one forward
CALLS = 20  # forwards' worth of a probe: F, B and W (~1, ~1.5 and ~2.5 forwards) a warm-up and 3 calls each


def once_timed(fn: Callable[[], Any], sync: Callable[[], None] | None) -> Any:
    """`fn`'s result, refused (ProbeError) where its time says the whole probe would take past MOST_S."""
    t0 = time.perf_counter()
    out = fn()
    if sync is not None:
        sync()
    if (took := time.perf_counter() - t0) * CALLS > MOST_S:
        raise ProbeError(f"one forward of the block took {took:.3g} s here: the probe would take about "
                         f"{took * CALLS:.0f} s, past its {MOST_S:g} s; probe at a smaller --micro-batch-size or "
                         f"--seq-len, or on a GPU")
    return out


def once(fn: Callable[[], Any], sync: Callable[[], None] | None) -> float:
    """Seconds of one call of `fn`, its device work included (`sync`)."""
    t0 = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - t0


def timed(fn: Callable[[], Any], budget_s: float, sync: Callable[[], None] | None = None, least: int = 3) -> float:
    """Median seconds of `fn` over repetitions within `budget_s` (at least `least`, after one warm-up)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < least or (time.perf_counter() - start < budget_s and len(times) < MOST):
        times.append(once(fn, sync))
    return statistics.median(times)


def timed_together(fn: Callable[[], Any], budget_s: float, group: Any, device: torch.device,
                   sync: Callable[[], None] | None = None, least: int = 3, cpu: list[float] | None = None) -> float:
    """`timed` for a collective: every rank of `group` runs it the same number of times; `cpu`,
    where given, gets this process's CPU-seconds a call (every thread's: gloo's too) over them.

    A loop bounded by each rank's own clock ends after a different count on each rank, and the
    ranks that go on wait for a partner (or read a message of another size): the count is agreed
    first (the largest any rank's budget allows), then every rank runs exactly that many."""
    import torch.distributed as dist

    fn()
    used = time.process_time()
    first = [once(fn, sync) for _ in range(least)]
    used = time.process_time() - used
    each = sum(first) / least
    count = torch.tensor([min(MOST, max(least, int(budget_s / max(each, 1e-9))))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    # the calls that estimated the count are the figure's first (a 4 MB all-reduce over 100 Mbit
    # takes 0.6 s: timing it again cost seconds a probe); every rank runs the same number more
    more = int(count.item()) - least
    used -= time.process_time()
    times = first + [once(fn, sync) for _ in range(more)]
    used += time.process_time()
    if cpu is not None:
        cpu.append(used / (least + more))
    return statistics.median(times)


def block_pass(cfg: TrainConfig, device: torch.device) -> Callable[[], Any]:
    """One block's forward and whole backward at the run's micro-batch (B x T), as a call to time."""
    from pipezero.models import build_chunk
    from pipezero.runtime.autocast import autocast

    m = cfg.model
    chunk = build_chunk(m, 1, 2, cfg.run.seed, device)  # layers [1, 2): the first block alone
    params = [p for p in chunk.parameters() if p.requires_grad]
    x = torch.randn(cfg.parallel.micro_batch_size, cfg.data.seq_len, m.dim, device=device, requires_grad=True)

    def once_through() -> Any:
        with autocast(cfg.run.dtype, device.type):
            y = chunk(x, None)
        return torch.autograd.grad(y, [x, *params], torch.ones_like(y))

    return once_through


def block_together(cfg: TrainConfig, device: torch.device, budget_s: float, timeout_s: float) -> float:
    """Seconds of `block_pass` while every rank of the job runs it at once (as in training, where all
    compute together), the mean of every rank's median: a collective, which every rank calls."""
    import torch.distributed as dist

    from pipezero.parallel.waits import wait_or_raise

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    mine = timed_together(block_pass(cfg, device), budget_s, None, device, sync)
    total = torch.tensor([mine], dtype=torch.float64, device=device)
    wait_or_raise(dist.all_reduce(total, async_op=True), timeout_s,
                  f"rank {dist.get_rank()}: the probe adding every rank's block time")
    return total.item() / dist.get_world_size()


def effective_cores(world: int, alone_s: float, together_s: float, host_cores: float) -> float:
    """The cores `world` ranks get: each computing `together_s` where alone it takes `alone_s` is
    what `world` ranks on world x alone / together cores take; never more than their hosts'
    `host_cores` (noise in two timings), nor more than one a rank (no rank is faster together)."""
    if together_s <= 0:
        return float(host_cores)
    return min(float(host_cores), world * min(1.0, alone_s / together_s))


def probe_block(cfg: TrainConfig, device: torch.device, budget_s: float = 0.5) -> tuple[dict[str, float], float, float]:
    """(F, B, W seconds of one block at the run's micro-batch, achieved TFLOP/s, fixed seconds an action)."""
    from pipezero.models import build_chunk
    from pipezero.models.presets import layer_costs
    from pipezero.runtime.autocast import autocast

    m, b, t = cfg.model, cfg.parallel.micro_batch_size, cfg.data.seq_len
    chunk = build_chunk(m, 1, 2, cfg.run.seed, device)  # layers [1, 2): the first block alone
    params = [p for p in chunk.parameters() if p.requires_grad]
    sync = torch.cuda.synchronize if device.type == "cuda" else None

    def forward(rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, length, m.dim, device=device, requires_grad=True)
        with autocast(cfg.run.dtype, device.type):
            return x, chunk(x, None)

    x, y = once_timed(lambda: forward(b, t), sync)
    dy = torch.randn_like(y)
    f = timed(lambda: forward(b, t), budget_s, sync)
    b_s = timed(lambda: torch.autograd.grad(y, [x], dy, retain_graph=True), budget_s, sync)
    # the weight gradients alone cannot be timed apart: autograd reaches a block's first weights only
    # through the input gradients of every op after them, so W is the whole backward less B
    bw_s = timed(lambda: torch.autograd.grad(y, [x, *params], dy, retain_graph=True), budget_s, sync)
    w_s = max(bw_s - b_s, 0.05 * bw_s)
    overhead = timed(lambda: forward(1, 8), budget_s / 2, sync)
    flops = layer_costs(m, t)[1] * b * t  # the block's training FLOPs for this micro-batch (6 a weight a token)
    block = {"F": f, "B": b_s, "W": w_s}
    return block, achieved_tflops(flops, block, overhead), overhead


class ProbeError(RuntimeError):
    """What was timed cannot give a figure: said in one line, nothing written."""


def achieved_tflops(flops: float, block_s: dict[str, float], overhead_s: float) -> float:
    """The block's FLOPs over its three actions' time less their fixed cost. Where that is nothing
    (a micro-batch so small, or a machine so busy, that the fixed cost takes it all), there is no
    rate to tell: FLOPs over a clamped 1e-9 s was a rate of 1e5+ TFLOP/s that the planner believed."""
    total = sum(block_s.values())
    if total - 3 * overhead_s <= 0.05 * total:
        raise ProbeError(f"the block's F, B and W took {total * 1e3:.3g} ms, no more than three of an action's fixed "
                         f"cost ({overhead_s * 1e3:.3g} ms each): its FLOP rate cannot be told apart from an action's "
                         f"fixed cost; probe at a larger --micro-batch-size or --seq-len, or on an idle machine")
    return flops / (total - 3 * overhead_s) / 1e12


def large_size(small_s: float) -> int:
    """Bytes of the all-reduce a link's bandwidth is timed with, where the small one took `small_s`:
    SMALL x 4^k, the largest whose call at the small one's rate takes no more than LARGE_S, at least
    4 x SMALL and at most LARGEST."""
    size = 4 * SMALL
    while size * 4 <= LARGEST and small_s * size * 4 / SMALL <= LARGE_S:
        size *= 4
    return size


def agreed_most(value: float, group: Any, device: torch.device) -> float:
    """The largest of every rank's `value` in `group`: what every rank then sizes alike."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def probe_link(group: Any, device: torch.device, budget_s: float = 0.3) -> LinkCost:
    """An all-reduce over `group` at two sizes: bandwidth from the difference, a message's latency
    the small one's time less its bytes at that bandwidth, over the ring's 2(n - 1) steps one after
    another, and the CPU a GB from the difference of the two
    sizes' CPU-seconds. The large size follows the small one's time (the slowest rank's, so every
    rank times the same size): a slow link is timed with fewer bytes."""
    import torch.distributed as dist

    n = dist.get_world_size(group)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    cpu: list[float] = []
    small = torch.zeros(SMALL // 4, device=device)
    t_small = timed_together(lambda: dist.all_reduce(small, group=group), budget_s, group, device, sync, cpu=cpu)
    size = large_size(agreed_most(t_small, group, device))
    large = torch.zeros(size // 4, device=device)
    t_large = timed_together(lambda: dist.all_reduce(large, group=group), budget_s, group, device, sync, cpu=cpu)
    ring = 2 * (n - 1) / n  # a ring all-reduce's bytes through each link, a byte of the buffer
    steps = max(1, 2 * (n - 1))  # its messages one after another
    # a GPU's collectives leave the CPU idle (its waits spin: no figure); a CPU rank's copy and sum
    per_gb = 0.0
    if len(cpu) == 2 and device.type == "cpu":
        per_gb = max(0.0, cpu[1] - cpu[0]) / (ring * (size - SMALL) / 1e9)
    if t_large > 1.05 * t_small:
        gbps = ring * (size - SMALL) / (t_large - t_small) / 1e9
        return LinkCost(max(0.0, t_small - ring * SMALL / (gbps * 1e9)) / steps, gbps, per_gb)
    # the large no slower than the small (a loaded host's noise): the difference says nothing, and
    # dividing by it would claim any rate at all; the large one's own rate, latency included, is a
    # bandwidth the link at least has
    return LinkCost(min(t_small, t_large) / steps, ring * size / t_large / 1e9, per_gb)


CPUS = 1024  # CPU numbers a rank's affinity is sent as (job_cores): more than any host has


def cores_of(ranks: list[tuple[str, set[int]]]) -> int:
    """Cores of the hosts `ranks` ran on ((host, the CPUs its affinity allows) each): ranks of one
    host share its cores, so each host counts the CPUs any of its ranks may use, once."""
    hosts: dict[str, set[int]] = {}
    for host, cpus in ranks:
        hosts.setdefault(host, set()).update(cpus)
    return sum(len(cpus) for cpus in hosts.values())


def host_id() -> str:
    """What ranks of one machine share: its kernel's boot id (network namespaces, containers and
    torchrun nodes of one host have the same), else its name."""
    import socket

    try:
        return open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        return socket.gethostname()


def job_cores(timeout_s: float) -> int:
    """The CPU cores every rank of the job runs on together (`cores_of`), gathered from every rank
    (CPU tensors: gloo); a collective, which every rank calls. torchrun's nodes need not be hosts:
    the emulated cluster starts each node's ranks in a namespace of this one host."""
    import hashlib

    import torch.distributed as dist

    from pipezero.parallel.waits import wait_or_raise

    mine = torch.zeros(8 + CPUS, dtype=torch.uint8)
    mine[:8] = torch.frombuffer(bytearray(hashlib.sha256(host_id().encode()).digest()[:8]), dtype=torch.uint8)
    mine[[8 + c for c in os.sched_getaffinity(0) if c < CPUS]] = 1
    if not dist.is_initialized():
        return len(os.sched_getaffinity(0))
    every = torch.empty(dist.get_world_size() * mine.numel(), dtype=torch.uint8)
    wait_or_raise(dist.all_gather_into_tensor(every, mine, async_op=True), timeout_s,
                  f"rank {dist.get_rank()}: the probe gathering every rank's host and cores")
    return cores_of([(bytes(t[:8].tolist()).hex(), {i for i, on in enumerate(t[8:].tolist()) if on})
                     for t in every.view(-1, mine.numel())])


def probe_host(device: torch.device, elements: int = 1 << 22, budget_s: float = 0.3) -> tuple[float, float]:
    """(GB/s of a copy device -> host -> device each way, AdamW on the host in parameters a second)."""
    from pipezero.zero.adamw import ShardedAdamW

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    on_device = torch.randn(elements, device=device)
    host = torch.empty(elements, pin_memory=cuda)
    copy = timed(lambda: (host.copy_(on_device), on_device.copy_(host)), budget_s, sync)
    opt = ShardedAdamW(OptimConfig())
    opt.add_shard(elements, [(0, elements // 2)])
    master, grad = host.clone(), torch.randn(elements)
    step = timed(lambda: opt.step([master], [grad], 1e-4), budget_s)
    return 2 * elements * 4 / copy / 1e9, elements / step


def probe(cfg: TrainConfig, device: torch.device, groups: dict[str, Any] | None = None,
          budget_s: float = 0.5, host: bool = False) -> Probe:
    """Every figure this rank can measure; `groups`: "node" and "across" process groups to time
    (collective calls: every rank of each group must call this alike); `host`: the host's copy rate
    and AdamW too (`pipezero probe`, for `plan`'s offload; `train --layout auto` never offloads)."""
    t0 = time.perf_counter()
    block, tflops, overhead = probe_block(cfg, device, budget_s)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = Probe(name, cfg.run.dtype.value, cfg.parallel.micro_batch_size, cfg.data.seq_len, block, tflops, overhead)
    for kind, group in (groups or {}).items():
        if group is not None:
            out.links[kind] = probe_link(group, device, budget_s / 2)
    if host:
        out.host_copy_gbps, out.host_adamw_params_s = probe_host(device, budget_s=budget_s / 2)
    out.seconds = time.perf_counter() - t0
    return out
