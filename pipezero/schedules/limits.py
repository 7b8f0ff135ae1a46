"""The sizes and values `simulate` and `plan` accept.

Both play schedules action by action in Python, so a request's time and memory follow how many
actions it plays: unbounded, `simulate --pp 4 --microbatches 10000000` grew past 3.5 GB and
`plan --gpus 1073741824` ran for minutes. Each limit below is where a request still answers within
a few seconds and a few hundred MB on one busy CPU core (measured; the numbers are in the commit
that set them). Values are bounded too where an extreme one overflows a float into inf and nan.
"""

from __future__ import annotations

from pipezero.coerce import Range

# simulate: pipeline ranks, and with --zero data-parallel ranks (the lowered program has P x D ranks)
PP = Range(1, 1024)
DP = Range(1, 1024)
# stage micro-batches (P x M x V, summed over --compare's schedules) one request plays; with --zero
# each action also carries its collectives on P x D ranks, so P x D x M x V is held lower
PLAY_LIMIT = 16384
ZERO_PLAY_LIMIT = 4096
# and the lowered program's instructions (every schedule's, every rank's): each costs 10-40 us to
# prove and play twice, so buckets a chunk count too (70b at ZeRO-3 layer by layer: 80 a chunk, and
# each action of a chunk lists a gather and a release of each, inside it)
INSTRUCTION_LIMIT = 80_000
# --png draws one bar an action: matplotlib takes about 1.3 ms a bar
DRAW_LIMIT = 512
# relative times (F:B:W, hops, the optimizer): sums over up to PLAY_LIMIT x 3 actions stay finite
COST = Range(1e-6, 1e6)
TIME = Range(0, 1e6)

# plan: schedule actions simulated a request, each layout's estimate counted as LAYOUT_COST of
# them; many micro-batches a rank cost the most and are played last, what does not fit is skipped
PLAN_BUDGET = 200_000
LAYOUT_COST = 5
# plan: where fewer layouts than this fit, those that do not are tried with memory-balanced cuts
# (memory/partition.py), nearest to fitting first, until the searches have walked this many
# rank programs (one to tens of ms each)
MEMORY_CUT_RANK = 10
MEMORY_CUT_WALKS = 200
# plan: GPUs (the groups of every split are enumerated) and sequences a step
GPUS = Range(1, 65536)
GLOBAL_BATCH = Range(1, 2**20)
PARAMS = Range(1e6, 1e13)
GPU_MEMORY_GIB = Range(0, 16384, open_low=True)  # a byte count (80e9) is refused, not planned for
HOST_MEMORY_GIB = Range(0, 1 << 20)  # a node's (0: none for offload); a byte count (256e9) is refused
PARAMS_S = Range(1e3, 1e13)  # a CPU's AdamW rate, parameters a second
TFLOPS = Range(1e-6, 1e5)
GBPS = Range(1e-6, 1e6)
OVERHEAD_MS = Range(0, 1e6)
NET_CPU = Range(0, 1e4)

# verify: steps it trains three times (the layout, one process, one process re-cut), keeping every
# step's loss and norm; a check of a few steps, not a training run (10^11 never ended)
VERIFY_STEPS = Range(1, 1000)

# train (and verify): every rank builds and proves its step's schedule when it starts, about 0.2 ms a
# stage micro-batch on a busy core (P x M x V = 10^5: 12 s; --microbatches 10^9 never started)
TRAIN_PLAY_LIMIT = 65536
# and holds a step's global batch (M x B x D sequences of T + 1 token ids) in memory on every rank:
# --micro-batch-size 10^9 would ask 119 GiB of one allocation
BATCH_TOKENS = 1 << 28

# The fit check's share of a rank's limit its predicted peak may not pass (memory/fit.py): the memory
# model's worst under-prediction over bench/memory_model.py's measured cases (bench/results/
# memory_model*.json) is 0.941 (bf16, zb-v's split backward, whose bf16 transients are not recounted),
# 0.951 with quantized traffic (ZeRO-1 int8 gradients: the walk plays a backward's reductions after
# it, where they start inside it), 0.973 in the fp32 table; with 6% to spare no measured case whose
# peak passes its limit is admitted.
FIT_MARGIN = 0.06
