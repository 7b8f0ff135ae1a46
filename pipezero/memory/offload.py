"""What `--offload optimizer` costs, for the memory model (memory/model.py), the host check (`train
--host-memory`) and the planner (planner/search.py). Torch-free: sizes and rates only.

With the optimizer offloaded, every element a rank updates (ZeRO-0: its whole padded buckets;
ZeRO-1 to 3: its shard of each, padded / D) has on the host, allocated at the start and kept for
the run: its fp32 master copy (4 bytes), AdamW's exp_avg and exp_avg_sq (4 + 4) and a staging
buffer its reduced gradient is copied into (4): `HOST_BYTES` an element. The device no longer
holds the two moments (`DEVICE_SAVED` an element); everything else stays where it was (ZeRO-0 to 2
keep their fp32 weights and gradients, ZeRO-3 its fp32 parameter shard, the source of its gathers),
and updated shards are copied back in place, so no device buffer is added.

Each step every updated element crosses the host link twice, its reduced gradient down and its
updated weight up (fp32: `PCIE_BYTES` each way), and the CPU runs AdamW over it. The planner prices
both as exposed time on top of the step (an upper bound: the runtime overlaps a bucket's copies and
CPU step with the device's remaining work, but the last bucket's are never hidden):

- `PCIE_GBPS`: 25 GB/s a GPU each way, a PCIe 4.0 x16 link's practical rate (32 GB/s raw; pinned
  copies reach 22-26 GB/s), about half of a PCIe 5.0 one's;
- `CPU_ADAMW_PARAMS_S`: parameters a second one rank's share of its node's CPU updates: one core's
  worth, bench/cpu_adamw.py's one-thread median for pipezero's ShardedAdamW (torch's fused CPU
  kernel on flat shards) on this project's 2-core machine under load, 0.80e9 (2026-12-07;
  bench/results/cpu_adamw/cpu_adamw.json, docs/benchmarks/cpu.md; its least step gave 1.36e9). All threads
  measured slower there (other work shared the two cores), so one core is the figure kept: a GPU
  server that gives each GPU several free cores steps faster (`plan --cpu-adamw`).
"""

from __future__ import annotations

from dataclasses import dataclass

F32 = 4
HOST_BYTES = 16  # an updated element on the host: master, exp_avg, exp_avg_sq, gradient staging
DEVICE_SAVED = 8  # an updated element's AdamW moments, off the device
PCIE_BYTES = 4  # an updated element's bytes each way a step: its fp32 gradient down, its fp32 weight up
PCIE_GBPS = 25.0
CPU_ADAMW_PARAMS_S = 8.0e8


def host_bytes(updated: int, offload: bool) -> dict[str, int]:
    """The host's bytes (memory/model.py HOST_CATEGORIES) of a rank that updates `updated` elements:
    with the optimizer offloaded its fp32 master copy, AdamW's two moments and the staging buffer
    its reduced gradients are copied into; nothing without."""
    n = updated * F32 if offload else 0
    return {"host_master": n, "host_optimizer": 2 * n, "host_grads": n}


@dataclass(frozen=True)
class HostLink:
    """The planner's view of a GPU's host: the link's rate each way and the CPU's AdamW rate a rank."""

    pcie_gbps: float = PCIE_GBPS
    adamw_params_s: float = CPU_ADAMW_PARAMS_S

    def step_seconds(self, updated: int) -> tuple[float, float]:
        """(seconds of host copies, seconds of CPU AdamW) a step adds for a rank updating `updated`
        elements: its gradients down and its weights up, one after the other, then the update."""
        return 2 * updated * PCIE_BYTES / (self.pcie_gbps * 1e9), updated / self.adamw_params_s


def node_host_need(host_bytes_per_rank: list[int], device_bytes_per_rank: list[int], cpu: bool) -> int:
    """Host bytes the ranks of one node need: their offloaded buffers, and on CPU ranks, whose
    device is the host, their device bytes too."""
    return sum(host_bytes_per_rank) + (sum(device_bytes_per_rank) if cpu else 0)
