"""The records of a `.json` file holding one JSON array, decoded one at a time.

`json.loads` of the whole file held the file's bytes, its text and every record at once (several
times the file), so a large array could exhaust memory before the first record was tokenized.
Here the file is read in blocks and each element decoded as soon as it is whole: memory follows
the largest element, not the file. An element longer than the caller's limit is read past without
being decoded (a scan for its closing bracket), as is one that Python's decoder refuses (nested
deeper than its recursion limit, an integer of more than 4,300 digits), so one bad record costs
neither memory nor the rest of the file.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

BLOCK = 1 << 20  # characters read at a time
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()
_OUTSIDE = re.compile(r'["\[\]{}]')  # what changes the nesting outside a string
_INSIDE = re.compile(r'["\\]')  # what ends a string or escapes its next character
_SCALAR_END = re.compile(r"[,\]\s]")


class ArrayError(ValueError):
    """The file is not one JSON array: `line` (1-based) and what was wrong there."""

    def __init__(self, line: int, msg: str) -> None:
        super().__init__(f"line {line}: {msg}")
        self.line, self.msg = line, msg


@dataclass(frozen=True)
class Skipped:
    """An element read past undecoded: why (`chars` long in the file's text)."""

    reason: str
    chars: int


class _Text:
    """The file's text as a window over a growing buffer: characters before `pos` are consumed and
    dropped from time to time (their newlines counted, for error lines)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.buf, self.pos, self.eof = f, "", 0, False
        self.dropped = 0  # characters dropped before buf
        self.lines = 0  # newlines among them
        self.bytes_read = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")

    def fill(self, at_least: int = BLOCK) -> None:
        """Append at least `at_least` more characters (fewer at the end of the file)."""
        data = self.f.read(max(at_least, BLOCK))
        try:
            text = self.decoder.decode(data, final=not data)
        except UnicodeDecodeError as e:
            raise ArrayError(self.line_of(len(self.buf)), f"invalid UTF-8 near byte {self.bytes_read + e.start}") from None
        if not self.bytes_read:
            text = text.removeprefix("\ufeff")  # a byte-order mark before the array
        self.bytes_read += len(data)
        self.buf += text
        self.eof = not data

    def trim(self) -> None:
        """Drop what is consumed once it is a block or more (a slice a record would cost O(n^2))."""
        if self.pos >= BLOCK:
            self.lines += self.buf.count("\n", 0, self.pos)
            self.dropped += self.pos
            self.buf, self.pos = self.buf[self.pos:], 0

    def line_of(self, i: int) -> int:
        return self.lines + self.buf.count("\n", 0, i) + 1

    def peek(self) -> str:
        """The next character that is not whitespace, consumed up to it; "" at the end of the file."""
        while True:
            self.pos = _WHITESPACE.match(self.buf, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if self.eof:
                return ""
            self.trim()
            self.fill()

    def at(self) -> int:
        """The absolute character offset of `pos`."""
        return self.dropped + self.pos


def records(f: BinaryIO, limit: int) -> Iterator[tuple[object, int]]:
    """Each element of the JSON array in `f` as (its value, or Skipped; bytes of `f` read so far).
    An element still incomplete after `limit` characters is skipped undecoded (one shorter is
    decoded, and its size is the caller's to judge). Raises ArrayError where the text is not one
    JSON array."""
    t = _Text(f)
    if t.peek() != "[":
        raise ArrayError(t.line_of(t.pos), "expected '[' (one array of records)")
    t.pos += 1
    if t.peek() == "]":
        t.pos += 1
    else:
        while True:
            yield _element(t, limit), t.bytes_read
            t.trim()
            c = t.peek()
            if c == "]":
                t.pos += 1
                break
            if c != ",":
                raise ArrayError(t.line_of(t.pos), "expected ',' or ']' after a record" if c else
                                 "the file ends inside the array (no closing ']')")
            t.pos += 1
    if t.peek():
        raise ArrayError(t.line_of(t.pos), "extra data after the array")


def _element(t: _Text, limit: int) -> object:
    """Decode the element at `pos`, reading more of the file while it is cut off at the buffer's end."""
    if not t.peek():
        raise ArrayError(t.line_of(t.pos), "the file ends inside the array (no closing ']')")
    want = BLOCK
    while True:
        try:
            value, end = _DECODER.raw_decode(t.buf, t.pos)
            if end < len(t.buf) or t.eof:  # ends before the buffer does: a number cannot continue
                t.pos = end
                return value
        except json.JSONDecodeError as e:
            if t.eof:
                raise ArrayError(t.line_of(e.pos), e.msg) from None
        except RecursionError:
            return Skipped("a record nested deeper than the JSON reader follows", _skip(t))
        except ValueError as e:  # an integer too long to convert, said by int()
            return Skipped(f"a record the JSON reader refuses ({str(e).split(';')[0]})", _skip(t))
        if len(t.buf) - t.pos > limit:
            return Skipped("over the limit", _skip(t))
        t.fill(want)  # doubling: a record of n characters is decoded O(log n) times, O(n) in all
        want *= 2


def _skip(t: _Text) -> int:
    """Read past the element at `pos` without decoding it; the characters it spans."""
    start = t.at()
    if t.buf[t.pos] not in '[{"':  # a number or a literal: up to the next ',', ']' or space
        while not (m := _SCALAR_END.search(t.buf, t.pos)) and not t.eof:
            t.pos = len(t.buf)
            t.trim()
            t.fill()
        t.pos = m.start() if m else len(t.buf)
        return t.at() - start
    depth, in_string = 0, False
    while True:
        m = (_INSIDE if in_string else _OUTSIDE).search(t.buf, t.pos)
        if m is None:
            if t.eof:
                raise ArrayError(t.line_of(len(t.buf)), "the file ends inside a record")
            t.pos = len(t.buf)
            t.trim()
            t.fill()
            continue
        ch, t.pos = m.group(), m.end()
        if ch == "\\":
            if t.pos >= len(t.buf) and not t.eof:
                t.fill()
            t.pos += 1  # the escaped character, whatever it is
        elif ch == '"':
            in_string = not in_string
            if not in_string and depth == 0:
                return t.at() - start
        elif ch in "[{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return t.at() - start
