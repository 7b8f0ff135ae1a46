"""The memory model (memory/model.py) in one process: its per-layer bytes against what autograd
really saves, the walk's ZeRO and schedule rules, `simulate --memory`, the planner reading it, and
train's fit check refusing a layout before any rank starts. Its accuracy against measured runs is
tests/test_memory_model_run.py (and bench/memory_model.py for the whole table)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pipezero.cli import main
from pipezero.config import DType, ModelConfig, ScheduleKind as K
from pipezero.models.llama import Block, Head
from pipezero.models.spec import lm_loss
from pipezero.runtime.weight_grad import WeightGradCapture
from pipezero.models.presets import apply_preset, block_params
from pipezero.errors import ConfigError
from pipezero.settings import build_config
from pipezero.memory.fit import check_fit
from pipezero.memory.model import Shapes, layer_bytes, predict
from one_line import assert_one_line, run_main


def layout(**kw) -> dict:
    base = {"model.preset": "small", "data.seq_len": 64, "parallel.micro_batch_size": 2, "run.device": "cpu"}
    base.update({k: v if isinstance(v, bool) else str(v) for k, v in kw.items()})
    return base


def test_block_bytes_are_what_autograd_saves():
    """A block's `held`: every tensor its forward saves for backward (its weights and its input
    aside: those are parameters and the layer before's output) plus its output."""
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256)
    b, t = 2, 48
    block, x = Block(cfg), torch.randn(b, t, cfg.dim, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        st = tensor.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = block(x)
    # rotary's cos and sin tables are cached on the module, shared by every micro-batch
    tables = {t.untyped_storage().data_ptr() for t in block.attn._tables}
    own = sum(n for ptr, n in saved.items() if ptr not in weights | tables and ptr != x.untyped_storage().data_ptr())
    predicted = layer_bytes(Shapes.of(cfg, b, t, DType.FP32), 1, cfg.n_layers, block_params(cfg) - 2 * cfg.dim)
    assert predicted.held == own + y.untyped_storage().nbytes()


def saved_by(module: torch.nn.Module, x: torch.Tensor, loss: bool = False) -> tuple[dict, list, torch.Tensor]:
    """What autograd saves running `module` on `x` (storage -> bytes; weights, rotary tables and x
    left out), the weight ops' records a split forward keeps, and the output."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    cap = WeightGradCapture(module)
    with cap.recording() as records, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = module(x)
        if loss:
            y = lm_loss(y, torch.randint(0, 256, x.shape[:2]), 1.0)
    tables = getattr(getattr(module, "attn", None), "_tables", None) or ()
    skip |= {t.untyped_storage().data_ptr() for t in tables}
    return {p: n for p, n in saved.items() if p not in skip}, records, y


def test_head_bytes_are_what_autograd_saves():
    """The head with its loss: the norm's two outputs, its statistics, log-softmax, the targets."""
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256)
    b, t = 2, 48
    saved, _, _ = saved_by(Head(cfg), torch.randn(b, t, cfg.dim, requires_grad=True), loss=True)
    predicted = layer_bytes(Shapes.of(cfg, b, t, DType.FP32), cfg.n_layers + 1, cfg.n_layers, cfg.vocab_size * cfg.dim)
    assert predicted.held == sum(saved.values())


def test_bf16_autocast_bytes_are_what_autograd_saves():
    """Under bf16 autocast (the residual stream in bf16): the norms run in fp32 (their input upcast
    and their output kept), every linear keeps its input cast back and its weight's bf16 copy."""
    from pipezero.runtime.autocast import autocast

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256)
    b, t = 2, 48
    shapes = Shapes.of(cfg, b, t, DType.BF16)
    with autocast(DType.BF16, "cpu"):
        saved, _, y = saved_by(Block(cfg), torch.randn(b, t, cfg.dim).to(torch.bfloat16).requires_grad_())
        assert layer_bytes(shapes, 1, cfg.n_layers, block_params(cfg) - 2 * cfg.dim).held == \
            sum(saved.values()) + y.untyped_storage().nbytes()
        saved, _, _ = saved_by(Head(cfg), torch.randn(b, t, cfg.dim).to(torch.bfloat16).requires_grad_(), loss=True)
    assert layer_bytes(shapes, cfg.n_layers + 1, cfg.n_layers, cfg.vocab_size * cfg.dim).held == sum(saved.values())


@pytest.mark.parametrize("head", [False, True])
def test_split_backward_keeps_and_frees_what_the_model_says(head):
    """Split backward: B frees the saved tensors no weight op's record holds (`b_freed`), keeps a dy
    for every record (`stash_new`), and W's stash keeps every record's x, the layer's input among
    them (`stash` - `stash_new`)."""
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256)
    b, t = 2, 48
    x = torch.randn(b, t, cfg.dim, requires_grad=True)
    module = Head(cfg) if head else Block(cfg)
    saved, records, _ = saved_by(module, x, loss=head)
    recorded = {s.untyped_storage().data_ptr() for r in records for s in (r.x, r.y)}
    xs = {r.x.untyped_storage().data_ptr(): r.x.untyped_storage().nbytes() for r in records}
    dys = sum(r.y.untyped_storage().nbytes() for r in records)
    shapes = Shapes.of(cfg, b, t, DType.FP32)
    predicted = layer_bytes(shapes, cfg.n_layers + 1, cfg.n_layers, cfg.vocab_size * cfg.dim) if head else \
        layer_bytes(shapes, 1, cfg.n_layers, block_params(cfg) - 2 * cfg.dim)
    assert predicted.b_freed == sum(n for p, n in saved.items() if p not in recorded)
    assert predicted.stash_new == dys
    assert predicted.stash - predicted.stash_new == sum(xs.values())


def test_zero_stages_shard_what_they_should():
    """Model states at the peak: ZeRO-1 shards AdamW's moments, ZeRO-3 the parameters too."""
    peaks = {z: predict(build_config(None, layout(**{"parallel.dp": 2, "parallel.zero": z,
                                                     "parallel.microbatches": 2})))[0] for z in range(4)}
    cat = {z: r.categories for z, r in peaks.items()}
    assert cat[1]["optimizer"] == cat[0]["optimizer"] // 2
    assert cat[3]["params"] == cat[0]["params"] // 2
    assert cat[0]["params"] == cat[1]["params"] == cat[2]["params"]
    assert peaks[3].peak_bytes < peaks[1].peak_bytes < peaks[0].peak_bytes


def test_schedules_hold_what_they_keep_in_flight():
    """GPipe's first rank holds all M micro-batches' activations, 1F1B's P; recompute keeps only
    each block's input between a forward and its backward, and reruns one block at a time."""
    def acts(kind: K, m: int, recompute: bool = False) -> list[int]:
        cfg = build_config(None, layout(**{"parallel.pp": 2, "parallel.schedule": kind.value, "data.seq_len": 1024,
                                           "parallel.microbatches": m, "parallel.recompute": recompute}))
        return [r.categories["activations"] for r in predict(cfg)]

    assert acts(K.GPIPE, 8)[0] > 3 * acts(K.ONE_F_ONE_B, 8)[0]
    assert acts(K.ONE_F_ONE_B, 8)[0] == acts(K.ONE_F_ONE_B, 16)[0]  # in flight: P, whatever M
    assert acts(K.ONE_F_ONE_B, 8, recompute=True)[0] < 0.6 * acts(K.ONE_F_ONE_B, 8)[0]


def test_recompute_keeps_a_residual_tensor_a_block_and_reruns_one_block_at_a_time():
    """--recompute checkpoints each block (runtime/recompute.py): four more blocks add four kept
    inputs (B x T x dim, fp32) to the peak's activations, where without it they add four blocks' saved
    tensors; the peak is inside a backward, rerunning one block."""
    def peak(n_layers: int, recompute: bool):
        cfg = build_config(None, layout(**{"parallel.microbatches": 2, "model.n_layers": n_layers, "data.seq_len": 1024,
                                           "parallel.recompute": recompute}))
        return predict(cfg)[0]

    boundary = 2 * 1024 * 320 * 4
    again = [peak(n, True) for n in (4, 8)]
    assert again[1].categories["activations"] - again[0].categories["activations"] == 4 * boundary
    assert again[1].at == "0BW0"
    plain = [peak(n, False).categories["activations"] for n in (4, 8)]
    assert plain[1] - plain[0] > 20 * 4 * boundary


def test_simulate_memory_json_names_every_rank(capsys):
    assert main(["simulate", "--memory", "--json", "--preset", "small", "--pp", "2", "--dp", "2", "--zero", "3",
                 "--schedule", "zb-h1", "--microbatches", "4", "--seq-len", "64", "--micro-batch-size", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in out["ranks"]] == [0, 1, 2, 3]
    for r in out["ranks"]:
        assert r["peak_bytes"] == sum(r["categories"].values()) > 0
        assert r["peak_bytes"] == max(r["phases"].values()) and set(r["phases"]) == {"train", "eval"}
        assert r["categories"]["gathered"] > 0  # ZeRO-3 keeps its chunk gathered through the step


def test_plan_reads_the_memory_model():
    from pipezero.planner.layouts import Cluster, Layout
    from pipezero.memory.model import layout_memory
    from pipezero.planner.search import GIB, estimate

    model = apply_preset(ModelConfig(), "small")
    lay = Layout(2, 1, 0, K.ONE_F_ONE_B, 1, 2, 4, False)
    cluster = Cluster(gpus=2, gpu_memory_gib=80, cpu=True, wire_bytes=4)
    est = estimate(model, 64, 8, cluster, lay)
    assert est.memory_gib * GIB == pytest.approx(layout_memory(model, 64, lay, False, False, 25.0).peak_bytes)


def test_fit_check_refuses_before_any_rank_starts(capsys, monkeypatch, tmp_path):
    import pipezero.launch as launch

    def no_launch(*a, **k):
        raise AssertionError("ranks started")

    monkeypatch.setattr(launch, "launch_local", no_launch)
    code, err = run_main(["train", "--preset", "small", "--pp", "2", "--microbatches", "4", "--seq-len", "256",
                          "--micro-batch-size", "4", "--device", "cpu", "--nproc", "2", "--gpu-memory", "0.2",
                          "--out", str(tmp_path / "run")], capsys)
    assert_one_line(code, err, "does not fit --gpu-memory 0.2 GiB: rank 0")
    assert "activations" in err and "layouts that fit on 2 ranks, fastest first: --pp" in err
    fits = check_fit(build_config(None, layout(**{"parallel.pp": 2, "parallel.microbatches": 4})), 0.2 * 16, False)
    assert fits is not None and len(fits) == 2


def test_simulate_memory_refuses_flags_it_would_ignore(capsys):
    code, err = run_main(["simulate", "--memory", "--cost", "1:2:1"], capsys)
    assert_one_line(code, err, "--memory takes no --cost")


def test_the_planner_reads_the_heaviest_rank_not_only_the_ends():
    """Under an even cut of `small` at P=4, 1F1B, the second rank (a whole stage of blocks, P-1
    micro-batches in flight) outweighs both ends: the planner's figure is the heaviest of all ranks."""
    from pipezero.config import DataConfig, Packing, ParallelConfig, TrainConfig
    from pipezero.planner.layouts import Layout
    from pipezero.memory.model import build_plan, layout_memory, walk

    model = apply_preset(ModelConfig(), "small")
    par = ParallelConfig(pp=4, dp=1, zero=0, schedule=K.ONE_F_ONE_B, microbatches=8, micro_batch_size=4)
    cfg = TrainConfig(model=model, parallel=par, data=DataConfig(seq_len=1024, packing=Packing.CONCAT))
    peaks = [walk(build_plan(cfg, False, (r,)), r).peak_bytes for r in range(4)]
    assert peaks[1] > max(peaks[0], peaks[3])
    lay = Layout(4, 1, 0, K.ONE_F_ONE_B, 1, 4, 8, False)
    assert layout_memory(model, 1024, lay, False, False, par.bucket_mb).peak_bytes == max(peaks)


def test_an_evaluation_holds_every_send_to_its_end():
    """The evaluation phase: a rank that sends on holds each evaluation micro-batch's output until
    the evaluation's end, so its eval peak grows by M boundary activations a further batch read
    (and by the held-out windows, alive the whole run, as every phase does); the last stage sends
    nothing. With recompute and many batches the evaluation is the first rank's peak."""
    def ranks(batches: int, recompute: bool = False) -> list:
        return predict(build_config(None, layout(**{"parallel.pp": 2, "parallel.microbatches": 4,
                                                    "parallel.recompute": recompute, "parallel.bucket_mb": 4,
                                                    "run.eval_batches": batches})))

    one, nine = ranks(1), ranks(9)
    rows = 4 * 2 * 64 * 16  # one global batch of held-out windows: int64 tokens and targets
    send = 2 * 64 * 320 * 4  # B x T x dim, fp32
    assert nine[0].phases["eval"] - one[0].phases["eval"] == 8 * (4 * send + rows)
    assert nine[1].phases["eval"] - one[1].phases["eval"] == 8 * rows
    assert nine[0].phases["train"] - one[0].phases["train"] == 8 * rows
    heavy = ranks(64, recompute=True)[0]
    assert heavy.at.startswith("eval") and heavy.peak_bytes == heavy.phases["eval"] > heavy.phases["train"]
    assert heavy.categories["p2p"] >= 64 * 4 * send - 2 * send  # all but the last micro-batch's


def test_the_text_sample_is_a_phase_without_a_pipeline():
    """The end-of-run sample (P = 1 only): a forward over the window grown to the prompt and the
    sampled tokens, cut at the model's max_seq_len; rank 0 samples alone below ZeRO-3 (the others
    wait), every rank samples at ZeRO-3 layer by layer."""
    def ranks(tokens: int, zero: int = 0, pp: int = 1) -> list:
        cfg = build_config(None, layout(**{"parallel.pp": pp, "parallel.dp": 2, "parallel.zero": zero,
                                           "parallel.microbatches": 2, "parallel.micro_batch_size": 1,
                                           "parallel.recompute": True, "parallel.bucket_mb": 4,
                                           "run.sample_tokens": tokens if pp == 1 else 0}))
        cfg.run.sample_tokens = tokens  # at P > 1 train refuses it (nothing samples); the model ignores it too
        return predict(cfg)

    assert "sample" not in ranks(0)[0].phases and "sample" not in ranks(2000, pp=2)[0].phases
    short, long, longer = ranks(100), ranks(2000), ranks(3000)
    assert short[0].phases["sample"] < long[0].phases["sample"] == longer[0].phases["sample"]  # max_seq_len 1024
    assert long[0].at.startswith("sample") and long[0].peak_bytes == long[0].phases["sample"]
    assert long[1].phases["sample"] < long[0].phases["sample"] and not long[1].at.startswith("sample")
    together = ranks(2000, zero=3)
    assert together[1].phases["sample"] == together[0].phases["sample"]


def test_fit_check_names_a_phase_outside_the_step():
    """A layout whose peak is its text sample is refused naming the sample and what lowers it."""
    from pipezero.errors import ConfigError

    cfg = build_config(None, {"model.preset": "tiny", "data.seq_len": "16", "parallel.micro_batch_size": "1",
                              "parallel.recompute": True, "run.sample_tokens": "1000", "run.device": "cpu"})
    limit = predict(cfg, cuda=False)[0].phases["train"] / 2**30 * 1.05  # the step fits, the sample does not
    with pytest.raises(ConfigError, match=r"in the end-of-run text sample \(fewer --sample-tokens"):
        check_fit(cfg, limit, cuda=False)


@pytest.mark.parametrize("argv, needle", [
    (["train", "--preset", "7b", "--seq-len", "16"], "GiB (1 CPU rank's predicted peak: weights, gradients, AdamW "
                                                     "state, activations), more than this host's"),
    (["train", "--preset", "70b", "--seq-len", "16", "--pp", "4", "--nproc", "4"], "(4 CPU ranks' predicted peaks"),
])
def test_a_model_past_the_hosts_memory_is_refused_before_it_is_built(argv, needle, tmp_path, capsys, monkeypatch):
    """--preset 7b on a CPU host of 24 GiB would be built for minutes, until the kernel killed it. The
    host here is made 16 GiB, as a laptop's, so the test does not depend on this machine's size."""
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: 4 << 20 if name == "SC_PHYS_PAGES" else real(name))
    code, err = run_main([*argv, "--max-steps", "1", "--device", "cpu", "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, needle)
    assert f"this host's {(4 << 20) * real('SC_PAGE_SIZE') / 2**30:.1f} GiB" in err
    assert not (tmp_path / "o").exists()


# model state outweighs activations (eight blocks of width 128 over 16 tokens): quantized traffic's
# buffers, a bucket's worth of messages and decodes, are a visible share of a rank's peak
STATES = {"model.preset": "tiny", "model.n_layers": 8, "model.dim": 128, "model.n_heads": 4, "model.vocab_size": 256,
          "data.seq_len": 16, "data.packing": "concat", "parallel.micro_batch_size": 1, "parallel.microbatches": 2,
          "parallel.bucket_mb": 0.5, "parallel.dp": 2, "run.device": "cpu"}


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_message_is_sized_as_the_wire_sends_it(bits):
    """The torch-free sizes the program and the memory model count (schedules/wire.py) are zero/quantize.py's."""
    from pipezero.schedules.wire import WireFormat
    from pipezero.zero.quantize import Bits, encode

    for numel, block in ((1, 256), (255, 256), (257, 256), (65601, 32), (131200, 256)):
        assert WireFormat(f"int{bits}", block).bytes(numel) == encode(torch.randn(numel), Bits(bits), block).numel()


def test_quantized_gradients_at_zero0_hold_every_reductions_messages_to_the_step():
    """ZeRO-0's quantized all-reduce of a bucket holds its D messages sent and received and its fp32
    piece from the backward that starts it to the step that waits for it, then decodes (2 x n fp32)
    at the wait: every bucket's at once. Counted as the plain all-reduce's nothing, the prediction
    was 0.82 of the measured peak and the fit check admitted a layout 17% over its limit."""
    from pipezero.memory.model import build_plan
    from pipezero.memory.quantized import reduction_flight
    from pipezero.schedules.wire import WireFormat

    plain = build_config(None, STATES)
    quant = build_config(None, {**STATES, "parallel.quantize_grads": "int8"})
    before, after = predict(plain, cuda=False)[0], predict(quant, cuda=False)[0]
    sizes = [n for c in range(1) for n in build_plan(quant, False).buckets.buckets(c)]
    flying = sum(reduction_flight(WireFormat("int8", 256), n, 2) for n in sizes)
    assert after.at == "OPTIM_STEP" and after.categories["collectives"] >= flying
    state = sum(after.categories[c] for c in ("params", "grads", "optimizer"))
    assert state == sum(before.categories[c] for c in ("params", "grads", "optimizer"))
    assert after.peak_bytes >= state + flying > before.peak_bytes  # measured: 35.06 MiB against 28.71 unquantized
    from pipezero.schedules.limits import FIT_MARGIN

    # a limit whose admitted share lies between the two: the plain layout fits, the quantized does not
    limit = (before.peak_bytes + after.peak_bytes) / 2 / 2**30 / (1 - FIT_MARGIN)
    assert check_fit(plain, limit, False) is not None
    with pytest.raises(ConfigError, match="does not fit --gpu-memory"):
        check_fit(quant, limit, False)


@pytest.mark.parametrize("zero, what, flag", [(1, "updated weights", "parallel.quantize_weights"),
                                              (3, "layer by layer", "parallel.quantize_weights"),
                                              (2, "reduce-scatter", "parallel.quantize_grads"),
                                              (3, "secondary shares", "parallel.secondary_shard")])
def test_quantized_traffic_and_node_shares_raise_the_prediction(zero, what, flag):
    """ZeRO-1/2 gather every bucket's updated weights at the step's end, each holding its messages
    until a forward waits for it (then a decode); ZeRO-3's layers in flight and the one decoded;
    a reduce-scatter's messages and decode; hpZ's share of each bucket a node keeps."""
    value = "node" if flag == "parallel.secondary_shard" else "int8"
    extra = {"parallel.ranks_per_node": "2"} if value == "node" else {}
    plain = predict(build_config(None, {**STATES, "parallel.dp": 4, "parallel.zero": zero, **extra,
                                        **({"parallel.hierarchical": True} if extra else {})}), cuda=False)[0]
    quant = predict(build_config(None, {**STATES, "parallel.dp": 4, "parallel.zero": zero, flag: value, **extra,
                                        **({"parallel.hierarchical": True} if extra else {})}), cuda=False)[0]
    assert quant.peak_bytes > plain.peak_bytes * 1.02, what


def test_simulate_memory_takes_trains_defaults_for_flags_left_out(capsys, tmp_path):
    """`simulate --memory --dp 2` predicted P=4 x D=2 (simulate's timing default --pp 4, M 8, small)
    where `train --dp 2` runs P=1 x D=2: a user held the prediction against another layout. A flag
    left out now takes train's default, and the JSON names the layout predicted."""
    assert main(["simulate", "--memory", "--preset", "tiny", "--dp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    train = build_config(None, {"model.preset": "tiny", "parallel.dp": "2"})
    assert (out["layout"]["pp"], out["layout"]["dp"], out["layout"]["microbatches"]) == (1, 2, 4)
    assert [r["peak_bytes"] for r in out["ranks"]] == [r.peak_bytes for r in predict(train)]
    # a flag typed wins over --config even where it equals simulate's own default (--pp 4 was dropped)
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npreset = "tiny"\n[parallel]\npp = 2\nmicrobatches = 8\n')
    assert main(["simulate", "--memory", "--config", str(toml), "--pp", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["pp"] == 4
    assert main(["simulate", "--memory", "--config", str(toml), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["pp"] == 2


def test_simulate_memory_counts_quantized_traffic(capsys):
    """--quantize-grads and --quantize-weights change the prediction (memory/quantized.py), so
    `simulate --memory` takes them as train does (it refused them as flags it would ignore)."""
    argv = ["simulate", "--memory", "--preset", "tiny", "--dp", "2", "--zero", "1", "--seq-len", "16",
            "--micro-batch-size", "1", "--json"]  # model state, not activations, at the peak
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["ranks"][0]["peak_bytes"]
    assert main([*argv, "--quantize-grads", "int8", "--quantize-weights", "int8"]) == 0
    quant = json.loads(capsys.readouterr().out)
    assert quant["layout"]["quantize_grads"] == "int8" and quant["ranks"][0]["peak_bytes"] > plain
    assert_one_line(*run_main(["simulate", "--memory", "--dp", "2", "--quantize-weights", "int8"], capsys),
                    "--quantize-weights int8 with --zero 0")


def offloaded(cfg_kw: dict, offload: bool) -> list:
    """Every rank's prediction of `cfg_kw`'s layout, the optimizer offloaded or not (simulate's
    settings: the runtime does not offload yet)."""
    cfg = build_config(None, {**cfg_kw, "parallel.offload": "optimizer" if offload else "none"})
    return predict(cfg, cuda=False)


def updated_elements(cfg_kw: dict) -> list[int]:
    """Each rank's updated elements, from the buckets the run pads: ZeRO-0 the whole buckets, ZeRO-1
    to 3 a 1/D shard of each."""
    from pipezero.schedules.zero_rules import RULES
    from pipezero.memory.model import build_plan

    cfg = build_config(None, cfg_kw)
    plan = build_plan(cfg, False)
    dp = cfg.parallel.dp
    whole = [sum(plan.buckets.chunk_numel(c) for c in plan.program.schedule.chunks(s))
             for s in range(cfg.parallel.pp)]
    return [whole[r // dp] // (1 if RULES[cfg.parallel.zero].updates_whole else dp) for r in range(len(whole) * dp)]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_offload_moves_adamw_from_the_device_to_the_host(zero):
    """--offload optimizer takes AdamW's two fp32 moments (8 B an updated element) off each rank's
    device peak, nothing else, and keeps 16 B an updated element on the host (master, moments,
    gradient staging); ZeRO-0 updates whole padded buckets, ZeRO-1 to 3 a shard of each."""
    kw = layout(**{"parallel.pp": 2, "parallel.dp": 2, "parallel.zero": zero, "parallel.microbatches": 4})
    plain, off = offloaded(kw, False), offloaded(kw, True)
    updated = updated_elements(kw)
    assert len(set(updated)) > 1  # the stages differ: each rank's own buckets are counted
    for p, o, n in zip(plain, off, updated):
        assert p.host_peak_bytes == 0 and p.categories["optimizer"] >= 8 * n
        assert p.peak_bytes - o.peak_bytes == 8 * n
        assert o.host_categories == {"host_master": 4 * n, "host_optimizer": 8 * n, "host_grads": 4 * n}
        assert o.host_peak_bytes == 16 * n
        assert o.at == p.at  # a constant taken off: the peak is where it was, the rest unchanged
        assert {c: b for c, b in o.categories.items() if c != "optimizer"} == \
            {c: b for c, b in p.categories.items() if c != "optimizer"}


def test_every_category_says_where_it_lives():
    from pipezero.memory.model import CATEGORIES, HOST_CATEGORIES, WHERE

    assert set(WHERE) == set(CATEGORIES) | set(HOST_CATEGORIES)
    assert {WHERE[c] for c in CATEGORIES} == {"device"} and {WHERE[c] for c in HOST_CATEGORIES} == {"host"}


def test_simulate_memory_json_keeps_the_device_peak_and_adds_the_host(capsys):
    argv = ["simulate", "--memory", "--json", "--preset", "tiny", "--dp", "2", "--zero", "1", "--seq-len", "16"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--offload", "optimizer"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert off["layout"]["offload"] == "optimizer" and plain["layout"]["offload"] == "none"
    for p, o in zip(plain["ranks"], off["ranks"]):
        assert p["host_peak_bytes"] == 0
        assert o["peak_bytes"] == sum(o["categories"].values()) < p["peak_bytes"]
        assert o["host_peak_bytes"] == sum(o["host_categories"].values()) == 2 * (p["peak_bytes"] - o["peak_bytes"])
    assert main(argv[:2] + argv[3:] + ["--offload", "optimizer"]) == 0  # the table
    table = capsys.readouterr().out
    assert "offload optimizer" in table
    for o in off["ranks"]:  # each rank's device and host peaks, in MiB
        assert f"{o['peak_bytes'] / 2**20:,.1f}" in table and f"{o['host_peak_bytes'] / 2**20:,.1f}" in table


def test_offload_applies_with_memory_or_the_lowered_program(capsys):
    assert_one_line(*run_main(["simulate", "--offload", "optimizer"], capsys),
                    "--offload applies with --zero (the lowered program's ZeRO traffic)")
    from pipezero.cli import main

    assert main(["simulate", "--zero", "2", "--dp", "2", "--offload", "optimizer", "--offload-activations", "2",
                 "--listing"]) == 0
    listing = capsys.readouterr().out
    assert "OFFLOAD_GRAD(" in listing and "HOST_STEP(" in listing and "RELOAD_ACT(" in listing


def test_the_fit_check_counts_device_bytes_only():
    """A layout whose device peak fits only once AdamW's moments are on the host passes the fit check
    offloaded (its host bytes are the host check's) and is refused as it is."""
    from pipezero.schedules.limits import FIT_MARGIN

    kw = layout(**{"model.preset": "tiny", "data.seq_len": 16, "parallel.dp": 2, "parallel.zero": 0})
    plain, off = offloaded(kw, False), offloaded(kw, True)
    limit = max(r.peak_bytes for r in off) / (1 - FIT_MARGIN) / 2**30 * 1.001
    assert max(r.peak_bytes + r.host_peak_bytes for r in off) > limit * (1 - FIT_MARGIN) * 2**30
    cfg = build_config(None, {**kw, "parallel.offload": "optimizer"})
    assert check_fit(cfg, limit, cuda=False) is not None
    with pytest.raises(ConfigError, match="does not fit --gpu-memory"):
        check_fit(build_config(None, kw), limit, cuda=False)


def test_the_host_check_counts_host_bytes_and_a_cpu_ranks_device():
    """train's host check (--host-memory, a node's): GPU ranks' offloaded buffers; CPU ranks' whole
    peak besides, their device being the host; GPU ranks without offload hold nothing counted."""
    from pipezero.cli.train import check_host_memory

    kw = layout(**{"model.preset": "tiny", "data.seq_len": 16, "parallel.dp": 2, "parallel.zero": 1})
    host = sum(r.host_peak_bytes for r in offloaded(kw, True)) / 2**30
    device = sum(r.peak_bytes for r in offloaded(kw, True)) / 2**30

    def cfg(gib: float, offload: bool = True):
        return build_config(None, {**kw, "run.host_memory_gib": str(gib),
                                   "parallel.offload": "optimizer" if offload else "none"})

    check_host_memory(cfg(host * 1.01), cuda=True)
    with pytest.raises(ConfigError, match=r"\(2 GPU ranks' host buffers of --offload optimizer: fp32 masters, AdamW "
                                          r"moments, gradient staging\), more than --host-memory"):
        check_host_memory(cfg(host * 0.99), cuda=True)
    check_host_memory(cfg(host * 0.01, offload=False), cuda=True)
    check_host_memory(cfg((host + device) * 1.01), cuda=False)
    with pytest.raises(ConfigError, match="2 CPU ranks' predicted peaks: weights, gradients, AdamW state, "
                                          "activations; and their host buffers"):
        check_host_memory(cfg((host + device) * 0.99), cuda=False)


def test_train_refuses_a_run_past_host_memory_before_it_starts(tmp_path, capsys):
    code, err = run_main(["train", "--preset", "tiny", "--seq-len", "16", "--max-steps", "1", "--device", "cpu",
                          "--host-memory", "0.001", "--out", str(tmp_path / "o")], capsys)
    assert_one_line(code, err, "more than --host-memory 0.001 GiB: a smaller --preset or --model")
    assert "the run needs about 0.0 GiB" not in err  # a need below a GiB is said in its own digits
    assert not (tmp_path / "o").exists()
