"""How a layout's collectives travel: each kind of traffic as a float type or as blockwise-quantized
codes, and the bytes a bucket of it puts on the wire. No torch.

The program names each collective's format and prices it in these bytes, and the runtime records the
format and bytes it sent (zero/coordinator.py): the record of a run is held to both, so a runtime that
sent bf16 where the program says fp32, or quantized what the program does not, departs from it. A
quantized message is the codes of its elements, padded to whole blocks (int4: two codes a byte), then
one fp32 scale a block (zero/quantize.py encodes exactly this).
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT_BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}
CODE_BITS = {"int8": 8, "int4": 4}
SCALE_BYTES = 4  # one fp32 scale a block of a quantized message


@dataclass(frozen=True)
class WireFormat:
    """One kind of traffic: `name` fp32, bf16 or fp64 (a float type), int8 or int4 (quantized codes,
    one fp32 scale a `block` elements)."""

    name: str
    block: int = 0

    def __post_init__(self) -> None:
        if self.name not in FLOAT_BYTES and self.name not in CODE_BITS:
            raise ValueError(f"wire format {self.name!r}: one of {', '.join([*FLOAT_BYTES, *CODE_BITS])}")
        if self.name in CODE_BITS and self.block < 1:
            raise ValueError(f"{self.name} needs a block of at least one element, got {self.block}")

    @property
    def quantized(self) -> bool:
        return self.name in CODE_BITS

    def bytes(self, numel: int) -> int:
        """Bytes of `numel` elements as one message on the wire."""
        if not self.quantized:
            return numel * FLOAT_BYTES[self.name]
        return self.code_bytes(numel) + SCALE_BYTES * -(-numel // self.block)

    def code_bytes(self, numel: int) -> int:
        """A quantized message's codes: `numel` padded to whole blocks (int4: two a byte, rounded up)."""
        padded = -(-numel // self.block) * self.block
        return padded if CODE_BITS[self.name] == 8 else -(-padded // 2)


FP32 = WireFormat("fp32")
BF16 = WireFormat("bf16")
FP64 = WireFormat("fp64")


@dataclass(frozen=True)
class Wires:
    """A layout's formats: gradient reductions (`grads`), ZeRO-3's gathers of weights (`gathers`),
    ZeRO-1/2's gathers of updated fp32 masters after the step (`updates`)."""

    grads: WireFormat = FP32
    gathers: WireFormat = FP32
    updates: WireFormat = FP32

    @classmethod
    def of(cls, bf16: bool, grads: str = "none", weights: str = "none", block: int = 0) -> Wires:
        """A run's formats: its communication type (`bf16`, else fp32) unless quantized (`grads`,
        `weights`: --quantize-grads and --quantize-weights, int8, int4 or none; one fp32 scale a
        `block` elements). The masters gathered after the step are fp32 unless quantized."""
        plain = BF16 if bf16 else FP32
        g = WireFormat(grads, block) if grads in CODE_BITS else plain
        w = WireFormat(weights, block) if weights in CODE_BITS else None
        return cls(g, w or plain, w or FP32)
