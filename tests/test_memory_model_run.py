"""The memory model against measured runs: each rank's predicted peak (memory/model.py) within 10% of
its measured peak (train --memory-profile: the profiler's live tensor bytes of the first step, the
first evaluation and the text sample), one spawn of four ranks:
- 1F1B and ZB-H1 at ZeRO 0 and 3 on P=2 x D=2 (the training step's peak);
- --recompute (a block at a time) at P=2 x D=2 under ZB-H1, and under ZB-V with ZeRO-3 layer by layer;
- an evaluation-heavy layout: 1F1B, P=2 x D=2, recompute, long sequences and 32 evaluation
  batches, whose evaluation holds every micro-batch's send until its end (more than the step);
- a long text sample at P=1 x D=4, ZeRO 0 (rank 0 samples alone) and ZeRO-3 layer by layer (every
  rank samples), a 16384-wide vocabulary over a window grown to 203 tokens (more than the step);
- ZeRO-3 layer by layer with a block's attention and MLP gathered apart (--zero3-unit sublayer) on
  a model whose weights outweigh its activations;
- quantized traffic (ZeRO-0 int8 gradients; ZeRO-3 int8 weights and int4 gradients) at P=1 x D=4 on
  such a model, where the fit check at a limit just below each rank's measured peak must refuse.
In the evaluation-heavy and sample cases, the heavier phase is held to its own prediction too. The whole table (every
schedule, stage, P, D, recompute, two models) is bench/memory_model.py."""

from __future__ import annotations

import pytest

from pipezero.config import ScheduleKind as K
from pipezero.errors import ConfigError
from pipezero.settings import build_config
from pipezero.memory.fit import check_fit
from pipezero.memory.model import predict
from pipezero.memory.runs import phase_peaks
from ranks import run_ranks
from training import tiny_overrides

pytestmark = pytest.mark.distributed

# model state and activations of the same order: four blocks of width 128 over 2 x 32 tokens
MODEL = {"model.n_layers": 4, "model.dim": 128, "model.n_heads": 4, "model.vocab_size": 256,
         "data.seq_len": 32, "data.packing": "concat", "parallel.micro_batch_size": 2, "parallel.bucket_mb": 0.5,
         "run.max_steps": 1, "run.threads": 1}
# model state outweighs activations (eight blocks of width 128 over 16 tokens), so quantized traffic's
# messages and decodes (memory/quantized.py) are a visible share of a rank's peak (bench/memory_model.py's
# `states`); the fit check is held to these too: at a limit just below a rank's measured peak it refuses
STATES = {"model.dim": 128, "model.n_layers": 8, "data.seq_len": 16, "parallel.micro_batch_size": 1}
QUANTIZED = {"ZeRO-0 int8 gradients": {"parallel.zero": 0, "parallel.quantize_grads": "int8"},
             "ZeRO-3 int8 weights, int4 gradients": {"parallel.zero": 3, "parallel.quantize_weights": "int8",
                                                     "parallel.quantize_grads": "int4"}}
# (name, pipeline ranks, data-parallel ranks, schedule, settings beside MODEL, the phase that must be
# heaviest and on which ranks)
CASES = [(f"{kind.value} ZeRO-{zero}", 2, 2, kind, {"parallel.zero": zero}, None, ())
         for kind in (K.ONE_F_ONE_B, K.ZB_H1) for zero in (0, 3)] + [
    # the first stage sends 32 x 4 micro-batches of 512 x 64 fp32
    ("eval-heavy", 2, 2, K.ONE_F_ONE_B, {"model.dim": 64, "data.seq_len": 512, "parallel.micro_batch_size": 1,
                                         "parallel.recompute": True, "run.eval_batches": 32}, "eval", (0, 1)),
    # logits of 203 x 16384 fp32 beside the whole model's state (width 32: its embedding and head are small)
    *[(f"long sample ZeRO-{zero}", 1, 4, K.ONE_F_ONE_B,
       {"model.vocab_size": 16384, "model.dim": 32, "data.seq_len": 16, "parallel.micro_batch_size": 1, "parallel.recompute": True,
        "parallel.zero": zero, "run.sample_tokens": 200}, "sample", (0, 1, 2, 3) if zero == 3 else (0,))
      for zero in (0, 3)],
    # weights outweigh activations (width 256 over 16 tokens): ZeRO-3 layer by layer gathering a block's
    # attention and MLP apart (--zero3-unit sublayer), a part and the next one's prefetch at a time
    ("ZeRO-3 sublayer", 1, 4, K.ONE_F_ONE_B, {"model.dim": 256, "data.seq_len": 16, "parallel.micro_batch_size": 1,
                                             "parallel.zero": 3, "parallel.zero3_unit": "sublayer",
                                             "parallel.zero3_prefetch": 2}, None, ()),
    *[(name, 1, 4, K.ONE_F_ONE_B, {**STATES, **extra}, None, ()) for name, extra in QUANTIZED.items()],
    # --recompute, a block at a time: each block's input kept, one block rerun at a time; under split
    # backward (B and W each rerun) and under ZeRO-3 layer by layer (the rerun uses the block's gather)
    ("zb-h1 ZeRO-1 recompute", 2, 2, K.ZB_H1, {"parallel.zero": 1, "parallel.recompute": True}, None, ()),
    ("zb-v ZeRO-3 layer by layer recompute", 2, 2, K.ZB_V, {"parallel.zero": 3, "parallel.zero3_keep_gathered": False,
                                                           "parallel.recompute": True}, None, ())]


@pytest.mark.slow(52)
def test_predicted_peaks_within_a_tenth_of_measured(text_dir, tmp_path):
    cfgs = [build_config(None, tiny_overrides(str(text_dir), f"{tmp_path}/case{i}", pp, dp, kind, 2 * pp,
                                              **{**MODEL, **extra}))
            for i, (_, pp, dp, kind, extra, _, _) in enumerate(CASES)]
    measured = run_ranks(phase_peaks, 4, cfgs, timeout=300)
    off = []
    for i, ((name, _, _, _, _, heavy, where), cfg) in enumerate(zip(CASES, cfgs)):
        if name in QUANTIZED:  # the fit check admitted the first at 0.82 of its measured peak
            most = max(max(ranks[i].values()) for ranks in measured)
            try:
                check_fit(cfg, most * 0.999 / 2**30, False)
                off.append(f"{name}: admitted at a limit below its measured peak {most / 2**20:.2f} MiB")
            except ConfigError:
                pass
        for r, pred in enumerate(predict(cfg, cuda=False)):
            phases = measured[r][i]
            peak = max(phases.values())
            ratio = pred.peak_bytes / peak
            if not 0.9 <= ratio <= 1.1:
                off.append(f"{name} rank {r}: predicted {pred.peak_bytes / 2**20:.2f} MiB, measured "
                           f"{peak / 2**20:.2f} MiB ({ratio:.3f}; phases {phases})")
            if r not in where:
                continue
            if phases.get(heavy, 0) <= phases["train"]:
                off.append(f"{name} rank {r}: the {heavy} phase ({phases.get(heavy, 0)} bytes) is not above the "
                           f"step's ({phases['train']}): the case does not test what it says")
            if not 0.9 <= pred.phases.get(heavy, 0) / phases[heavy] <= 1.1 or not pred.at.startswith(heavy):
                off.append(f"{name} rank {r}: {heavy} predicted {pred.phases.get(heavy, 0)} bytes (peak at "
                           f"{pred.at!r}), measured {phases[heavy]}")
    assert not off, "; ".join(off)
