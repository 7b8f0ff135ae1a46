"""Blockwise quantization of flat fp32 tensors for the wire (ZeRO++'s qwZ and qgZ): pure torch, no
process group, so every rule here is tested in one process.

A tensor is cut into blocks of `block` elements (the last padded with zeros). Each block keeps one
fp32 scale s = absmax / L, where L = 127 for int8 and 7 for int4, and each element becomes the
integer q = round(x / s) in [-L, L] (symmetric: zero is exact, no offset to send). int4 codes are
stored two to a byte (low nibble first, as q + 8 in 0..15).

Error bound, element by element, for a block whose largest magnitude is `absmax`:

    |x - dequantize(quantize(x))| <= s / 2 + 2^-22 * absmax,   s = absmax / L

(s / 2 from rounding to the nearest integer; the second term is fp32's rounding of x / s and q * s,
a few ulps of absmax). So int8 keeps every element within absmax / 254 of its value (0.39% of the
block's largest), int4 within absmax / 14 (7.1%). An all-zero block has s = 0 and comes back exactly
zero; a block whose absmax is below TINY (2^-100) is sent as zeros, an error below TINY. One huge
value spends the block's whole range: its neighbours (within the bound, measured against it) mostly
round to zero, which is why blocks are small; other blocks are untouched.

Non-finite input is refused with an error naming what was being sent (a bucket of weights), since a
NaN scale would silently poison the whole block. Gradients may pass `nonfinite_ok`: a block holding
NaN or inf then decodes as NaN, so the step's norm is non-finite and the step is skipped by the same
rule as without quantization (nonfinite.py) rather than one rank stopping while its peers wait.

The wire form of a tensor is one uint8 message: the codes, then the scales' bytes, so one collective
moves both. `message_bytes` is its size, the formula that byte counts and the traffic model use.
"""

from __future__ import annotations

import enum

import torch

from pipezero.schedules.wire import WireFormat

TINY = 2.0 ** -100  # blocks with a smaller absmax are sent as zeros (their scale would be subnormal)


class Bits(enum.IntEnum):
    INT4 = 4
    INT8 = 8

    @property
    def levels(self) -> int:
        """L: codes run from -L to L."""
        return 2 ** (int(self) - 1) - 1


def blocks_of(numel: int, block: int) -> int:
    return -(-numel // block)


def code_bytes(numel: int, bits: Bits, block: int) -> int:
    """Bytes of the codes of `numel` elements padded to whole blocks (int4: two a byte, rounded up)."""
    return WireFormat(f"int{int(bits)}", block).code_bytes(numel)


def message_bytes(numel: int, bits: Bits, block: int) -> int:
    """Bytes on the wire for `numel` elements: codes plus one fp32 scale a block (the program prices
    the same: schedules/wire.py)."""
    return WireFormat(f"int{int(bits)}", block).bytes(numel)


def quantize(x: torch.Tensor, bits: Bits, block: int, what: str = "tensor",
             nonfinite_ok: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 (blocks, block), scales fp32 (blocks,)) of the flat tensor `x`; `what` names it in
    the error for non-finite input (see the module docstring for `nonfinite_ok`)."""
    x = x.reshape(-1).float()
    n = x.numel()
    nb = blocks_of(n, block)
    if nb * block != n:
        x = torch.cat([x, x.new_zeros(nb * block - n)])
    xb = x.view(nb, block)
    absmax = xb.abs().amax(dim=1)
    finite = torch.isfinite(absmax)
    if not nonfinite_ok and not bool(finite.all()):
        bad = int((~finite).nonzero()[0, 0])
        raise ValueError(f"{what}: non-finite values (NaN or inf) in elements {bad * block}-{(bad + 1) * block - 1}; "
                         f"blockwise quantization cannot send them")
    levels = bits.levels
    live = absmax >= TINY
    scale = torch.where(live, absmax / levels, torch.zeros_like(absmax))
    inv = torch.where(live, 1.0 / torch.where(live, scale, torch.ones_like(scale)), torch.zeros_like(scale))
    q = torch.round(xb * inv[:, None]).clamp_(-levels, levels)
    if nonfinite_ok:  # a block with NaN or inf: NaN scale, so it decodes as NaN
        q = torch.nan_to_num(q, nan=0.0, posinf=0.0, neginf=0.0)
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    return q.to(torch.int8), scale


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values (numel,) that `quantize`'s codes and scales stand for."""
    return (codes.float() * scales[:, None]).reshape(-1)[:numel]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes (-7..7, any shape) as uint8, two a byte, low nibble first; an odd count padded."""
    u = (codes.reshape(-1).to(torch.int16) + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_full((1,), 8)])  # code 0
    u = u.view(-1, 2)
    return u[:, 0] | (u[:, 1] << 4)


def unpack_int4(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` int8 codes that `pack_int4` packed."""
    lo, hi = packed & 0x0F, packed >> 4
    both = torch.stack([lo, hi], dim=1).reshape(-1)[:count]
    return both.to(torch.int16).sub_(8).to(torch.int8)


def encode(x: torch.Tensor, bits: Bits, block: int, what: str = "tensor", nonfinite_ok: bool = False) -> torch.Tensor:
    """`x` as one uint8 message of `message_bytes(x.numel(), bits, block)` bytes: codes, then scales."""
    codes, scales = quantize(x, bits, block, what, nonfinite_ok)
    body = codes.reshape(-1).view(torch.uint8) if bits is Bits.INT8 else pack_int4(codes)
    return torch.cat([body, scales.view(torch.uint8)])


def decode(msg: torch.Tensor, numel: int, bits: Bits, block: int) -> torch.Tensor:
    """The fp32 values (numel,) of a message `encode` made."""
    nb, cb = blocks_of(numel, block), code_bytes(numel, bits, block)
    if msg.numel() != cb + 4 * nb:
        raise ValueError(f"decode: a message of {msg.numel()} bytes, expected {cb + 4 * nb} for {numel} elements "
                         f"(int{int(bits)}, blocks of {block})")
    body = msg[:cb]
    codes = body.view(torch.int8) if bits is Bits.INT8 else unpack_int4(body, nb * block)
    scales = msg[cb:].clone().view(torch.float32)  # a copy: the scales' bytes need not be 4-aligned
    return dequantize(codes.view(nb, block), scales, numel)


def decode_many(msgs: torch.Tensor, parts: int, numel: int, bits: Bits, block: int) -> torch.Tensor:
    """`parts` messages laid end to end (what an all-gather or all-to-all of messages receives) as
    fp32 (parts, numel)."""
    per = message_bytes(numel, bits, block)
    return torch.stack([decode(m, numel, bits, block) for m in msgs.view(parts, per)])
