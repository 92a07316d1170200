"""Checks of what a public entry point is given: one error, :class:`ArgumentError`, whose message names
the entry point and the parameter, what it got (bounded: an array by its type, never its values) and
what is valid: ``lower: graph must be a Graph or an ImportedGraph, got str 'g.json'; ...``."""

from __future__ import annotations

from typing import Any, Sequence

from .types import AttnpassError, native_dtype_name, short_repr, type_str


class ArgumentError(AttnpassError, TypeError, ValueError):
    """A public entry point got an argument of the wrong type or value (a TypeError and a ValueError too,
    so code that catches what Python or numpy would raise still catches it)."""


def describe(value: object) -> str:
    """What a message says a caller gave: ``'g.json'``, ``3``, ``list ['dce']``, ``numpy.ndarray f32[2,4]``,
    ``a Graph``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return short_repr(value)
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    kind = type(value)
    if shape is not None and dtype is not None:  # an array of any framework: its type, never its values
        owner = kind.__module__.partition(".")[0]
        try:
            return f"{owner}.{kind.__name__} {type_str(tuple(shape), native_dtype_name(dtype))}"
        except (TypeError, ValueError):  # a symbolic shape
            return f"{owner}.{kind.__name__}"
    if isinstance(value, (list, tuple, dict, set, frozenset, bytes)):
        return f"{kind.__name__} {short_repr(value)}"
    article = "an" if kind.__name__[:1].lower() in "aeiou" else "a"
    return f"{article} {kind.__name__}"  # any other object by its type: its repr may be long, or costly


def argument_error(where: str, parameter: str, value: object, valid: str, hint: str = "") -> ArgumentError:
    """``{where}: {parameter} must be {valid}, got {describe(value)}``, then ``; {hint}`` when given."""
    tail = f"; {hint}" if hint else ""
    return ArgumentError(f"{where}: {parameter} must be {valid}, got {describe(value)}{tail}")


def require_int(where: str, parameter: str, value: object, *, minimum: int = 1, meaning: str = "") -> int:
    """``value`` when it is an int (a bool is not) ``>= minimum``, else an ArgumentError naming ``where`` and
    ``parameter``: ``SplitKV: shards must be an int >= 2, got 1``; ``meaning`` goes in parentheses after the bound."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        note = f" ({meaning})" if meaning else ""
        raise argument_error(where, parameter, value, f"an int >= {minimum}{note}")
    return value


def require_bool(where: str, parameter: str, value: object) -> bool:
    """``value`` when it is True or False, else an ArgumentError."""
    if not isinstance(value, bool):
        raise argument_error(where, parameter, value, "True or False")
    return value


def require_choice(where: str, parameter: str, value: Any, choices: Sequence[Any]) -> Any:
    """``value`` when it is one of ``choices``, else an ArgumentError listing them."""
    if isinstance(value, str) and value in choices:
        return value
    listed = ", ".join(map(str, choices))
    raise argument_error(where, parameter, value, f"one of {listed}")


__all__ = ["ArgumentError", "argument_error", "describe", "require_bool", "require_choice", "require_int"]
