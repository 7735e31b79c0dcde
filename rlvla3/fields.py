"""Field specs for the wire: what each header field may hold, checked before anything reads it.

A peer is untrusted: a field can arrive as a list where an int belongs, as ``true`` (bool is a
subclass of int in Python), as ``1e400`` (msgpack turns it into inf) or as 2^64. Every int goes
through :func:`checked_int`, every float through :func:`checked_num`; free-form maps (config,
STATUS figures, trainer stats) are bounded in depth and size. A failed check raises
``ProtocolError(E_FIELD)``, which the receiver answers with ERROR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

MAX_ID = 2**53
"""Ids, counters and versions stay exactly representable as a double (JSON, JavaScript)."""
MAX_COUNT = 2**16
"""Slots, envs per request, credits, list lengths in one message."""
MAX_STEPS = 2**32
"""Env steps or trajectory steps reported in one message."""
MAX_TEXT = 4096
MAX_FREE_DEPTH = 8
MAX_FREE_NODES = 100_000


class FieldError(ValueError):
    """A field that fails its spec (protocol.decode turns it into ProtocolError(E_FIELD))."""


def _expect_type(value: Any, types: tuple[type, ...], noun: str, what: str) -> None:
    """``value``'s exact type must be one of ``types``: a subclass does not pass (a bool is not
    an int). ``noun`` names the types in the error."""
    if type(value) not in types:
        raise FieldError(f"{what} must be {noun}, not {type(value).__name__}")


def checked_int(value: Any, lo: int, hi: int, what: str) -> int:
    """``value`` if it is a true int (not a bool, not a float) with lo <= value <= hi."""
    _expect_type(value, (int,), "an integer", what)
    if not lo <= value <= hi:
        raise FieldError(f"{what}={value} outside [{lo}, {hi}]")
    return value


def checked_num(value: Any, lo: float, hi: float, what: str) -> float:
    """A finite int or float (not a bool) with lo <= value <= hi."""
    _expect_type(value, (int, float), "a number", what)
    if isinstance(value, float) and not math.isfinite(value):
        raise FieldError(f"{what} is {value} (not finite)")
    if not lo <= value <= hi:
        raise FieldError(f"{what}={value} outside [{lo}, {hi}]")
    return value


# ---------------------------------------------------------------------------------------------
# Specs: each has check(value, what) that raises FieldError
#
# These run on every message the broker reads, so the valid path is kept cheap: exact type
# tests inline, and a container's item names (``what[3]``, ``what.key``) are only formatted when
# an item fails (the failing item is checked again under its own name, which gives the same
# error: checks are pure).
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int:
    lo: int = 0
    hi: int = MAX_ID
    nullable: bool = False

    def check(self, value: Any, what: str) -> None:
        if type(value) is int and self.lo <= value <= self.hi:
            return
        if value is None and self.nullable:
            return
        checked_int(value, self.lo, self.hi, what)


@dataclass(frozen=True)
class Num:
    lo: float = -1e300
    hi: float = 1e300

    def check(self, value: Any, what: str) -> None:
        checked_num(value, self.lo, self.hi, what)


@dataclass(frozen=True)
class Str:
    max_len: int = MAX_TEXT
    choices: tuple[str, ...] = ()
    nullable: bool = False

    def check(self, value: Any, what: str) -> None:
        if type(value) is str and len(value) <= self.max_len and (not self.choices or value in self.choices):
            return
        if value is None and self.nullable:
            return
        _expect_type(value, (str,), "a string", what)
        if len(value) > self.max_len:
            raise FieldError(f"{what} is {len(value)} characters long (at most {self.max_len})")
        raise FieldError(f"{what}={value!r} is not one of {self.choices}")


@dataclass(frozen=True)
class Bool:
    def check(self, value: Any, what: str) -> None:
        _expect_type(value, (bool,), "true or false", what)


@dataclass(frozen=True)
class List:
    item: Any
    max_len: int = MAX_COUNT

    def check(self, value: Any, what: str) -> None:
        _expect_type(value, (list, tuple), "a list", what)
        if len(value) > self.max_len:
            raise FieldError(f"{what} has {len(value)} items (at most {self.max_len})")
        item = self.item
        if type(item) is Int and not item.nullable:  # lists of ids and steps: one loop, no calls
            lo, hi = item.lo, item.hi
            for v in value:
                if type(v) is not int or not lo <= v <= hi:
                    break
            else:
                return
        else:
            try:
                for v in value:
                    item.check(v, what)
                return
            except FieldError:
                pass
        for i, v in enumerate(value):  # an item failed: find it, and name it
            item.check(v, f"{what}[{i}]")


@dataclass(frozen=True)
class Map:
    """A map with known keys (each checked when present) and, unless ``closed``, other keys
    checked as free-form data."""

    fields: tuple[tuple[str, Any], ...] = ()
    required: tuple[str, ...] = ()
    closed: bool = False
    finite: bool = True
    nullable: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "_known", dict(self.fields))  # looked up per key, built once

    def check(self, value: Any, what: str) -> None:
        if value is None and self.nullable:
            return
        _expect_type(value, (dict,), "a map", what)
        for key in self.required:
            if key not in value:
                raise FieldError(f"{what} lacks {key!r}")
        known = self._known
        budget = [MAX_FREE_NODES]
        for key, v in value.items():
            if type(key) is not str:
                raise FieldError(f"{what} has a key of type {type(key).__name__}")
            spec = known.get(key)
            if spec is not None:
                try:
                    spec.check(v, what)
                except FieldError:
                    spec.check(v, f"{what}.{key}")  # the same failure, named
            elif self.closed:
                raise FieldError(f"{what} has an unexpected key {key[:64]!r}")
            else:
                _free(v, f"{what}.{key[:64]}", 1, budget, self.finite)


@dataclass(frozen=True)
class Free:
    """Any msgpack data bounded in depth and size (optionally: no inf or NaN)."""

    finite: bool = True

    def check(self, value: Any, what: str) -> None:
        _free(value, what, 0, [MAX_FREE_NODES], self.finite)


def _free(value: Any, what: str, depth: int, budget: list[int], finite: bool) -> None:
    budget[0] -= 1
    if budget[0] < 0:
        raise FieldError(f"{what}: more than {MAX_FREE_NODES} values")
    if depth > MAX_FREE_DEPTH:
        raise FieldError(f"{what}: nested deeper than {MAX_FREE_DEPTH}")
    t = type(value)
    if t is float:
        if finite and not math.isfinite(value):
            raise FieldError(f"{what} is {value} (not finite)")
    elif t is int:
        if not -(2**63) <= value < 2**64:
            raise FieldError(f"{what} is an integer out of 64-bit range")
    elif t is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise FieldError(f"{what} has a key of type {type(k).__name__}")
            _free(v, f"{what}.{k[:64]}", depth + 1, budget, finite)
    elif t in (list, tuple):
        for i, v in enumerate(value):
            _free(v, f"{what}[{i}]", depth + 1, budget, finite)
    elif t not in (str, bytes, bool, type(None)):
        raise FieldError(f"{what} has type {t.__name__}")


# ---------------------------------------------------------------------------------------------
# One compiled check per message type
#
# Calling each spec's ``check`` costs a Python call per field, and per item of a list; the
# broker does it for every OBS. ``compile_check`` turns a message type's specs into one
# function of inline tests that only says whether a header passes. It is the first pass:
# True means every spec passes; False (also for any field it does not know, which the specs
# may still accept as free data) sends the header through the specs themselves, which name
# what fails. Specs it cannot inline (maps, free data) are called.
# ---------------------------------------------------------------------------------------------


def _passes(spec: Any, value: Any) -> bool:
    try:
        spec.check(value, "")
        return True
    except FieldError:
        return False


def _test(spec: Any, v: str, env: dict[str, Any]) -> str:
    """A Python expression over the variable ``v``: true iff ``spec.check`` passes on it."""
    name = f"_s{len(env)}"
    env[name] = spec
    t = type(spec)
    if t is Int:
        test = f"(type({v}) is int and {spec.lo} <= {v} <= {spec.hi})"
    elif t is Num:
        test = f"((type({v}) is int or (type({v}) is float and _isfinite({v}))) and {spec.lo!r} <= {v} <= {spec.hi!r})"
    elif t is Str:
        choices = f" and {v} in {name}.choices" if spec.choices else ""
        test = f"(type({v}) is str and len({v}) <= {spec.max_len}{choices})"
    elif t is Bool:
        test = f"(type({v}) is bool)"
    elif t is List:  # a loop of its own: all() over a generator costs more than the items
        src = f"def {name}_items(v):\n    for x in v:\n        if not {_test(spec.item, 'x', env)}:\n" \
              "            return False\n    return True"
        exec(src, env)  # noqa: S102 - built from specs, never from input
        test = f"(type({v}) in (list, tuple) and len({v}) <= {spec.max_len} and {name}_items({v}))"
    else:
        return f"_passes({name}, {v})"
    return f"({test} or {v} is None)" if getattr(spec, "nullable", False) else test


def compile_check(required: dict[str, Any], optional: dict[str, Any], also: tuple[str, ...]) -> Callable[[dict], bool]:
    """One function ``header -> bool`` for a message type's ``required`` and ``optional`` specs;
    ``also``: keys the codec reads itself (version, type, tensors)."""
    env: dict[str, Any] = {"_passes": _passes, "_isfinite": math.isfinite, "_missing": object(),
                           "_known": frozenset((*required, *optional, *also))}
    lines = ["def check(h):", "    if not _known.issuperset(h):", "        return False"]
    for name, spec in required.items():
        lines += [f"    v = h.get({name!r}, _missing)", f"    if not {_test(spec, 'v', env)}:", "        return False"]
    for name, spec in optional.items():
        lines += [f"    v = h.get({name!r}, _missing)", f"    if v is not _missing and not {_test(spec, 'v', env)}:",
                  "        return False"]
    lines.append("    return True")
    exec("\n".join(lines), env)  # noqa: S102 - the source is built above from specs, never from input
    return env["check"]
