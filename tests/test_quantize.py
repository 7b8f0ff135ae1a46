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
