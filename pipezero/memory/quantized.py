"""The bytes quantized traffic (--quantize-grads, --quantize-weights: zero/compressed.py) holds on a
rank, beside the buckets themselves, for the memory model (memory/model.py). Torch-free: sizes only.

Every quantized collective sends uint8 messages (schedules/wire.py `WireFormat.bytes`: codes, then
one fp32 scale a block) and decodes what it receives in fp32 when waited for:

- a gradient reduction (qgZ) of an `n`-element bucket over D ranks encodes the D slices into one
  buffer of messages and receives as many, both alive until it is waited for, beside its fp32 output
  shard (ZeRO-1 to 3) or, for ZeRO-0's all-reduce, the fp32 piece its first half sums into;
- its wait decodes the D received messages, each into fp32, then stacks them (the list and the stack
  at once: 2 x n fp32) before summing; ZeRO-0's all-reduce then encodes its summed piece, gathers D
  messages and decodes them the same way, its first half's messages still held;
- a gather of weights (qwZ: ZeRO-3's, and ZeRO-1/2's gathers of updated weights) holds this rank's
  message and the D received until waited for, whose decode is the same 2 x n fp32.

Encoding's own temporaries (a slice's absolute values, its scaled copy: 2 x n / D fp32) come and go
before a collective starts, inside the ones counted here."""

from __future__ import annotations

from pipezero.schedules.wire import WireFormat

F32 = 4


def decoded(n: int) -> int:
    """A wait's decode of an `n`-element bucket's D messages: each decoded, then stacked."""
    return 2 * n * F32


def reduction_flight(w: WireFormat, n: int, dp: int) -> int:
    """A quantized reduction of `n` elements in flight: the D messages sent and the D received, and
    its fp32 output (the shard, or ZeRO-0's piece), n / D elements either way."""
    return 2 * dp * w.bytes(n // dp) + n // dp * F32


def reduction_wait(w: WireFormat, n: int, dp: int, to_shard: bool) -> int:
    """Beyond `reduction_flight`, the most a quantized reduction's wait holds at once: the decode;
    for an all-reduce (ZeRO-0) the decode of its second half, whose own message and the D it
    gathered are alive beside it."""
    return decoded(n) + (0 if to_shard else (dp + 1) * w.bytes(n // dp))


def gather_flight(w: WireFormat, n: int, dp: int) -> int:
    """A quantized gather of an `n`-element bucket in flight: this rank's message and the D received."""
    return (dp + 1) * w.bytes(n // dp)
