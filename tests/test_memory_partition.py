"""The `memory` partition policy (memory/partition.py) in one process: it evens out the
predicted per-rank peaks of a 4-stage 1F1B layout, finds the least largest peak an exhaustive search
finds (one and several chunks a rank), and reaches every place that cuts a run the same way. That
a run so cut trains the same model as one process is tests/test_pipeline.py's."""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pipezero.config import Partition, ScheduleKind as K, TrainConfig
from pipezero.errors import ConfigError
from pipezero.parallel.partition import cut_bounds
from pipezero.settings import build_config
from pipezero.memory.fit import check_fit
from pipezero.memory.model import predict
from pipezero.memory.partition import balance, resolve
from one_line import assert_one_line, run_main

GIB = 2**30


def small(**kw) -> TrainConfig:
    """The bench's model (bench/memory_partition.py) at a shorter sequence: activations matter."""
    base = {"model.preset": "small", "data.seq_len": "512", "parallel.pp": "4", "parallel.microbatches": "8",
            "parallel.micro_batch_size": "4", "run.device": "cpu"}
    base.update({k: str(v) for k, v in kw.items()})
    return build_config(None, base)


def tiny(pp: int, kind: K, **kw) -> TrainConfig:
    """tests/training.py's model: 6 blocks of width 64, two sequences of 32 tokens a micro-batch."""
    v = 2 if kind in (K.ZB_V, K.DUALPIPE_V, K.INTERLEAVED_1F1B) else 1
    base = {"model.preset": "tiny", "model.n_layers": "6", "model.dim": "64", "model.n_heads": "4",
            "model.vocab_size": "256", "data.seq_len": "32", "parallel.pp": str(pp), "parallel.schedule": kind.value,
            "parallel.microbatches": "4", "parallel.micro_batch_size": "2", "parallel.virtual_stages": str(v),
            "parallel.bucket_mb": "0.05", "run.device": "cpu"}
    base.update({k: str(v) for k, v in kw.items()})
    return build_config(None, base)


def peaks(cfg: TrainConfig, policy: Partition) -> list[int]:
    cfg = replace(cfg, parallel=replace(cfg.parallel, partition=policy))
    return [r.peak_bytes for r in predict(resolve(cfg))]


def test_memory_cuts_even_out_a_4_stage_1f1b():
    """1F1B's first rank holds 4 micro-batches in flight, its last one (and the head's logits):
    cuts by layers or parameters leave the largest rank's peak about 3x the smallest's."""
    cfg = small()
    ratio = {p: max(x) / min(x) for p in Partition for x in [peaks(cfg, p)]}
    top = {p: max(peaks(cfg, p)) for p in Partition}
    assert ratio[Partition.MEMORY] < ratio[Partition.UNIFORM] and ratio[Partition.MEMORY] < ratio[Partition.PARAMS]
    assert ratio[Partition.UNIFORM] > 2.5 and ratio[Partition.MEMORY] < 1.8  # 3.08 and 1.59 when written
    assert top[Partition.MEMORY] <= min(top.values())
    chosen = balance(cfg)
    assert chosen.counts[0] < chosen.counts[-1]  # the first stage (P in flight) holds fewer layers than the last
    assert list(chosen.peaks) == peaks(cfg, Partition.MEMORY)[::cfg.parallel.dp]


def compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        yield [b[i + 1] - b[i] for i in range(k)]


@pytest.mark.parametrize("pp, kind", [(4, K.ONE_F_ONE_B), (4, K.ZB_H1), (2, K.ZB_V), (2, K.DUALPIPE_V),
                                      (2, K.INTERLEAVED_1F1B)])
def test_memory_cuts_reach_the_least_largest_peak(pp, kind):
    """Against every cut of the 8 layers into non-empty chunks (35 of them): one chunk a rank by the
    fill's bisection, several (V placements, interleaving) by descent."""
    cfg = tiny(pp, kind, **{"parallel.partition": "memory"})
    best = min(max(r.peak_bytes for r in predict(replace(cfg, parallel=replace(cfg.parallel, stage_layers=c))))
               for c in compositions(8, pp * cfg.parallel.virtual_stages))
    assert max(balance(cfg).peaks) == best


def test_resolve_writes_the_cuts_and_leaves_other_policies_alone():
    cfg = small(**{"parallel.partition": "memory"})
    done = resolve(cfg)
    assert done.parallel.stage_layers == list(balance(cfg).counts) and cfg.parallel.stage_layers is None
    assert sum(done.parallel.stage_layers) == cfg.model.n_layers + 2
    # cuts given beside the policy (train refuses the pair as settings: the cuts leave the policy
    # unread; a configuration made in code may hold both)
    given = small(**{"parallel.stage_layers": "3,3,2,2"})
    given.parallel.partition = Partition.MEMORY
    for other in (small(), small(**{"parallel.partition": "params"}), given):
        assert resolve(other) is other
    with pytest.raises(ValueError, match="memory partition is chosen from the whole run"):
        predict(cfg)  # unresolved: the memory model cannot cut it by per-layer counts alone
    with pytest.raises(ValueError, match="resolve"):
        cut_bounds([1] * 10, lambda: [1.0] * 10, 4, Partition.MEMORY)


def test_the_runtime_cuts_as_the_policy_says():
    """stage.py's cut under `--partition memory` is the policy's (and refuses a spec it cannot walk)."""
    from pipezero.models import spec_of
    from pipezero.stage import memory_cuts

    cfg = small(**{"parallel.partition": "memory"})
    assert memory_cuts(cfg, spec_of(cfg.model), torch.device("cpu")) == list(balance(cfg, False).counts)
    assert memory_cuts(small(), spec_of(cfg.model), torch.device("cpu")) is None

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        import own_model
    finally:
        sys.path.pop(0)
    with pytest.raises(ConfigError, match="--partition memory with the model GPTSpec"):
        memory_cuts(cfg, own_model.GPTSpec(), torch.device("cpu"))


def test_memory_cuts_make_a_layout_fit(capsys, monkeypatch):
    """train's fit check reads the policy's cuts: a limit between the two largest peaks refuses the
    uniform cut and passes the memory one; `simulate --memory` shows the cuts."""
    from pipezero.cli import main
    from pipezero.memory import fit

    monkeypatch.setattr(fit, "alternatives", lambda *a: "")  # the planner's suggestions: not this test's
    limit = (max(peaks(small(), Partition.MEMORY)) + max(peaks(small(), Partition.UNIFORM))) / 2 / GIB
    with pytest.raises(ConfigError, match="does not fit"):
        check_fit(small(), limit, False)
    assert check_fit(small(**{"parallel.partition": "memory"}), limit, False) is not None
    assert main(["simulate", "--memory", "--preset", "small", "--pp", "4", "--microbatches", "8", "--seq-len", "512",
                 "--partition", "memory", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stage_layers"] == list(balance(small()).counts)


def test_memory_partition_with_a_spec_of_ones_own_is_one_line(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    assert_one_line(*run_main(["train", "--model-spec", "own_model:GPTSpec", "--partition", "memory",
                               "--packing", "concat", "--max-steps", "1"], capsys),
                    "--partition memory with --model-spec own_model:GPTSpec")


def test_plan_tries_memory_cuts_only_where_few_layouts_fit():
    """The planner's rescue (planner/search.cut_by_memory): a 4-stage 1F1B layout over its memory with
    uniform cuts fits with memory cuts, estimated again with the slower step its heavier last rank
    paces; with ten layouts that fit already, nothing is searched."""
    from pipezero.config import ModelConfig
    from pipezero.models import apply_preset
    from pipezero.memory.fit import flags
    from pipezero.planner.layouts import Cluster, Layout
    from pipezero.planner.search import cut_by_memory, estimate

    model = apply_preset(ModelConfig(), "small")
    lay = Layout(4, 1, 0, K.ONE_F_ONE_B, 1, 4, 8, False)
    probe = Cluster(4, 1.0, cpu=True, wire_bytes=4)
    uniform = estimate(model, 1024, 32, probe, lay)
    memory = max(peaks(build_config(None, {"model.preset": "small", "data.seq_len": "1024", "parallel.pp": "4",
                                           "parallel.microbatches": "8", "run.device": "cpu"}), Partition.MEMORY))
    assert memory / GIB < uniform.memory_gib
    cluster = replace(probe, gpu_memory_gib=(memory / GIB + uniform.memory_gib) / 2 / probe.headroom)
    (rescued,) = cut_by_memory(model, cluster, 1024, 32, [], [uniform])
    assert rescued.layout.partition is Partition.MEMORY and rescued.memory_gib <= cluster.gpu_memory_gib * 0.9
    assert rescued.step_time_s > uniform.step_time_s  # the last rank holds 4 blocks, uniform's at most 2
    assert flags(rescued.layout).endswith("--partition memory")
    assert cut_by_memory(model, cluster, 1024, 32, [uniform] * 10, [uniform]) == []


def test_one_stage_has_nothing_to_cut_whatever_the_policy():
    """At --pp 1 the memory policy has no cut to choose: the whole model is the one stage, for the
    memory model, the runtime and verify's one-process reference alike."""
    assert cut_bounds([1] * 8, lambda: [1.0] * 8, 1, Partition.MEMORY) == [(0, 8)]
    one = tiny(1, K.ONE_F_ONE_B, **{"parallel.partition": "memory"})
    assert [r.peak_bytes for r in predict(one)] == peaks(one, Partition.UNIFORM)
    assert [r.peak_bytes for r in predict(resolve(one))] == peaks(one, Partition.UNIFORM)


@pytest.mark.parametrize("pp", [1, 4])
def test_the_host_memory_check_cuts_as_the_policy_says(pp):
    """train and verify on CPU add up the ranks' predicted peaks before any rank starts: under
    --partition memory that prediction is of the policy's cuts."""
    from pipezero.cli.train import check_host_memory

    check_host_memory(small(**{"parallel.partition": "memory", "parallel.pp": pp}))


@pytest.mark.distributed  # full lane: seconds of one-process training
def test_plain_train_with_the_memory_policy_trains_one_stage(text_dir, tmp_path, capsys):
    """The plainest `pipezero train --partition memory` (one process, --pp 1) trains."""
    code, err = run_main(["train", "--partition", "memory", "--preset", "tiny", "--tokenizer", "bytes", "--data",
                          str(text_dir), "--max-steps", "1", "--seq-len", "16", "--microbatches", "1",
                          "--sample-tokens", "0", "--eval-every", "0", "--no-save-final",
                          "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]
