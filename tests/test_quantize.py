"""Blockwise quantization (zero/quantize.py) within its stated bound on random and adversarial
blocks, int4 packing exact, non-finite input refused; the bytes ZeRO counts for quantized traffic
equal the formula (zero/compressed.py), and bad combinations are refused before any rank starts."""

from __future__ import annotations

import pytest
import torch

from pipezero.zero.quantize import (TINY, Bits, blocks_of, decode, dequantize, encode, message_bytes, pack_int4,
                                    quantize, unpack_int4)


def bound(x: torch.Tensor, bits: Bits, block: int) -> torch.Tensor:
    """The module docstring's bound, element by element: s / 2 + 2^-22 absmax of the element's block."""
    n = x.numel()
    padded = torch.cat([x, x.new_zeros(blocks_of(n, block) * block - n)]).view(-1, block)
    absmax = padded.abs().amax(1, keepdim=True).expand_as(padded).reshape(-1)[:n]
    return absmax / bits.levels / 2 + 2.0 ** -22 * absmax


def roundtrip(x: torch.Tensor, bits: Bits, block: int) -> torch.Tensor:
    return decode(encode(x, bits, block), x.numel(), bits, block)


@pytest.mark.parametrize("bits", list(Bits))
@pytest.mark.parametrize("block", [256, 64, 7])
def test_random_blocks_within_the_bound(bits, block):
    gen = torch.Generator().manual_seed(block + bits)
    for n in (1, block - 1, block, 10 * block + 3):
        for scale in (1e-20, 1e-3, 1.0, 1e30):
            x = torch.randn(n, generator=gen) * scale
            err = (roundtrip(x, bits, block) - x).abs()
            assert bool((err <= bound(x, bits, block)).all()), (n, scale, float((err - bound(x, bits, block)).max()))
            # and not trivially: the error is a sizeable share of the bound somewhere (rounding happens)
            if n >= block:
                assert float((err / bound(x, bits, block)).max()) > 0.3


def test_adversarial_blocks():
    block = 64
    zeros = torch.zeros(3 * block)
    for bits in Bits:
        assert torch.equal(roundtrip(zeros, bits, block), zeros)  # all-zero blocks exact
    # one huge value: its block's others round towards zero, within the bound; other blocks untouched
    x = torch.randn(3 * block, generator=torch.Generator().manual_seed(0))
    x[block + 5] = 3e38
    y = roundtrip(x, Bits.INT8, block)
    assert bool(((y - x).abs() <= bound(x, Bits.INT8, block)).all())
    assert y[block + 5] == pytest.approx(3e38, rel=1e-6)
    assert torch.equal(y[:block], roundtrip(x[:block], Bits.INT8, block))
    # largest magnitude and its negation are exact (they are the scale's +-L)
    x = torch.linspace(-5, 5, block)
    y = roundtrip(x, Bits.INT4, block)
    assert float(y[0]) == pytest.approx(-5, rel=1e-6) and float(y[-1]) == pytest.approx(5, rel=1e-6)
    # below TINY: sent as zeros, an error under TINY
    tiny = torch.full((block,), TINY / 4)
    assert float((roundtrip(tiny, Bits.INT8, block) - tiny).abs().max()) < TINY


def test_nonfinite_refused_naming_the_bucket_or_passed_as_nan():
    x = torch.randn(1000)
    x[700] = float("nan")
    with pytest.raises(ValueError, match=r"parameter bucket 1\.0.*elements 512-767"):
        encode(x, Bits.INT8, 256, "parameter bucket 1.0")
    x[700] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, Bits.INT4, 256, "b")
    # gradients: the bad block decodes as NaN (the step is then skipped), the others as usual
    y = decode(encode(x, Bits.INT8, 256, nonfinite_ok=True), 1000, Bits.INT8, 256)
    assert bool(y[512:768].isnan().all()) and bool(y[:512].isfinite().all()) and bool(y[768:].isfinite().all())


def test_int4_packing_is_exact():
    codes = torch.arange(-7, 8, dtype=torch.int8).repeat(5)  # every code, odd total (75)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 38
    assert torch.equal(unpack_int4(packed, codes.numel()), codes)
    q, s = quantize(torch.randn(300), Bits.INT4, 100)
    assert int(q.abs().max()) <= 7
    assert torch.equal(dequantize(unpack_int4(pack_int4(q), 300).view(3, 100), s, 300), dequantize(q, s, 300))


def test_message_sizes():
    for bits, per in ((Bits.INT8, 1.0), (Bits.INT4, 0.5)):
        for n, block in ((1000, 256), (1024, 256), (5, 3)):
            msg = encode(torch.randn(n), bits, block)
            assert msg.numel() == message_bytes(n, bits, block)
            nb = -(-n // block)
            assert message_bytes(n, bits, block) == int(-(-nb * block * per // 1)) + 4 * nb
    assert message_bytes(256, Bits.INT8, 256) / (256 * 4) == pytest.approx(0.2539, abs=1e-4)
    assert message_bytes(256, Bits.INT4, 256) / (256 * 4) == pytest.approx(0.1289, abs=1e-4)


@pytest.mark.parametrize("argv, needle", [
    (["--dp", "1", "--quantize-grads", "int8"], "--quantize-grads int8 with --dp 1: there is no data-parallel"),
    (["--dp", "2", "--zero", "1", "--quantize-weights", "int4"], "--quantize-weights"),  # int8 only
    (["--dp", "2", "--zero", "0", "--quantize-weights", "int8"], "ZeRO-0 gathers no weights"),
    (["--dp", "2", "--quantize-grads", "int8", "--quant-block", "0"], "--quant-block"),
    (["--dp", "2", "--zero", "3", "--quantize-grads", "int4", "--hierarchical", "--device", "cuda"],
     "--hierarchical is for gloo"),
])
def test_bad_combinations_refused_in_one_line(argv, needle, capsys, tmp_path):
    from one_line import assert_one_line, run_main

    argv = ["train", "--nproc", "2", "--out", str(tmp_path / "run"), *argv]
    assert_one_line(*run_main(argv, capsys), needle)


def test_every_schedule_stage_and_placement_accepts_the_options():
    """Config validation accepts both options on every schedule, ZeRO stage and placement with
    D > 1 (the distributed test trains a sample of them; the collectives are the same calls)."""
    from pipezero.config import Placement, ScheduleKind
    from pipezero.schedules.registry import default_virtual
    from pipezero.settings import build_config

    for kind in ScheduleKind:
        v = default_virtual(kind)
        for zero in range(4):
            for place in Placement:
                cfg = build_config(None, {"parallel.pp": "2", "parallel.dp": "2", "parallel.schedule": kind.value,
                                          "parallel.virtual_stages": str(v), "parallel.microbatches": "4",
                                          "parallel.zero": str(zero), "parallel.placement": place.value,
                                          "parallel.quantize_grads": "int4", "model.n_layers": "6",
                                          **({"parallel.quantize_weights": "int8"} if zero else {})})
                assert cfg.parallel.quantize_grads.value == "int4"


def test_the_traffic_model_prices_the_bytes_sent():
    """plan's model (planner/traffic.py) and simulate's lowered program (cli/simulate_zero.py) count the
    quantized bytes: an element's code and its share of the scale, the exchange one pass."""
    import argparse
    from dataclasses import replace

    from pipezero.config import ScheduleKind
    from pipezero.schedules.check import CostModel
    from pipezero.schedules.registry import build_schedule
    from pipezero.planner.layouts import Cluster, Layout
    from pipezero.cli.simulate_zero import ZeroOptions, lower_zero, run_program
    from pipezero.planner.traffic import dp_traffic, element_bytes

    int8, int4 = element_bytes(8, 256), element_bytes(4, 256)
    assert (int8, int4) == (1 + 4 / 256, 0.5 + 4 / 256)
    cpu = Cluster(4, 8, node_size=2, inter_gbps=0.0125, cpu=True, wire_bytes=4)  # D = 4 over 2 nodes
    # in fp32 buffers crossing the node links (ZeRO-1 reduce-scatters, as ZeRO-2): gloo's ring
    # (all-reduces, quantized gathers) crosses 2 of its 4 hops with 3/4 of the buffer, R = 1.5; a CPU
    # rank's direct exchange (reduce-scatters, unquantized gathers) sends each of the 4 ranks' 2
    # slices for the other node, X = 2
    q4, q8, R, X = int4 / 4, int8 / 4, 1.5, 2.0
    for zero, weights, grads, plain, packed in ((0, 0, 4, 2 * R, (X + R) * q4), (1, 8, 8, 2 * X, (X + R) * q8),
                                                (2, 0, 8, 2 * X, X * q8 + X), (3, 8, 0, 3 * X, 2 * R * q8 + X)):
        lay = Layout(1, 4, zero, ScheduleKind.ONE_F_ONE_B, 1, 4, 2, False)
        if zero == 3:
            lay = replace(lay, microbatches=1)  # layer by layer: a forward and a backward gather (1 each)
        base = dp_traffic(cpu, lay, 1e6, 0.01)[2]
        got = dp_traffic(cpu, replace(lay, weight_bits=weights, grad_bits=grads), 1e6, 0.01)[2]
        assert got / base == pytest.approx(packed / plain), zero
    args = argparse.Namespace(zero=3, dp=2, grad_reduce="step", preset="tiny", bucket_mb=25.0, dp_comm=0.5,
                              zero3_layerwise=False, zero3_prefetch_chunk=False, zero3_prefetch=None, dtype="fp32",
                              optim_cost=0.0,
                              quantize_weights="none", quantize_grads="none", quant_block=256)
    s = build_schedule(ScheduleKind.ONE_F_ONE_B, 2, 4)
    sent = {}
    for w, g in (("none", "none"), ("int8", "int4")):
        args.quantize_weights, args.quantize_grads = w, g
        opt = ZeroOptions.from_args(args)
        sent[w] = sum(run_program(lower_zero(s, opt), CostModel(), opt)[1]["bytes_sent"])
    # ZeRO-3 kept gathered (P = 2): one gather and one reduction a step, each a ring pass
    assert sent["int8"] / sent["none"] == pytest.approx((int8 + int4) / 8, rel=1e-4)


@pytest.mark.parametrize("argv, needle", [
    (["--pp", "2", "--dp", "2", "--zero", "3"], "ZeRO-3 keeps each chunk gathered for its step"),
    (["--dp", "2", "--zero", "2"], "--secondary-shard node with --zero 2: only ZeRO-3 gathers parameters over a "
                                   "group; use --zero 3 or drop it"),
    # at --dp 1 the true fix is replicas, not a ZeRO stage (it said "use --zero 3" at --zero 3 too)
    (["--dp", "1", "--zero", "3"], "--secondary-shard node with --dp 1: it splits each bucket over the data-parallel "
                                   "replicas, and one has nothing to split; raise --dp to 2 or more, or drop it"),
    (["--dp", "1", "--zero", "0"], "--secondary-shard node with --zero 0 --dp 1: only ZeRO-3 with --dp 2 or more"),
])
def test_secondary_shard_refused_where_it_saves_nothing(argv, needle, capsys, tmp_path):
    from one_line import assert_one_line, run_main

    nproc = str(int(argv[argv.index("--dp") + 1]) * (2 if "--pp" in argv else 1))
    argv = ["train", "--nproc", nproc, "--out", str(tmp_path / "run"), "--secondary-shard", "node", *argv]
    assert_one_line(*run_main(argv, capsys), needle)


def test_secondary_shard_needs_two_nodes_of_two_ranks_before_any_group():
    """Checked on each rank from the mesh alone, before a subgroup exists (so no rank hangs)."""
    from pipezero.errors import ConfigError
    from pipezero.parallel.mesh import Mesh
    from pipezero.settings import build_config
    from pipezero.stage import secondary_node

    for per_node, found in ((1, r"\(1, 4\)"), (4, r"on one node \(4 ranks a node\)")):  # one rank a node; one node
        cfg = build_config(None, {"parallel.dp": "4", "parallel.zero": "3", "parallel.secondary_shard": "node",
                                  "parallel.ranks_per_node": str(per_node)})
        with pytest.raises(ConfigError, match=found):
            secondary_node(cfg, Mesh(1, 4))


def test_the_planner_prices_the_secondary_shard():
    """hpZ: ZeRO-3 layer by layer crosses the node links once a step instead of at every gather,
    and holds 4/g bytes a parameter more (g ranks of the group a node)."""
    from dataclasses import replace

    from pipezero.config import ModelConfig, ScheduleKind
    from pipezero.planner.layouts import Cluster, Layout
    from pipezero.planner.search import estimate, with_options
    from pipezero.planner.traffic import dp_traffic

    cpu = Cluster(4, 8, node_size=2, inter_gbps=0.0125, cpu=True, wire_bytes=4)
    lay = Layout(1, 4, 3, ScheduleKind.ONE_F_ONE_B, 1, 4, 2, False)  # M = 2: 4 gathers a step
    hpz = with_options(lay, cpu, 0, 0, 256, True)
    assert hpz.secondary and not with_options(replace(lay, zero=2), cpu, 0, 0, 256, True).secondary
    base, got = dp_traffic(cpu, lay, 1e6, 0.01), dp_traffic(cpu, hpz, 1e6, 0.01)
    # crossing: 4 gathers (1 pass each) and the reduce-scatter (1) -> 1 gather and the reduction
    assert got[2] / base[2] == pytest.approx(2 / 5)
    model = ModelConfig()
    plain, more = estimate(model, 128, 16, cpu, lay), estimate(model, 128, 16, cpu, hpz)
    assert more.model_states_gib > plain.model_states_gib and more.crossing_bytes < plain.crossing_bytes
