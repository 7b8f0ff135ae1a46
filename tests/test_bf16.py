"""`--dtype bf16`: bf16 compute and communication (activations, gradients, ZeRO-3 parameters),
fp32 master weights, Adam state and gradient accumulation."""

from __future__ import annotations

import json

import pytest

from pipezero.config import ScheduleKind as K
from ranks import run_ranks
from training import reference, train_cases

LAYOUTS = [
    {"pp": 2, "dp": 1, "kind": K.ONE_F_ONE_B, "m": 4},  # activations and their gradients on the wire
    {"pp": 1, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 0},  # all-reduce
    {"pp": 1, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 2, "parallel.grad_reduce": "microbatch"},
    {"pp": 1, "dp": 2, "kind": K.ONE_F_ONE_B, "m": 2, "parallel.zero": 3},  # + parameter all-gathers
]


def sent(out) -> dict[str, int]:
    s = json.loads((out / "summary.json").read_text())
    return {"p2p": sum(s["bytes_sent"]["p2p"]), "collectives": sum(s["bytes_sent"]["collectives"])}


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_halves_traffic_and_trains_like_one_bf16_process(text_dir, tmp_path):
    cases = [{**c, "run.dtype": d} for c in LAYOUTS for d in ("fp32", "bf16")]
    results = run_ranks(train_cases, 2, str(text_dir), str(tmp_path), cases, timeout=600)
    ref_losses, *_ = reference(str(text_dir), str(tmp_path / "ref"), 4, **{"run.dtype": "bf16"})
    for i in range(0, len(cases), 2):
        fp32, bf16 = sent(tmp_path / f"case{i}"), sent(tmp_path / f"case{i + 1}")
        assert fp32["p2p"] + fp32["collectives"] > 0
        # p2p halves where there is any (the pipeline case); with none, 0 * 2 == 0 would prove nothing
        assert (fp32["p2p"] > 0) == (cases[i]["pp"] > 1), cases[i]
        assert bf16["p2p"] * 2 == fp32["p2p"], cases[i]
        # ZeRO-1/2 gather their updated parameters in fp32 (those buckets are the fp32 masters);
        # with M = 2 micro-batch reduce-scatters a step (each a direct exchange, (D - 1) / D of the
        # bucket, as the gather), that gather is a third of the fp32 bytes
        kept = 1 / 3 if cases[i].get("parallel.zero") == 2 else 0.0
        assert bf16["collectives"] == pytest.approx(fp32["collectives"] * (kept + (1 - kept) / 2), rel=1e-12), cases[i]
        losses = results[0][i + 1]["losses"]
        assert losses == pytest.approx(ref_losses, rel=2e-3), cases[i + 1]  # bf16 rounding unit: 3.9e-3
