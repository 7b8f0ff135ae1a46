"""ZeRO's memory saving, measured: on each rank, every stage's peak of live tensor bytes is held
against stage 0's, per parameter, and must reach 0.9 of what the stage should save (the fp32 column
of zero/accounting.py: 4, 6 and 8 bytes a parameter at D=2).

The figure is the profiler's memory events (every allocation and free of torch's CPU allocator on
the threads it follows: the main thread, autograd's and gloo's workers), summed in time order.
Resident memory would not do: it moves with malloc's arenas, the interpreter and other jobs on the
machine by more than a small model's state. The events also count what only a collective holds
(an all-gather's input), which no walk over Python's objects would find; such a buffer per bucket,
all alive at once, is how ZeRO-1/2 lost half their saving once (zero/coordinator.py start_updates).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from torch.profiler import ProfilerActivity, profile

from pipezero.config import ScheduleKind as K, TrainConfig
from pipezero.models import param_count
from ranks import run_ranks
from pipezero.settings import build_config
from pipezero.zero.accounting import paper_bytes_per_param
from training import tiny_overrides

pytestmark = pytest.mark.distributed

DP = 2
STAGES = (0, 1, 2, 3)
# Many thin layers and eight tokens: a rank's peak is model state, not activations, and what one
# layer or bucket holds for a moment (ZeRO-3's gathered layer, a gradient bucket in flight, gloo's
# copy of it) is a small share of the model. One step reaches every stage's peak: AdamW's state
# exists from the start and the first backward fills the gradients.
MODEL = {"model.n_layers": 32, "model.dim": 64, "model.n_heads": 4, "model.vocab_size": 256,
         "model.max_seq_len": 16}
RUN = {"data.seq_len": 8, "parallel.micro_batch_size": 1, "parallel.bucket_mb": 0.05, "run.max_steps": 1}


def peak_live_bytes(fn: Callable[[], object]) -> int:
    """Most bytes of CPU tensors alive at once while `fn` runs, counting only what it allocated."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:  # an allocation is +bytes, a free -bytes
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def config(data: str, out: str, stage: int) -> TrainConfig:
    return build_config(None, tiny_overrides(data, f"{out}/z{stage}", 1, DP, K.ONE_F_ONE_B, 1, **MODEL, **RUN,
                                             **{"parallel.zero": stage}))


def stage_peaks(rank: int, world: int, data: str, out: str) -> dict[int, int]:
    """This rank's peak live bytes for one training step at each ZeRO stage, from nothing: the
    model, its buckets and AdamW's state are built inside the measured call."""
    from pipezero.engine import train

    return {stage: peak_live_bytes(lambda: train(config(data, out, stage))) for stage in STAGES}


def test_every_zero_stage_saves_at_least_nine_tenths_of_its_share(text_dir, tmp_path):
    psi = param_count(config(str(text_dir), str(tmp_path), 0).model)
    per_rank = run_ranks(stage_peaks, DP, str(text_dir), str(tmp_path), timeout=240)
    short = []
    for rank, peaks in enumerate(per_rank):
        for stage in STAGES[1:]:
            saved = (peaks[0] - peaks[stage]) / psi
            should = paper_bytes_per_param(0, DP, mixed=False) - paper_bytes_per_param(stage, DP, mixed=False)
            if saved < 0.9 * should:
                short.append(f"rank {rank} ZeRO-{stage}: saved {saved:.2f} bytes a parameter, should {should:.2f}")
    table = "; ".join(f"rank {r}: " + ", ".join(f"Z{z} {b / psi:.2f}" for z, b in p.items())
                      for r, p in enumerate(per_rank))
    assert not short, f"{'; '.join(short)} (peak live bytes a parameter, {psi:,} parameters: {table})"
