"""Values from a TOML file or the command line, turned into a dataclass field's declared type.

One function does it for every setting, so a value is accepted or refused the same way whatever
its source. TOML values must already have the field's type (`pp = "2"` is refused: TOML can say
`pp = 2`); command-line values arrive as text and are parsed. Nothing is guessed: `"false"` is
not a bool, `2.5` and `64.0` are not integers. A refusal is one `ConfigError` naming the setting
and what it accepts.
"""

from __future__ import annotations

import enum
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from pipezero.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The accepted values of a numeric setting; bounds are inclusive unless marked open."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False

    def __contains__(self, v: float) -> bool:
        if self.low is not None and (v < self.low or (self.open_low and v == self.low)):
            return False
        return not (self.high is not None and (v > self.high or (self.open_high and v == self.high)))

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.open_low else '>='} {_bound(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.open_high else '<='} {_bound(self.high)}")
        return " and ".join(parts)


def _bound(x: float) -> str:
    """A bound as the user would type it: whole numbers below 1e7 in full (1048576, not 1.04858e+06)."""
    if isinstance(x, int) and not isinstance(x, bool):  # an integer bound, exact: 2^64 - 1 is not 1.84467e+19
        return str(x)
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e7 else f"{x:g}"


def _plain(ftype: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); any other type -> (type, False). A union with literal words (`int |
    Literal["auto"]`) is its first other type here; `_words` names the words."""
    if isinstance(ftype, types.UnionType) or typing.get_origin(ftype) is typing.Union:
        args = [a for a in typing.get_args(ftype) if a is not type(None) and typing.get_origin(a) is not typing.Literal]
        return args[0], type(None) in typing.get_args(ftype)
    return ftype, False


def _words(ftype: Any) -> tuple[str, ...]:
    """The literal words a union field accepts besides its type (`int | Literal["auto"]`: auto)."""
    if isinstance(ftype, types.UnionType) or typing.get_origin(ftype) is typing.Union:
        return tuple(w for a in typing.get_args(ftype) if typing.get_origin(a) is typing.Literal
                     for w in typing.get_args(a))
    return ()


def describe(ftype: Any, limits: Range | None = None) -> str:
    """What a field accepts, in the words an error message uses."""
    base, _ = _plain(ftype)
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return "one of " + ", ".join(str(e.value) for e in base)
    if typing.get_origin(base) is list:
        item = typing.get_args(base)[0]
        items = f"a list of {'integers' if item is int else 'numbers' if item is float else 'strings'}"
        return f"{items}, each {limits.describe()}" if limits else items  # not "a list of integers" for 5,-1
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[base]
    said = f"{words} {limits.describe()}" if limits else words
    return ", or ".join([said, *_words(ftype)])


def choices(ftype: Any) -> list[str] | None:
    """The values of an enum-typed field, for help texts; None for other types."""
    base, _ = _plain(ftype)
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return [str(e.value) for e in base]
    return None


def _parse_text(base: Any, text: str) -> Any:
    """A command-line string as `base`, or the text unchanged when it does not parse (refused later)."""
    try:
        if base is int:
            return int(text.strip(), 10)
        if base is float:
            return float(text)
        if typing.get_origin(base) is list and typing.get_args(base)[0] is int:
            return [int(x, 10) for x in text.split(",")]
    except ValueError:
        pass
    return text


def _typed(base: Any, value: Any) -> bool:
    if base is bool:
        return isinstance(value, bool)
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if typing.get_origin(base) is list:
        return isinstance(value, list) and all(_typed(typing.get_args(base)[0], x) for x in value)
    return isinstance(value, base)


def shown(value: Any) -> str:
    """A value the way the user wrote it in TOML (strings quoted, booleans lower case)."""
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def coerce(name: str, ftype: Any, value: Any, from_text: bool, limits: Range | None = None) -> Any:
    """`value` as a field of type `ftype`, or a ConfigError naming `name` and what it accepts.
    `from_text`: the value comes from the command line, where everything is a string."""
    base, optional = _plain(ftype)
    raw = value
    if value is None and optional:
        return None
    if isinstance(value, str) and value in _words(ftype):
        return value
    if isinstance(base, type) and issubclass(base, enum.Enum):
        if isinstance(value, base):
            return value
        if isinstance(value, str) and value in {e.value for e in base}:
            return base(value)
    else:
        if from_text and isinstance(value, str):
            value = _parse_text(base, value)
        if typing.get_origin(base) is list and typing.get_args(base)[0] is str and isinstance(value, str):
            value = [value]  # one path where a list of them is accepted
        if _typed(base, value):
            value = float(value) if base is float else value
            bad = [v for v in (value if isinstance(value, list) else [value])
                   if limits is not None and not isinstance(v, str) and v not in limits]
            if not bad:
                return value
    said = f"{name} {raw}" if from_text and isinstance(raw, str) else f"{name} = {shown(raw)}"
    expected = describe(ftype, limits)
    if base is float and isinstance(value, float) and not math.isfinite(value):  # inf is > 0: say what it is not
        expected = expected.replace("a number", "a finite number", 1)
    raise ConfigError(f"{said}: expected {expected}")
