"""What the planner is told and what it chooses between: a cluster (devices, memory, the two link
classes, and on CPU hosts the cores and network costs that decide there) and one candidate layout.
Plain frozen data, so estimates can be cached and compared; planner/search.py enumerates and ranks
them, planner/traffic.py prices their collectives."""

from __future__ import annotations

from dataclasses import dataclass

from pipezero.config import BUCKETS_IN_FLIGHT, GradReduce, Partition, Placement, ScheduleKind
from pipezero.memory.offload import CPU_ADAMW_PARAMS_S, PCIE_GBPS


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpu_memory_gib: float
    node_size: int = 8
    intra_gbps: float = 300.0  # GB/s within a node
    inter_gbps: float = 25.0  # GB/s between nodes, per GPU
    # fixed seconds of one transfer or collective within a node and between nodes, beside its bytes
    # (a probe's all-reduce latency): each pipeline hop pays it, and each bucket's collective
    intra_latency_s: float = 0.0
    inter_latency_s: float = 0.0
    tflops: float = 989.0  # dense bf16 peak per GPU
    mfu: float = 0.45  # achieved share of peak in the compute of one stage
    headroom: float = 0.9  # usable share of memory (allocator, buffers, fragmentation)
    wire_bytes: int = 2  # bytes an element of gradients and activations on the wire (bf16; fp32 runs: 4)
    # fixed seconds every action (a forward, backward or split half of one) costs beyond its FLOPs
    # (launches, Python): negligible for large micro-batches on a GPU, but on CPU with small ones it
    # decides (measured on the emulated cluster: B=1 x M=8 ran 2-4x slower than FLOPs alone
    # predicted); it is why a fused BW beats its B and W apart when the bubble is not the limit
    overhead_s: float = 0.0
    # CPU ranks on gloo (`--device cpu`): reduce-scatters are direct exchanges of slices, a node's
    # ranks share one link (inter_gbps x node_size), and --hierarchical can be chosen
    cpu: bool = False
    # CPU cores all ranks share (0: a device each); the emulated cluster runs every rank on one host.
    # A probe measures what the job gets, which other work on the host makes a fraction of its cores
    cores: float = 0
    # host CPU-seconds per GB crossing a node's link, taken from the cores that compute: about 0 where
    # NCCL and the NICs move GPUs' bytes; gloo's copies and sums and the kernel's TCP path cost CPU
    # nodes some; on the emulated cluster, whose veth, bridge and tbf run in the one host's kernel,
    # bench/link_probe.py's `cpu_s` measured 10-15 at 100 to 500mbit
    net_cpu_s_per_gb: float = 0.0
    bucket_mb: float = 25.0  # the run's gradient bucket (train --bucket-mb): the unit of overlap
    # --offload optimizer (memory/offload.py): GiB of host memory a node (0: none described, so no
    # offloaded layout fits), its GPUs' host link each way and a rank's CPU AdamW rate
    host_memory_gib: float = 0.0
    pcie_gbps: float = PCIE_GBPS
    adamw_params_s: float = CPU_ADAMW_PARAMS_S


@dataclass(frozen=True)
class Layout:
    pp: int
    dp: int
    zero: int
    schedule: ScheduleKind
    virtual: int
    micro_batch: int
    microbatches: int
    recompute: bool
    grad_reduce: GradReduce = GradReduce.STEP
    placement: Placement = Placement.DP_INNER
    hierarchical: bool = False
    weight_bits: int = 0  # --quantize-weights: 8 (int8 gathers), 0 not quantized
    grad_bits: int = 0  # --quantize-grads: 8 or 4, 0 not quantized
    quant_block: int = 256  # elements a scale (--quant-block)
    secondary: bool = False  # --secondary-shard node: ZeRO-3 layer by layer gathers again inside the node
    partition: Partition = Partition.UNIFORM  # memory: cut so that the largest per-rank peak is least
    # --zero3-prefetch: ZeRO-3 layer by layer (P = 1, no recompute) keeps the next action's first
    # prefetch - 1 layers gathered across an action's end, so their gathers are not sent again
    prefetch: int = 1
    sublayer: bool = False  # --zero3-unit sublayer: the prefetch depth counts a block's attention and MLP apart
    offload: bool = False  # --offload optimizer: masters and AdamW in host memory, the step on the CPU
    in_flight: int = BUCKETS_IN_FLIGHT  # --buckets-in-flight: ZeRO 1-3's reductions the backward runs beside
