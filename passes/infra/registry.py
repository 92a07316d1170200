"""The pass registry: stable names -> pass classes, for textual pipelines and the CLI.

Every pass, built-in or not, joins with the :func:`register_pass` decorator
when its module is imported (the built-in ones are imported by
:mod:`attnpass.passes`; this module imports none of them), or through a
Python entry point in the group ``attnpass.passes``, named after the pass::

    [project.entry-points."attnpass.passes"]
    my-pass = "my_package.passes:MyPass"

Entry points are loaded lazily: :func:`available_passes` lists their names
without importing anything, and :func:`get_pass` loads only the one asked for.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import re
from typing import TypeVar

from attnpass.ir import AttnpassError

from .base import Pass

ENTRY_POINT_GROUP = "attnpass.passes"
NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]*(-[A-Za-z0-9_]+)*\Z")

P = TypeVar("P", bound=type[Pass])

_REGISTRY: dict[str, type[Pass]] = {}


class PipelineError(AttnpassError):
    """A pass name, option or pipeline text is unknown or malformed."""


def register_pass(cls: P) -> P:
    """Class decorator: make ``cls`` available under ``cls.name``.

    Registering a class of the same module and qualified name again (a reload) replaces it;
    another class under a taken name is an error.
    """
    if not (isinstance(cls, type) and issubclass(cls, Pass) and dataclasses.is_dataclass(cls)):
        raise PipelineError(f"register_pass: {cls!r} is not a Pass dataclass")
    name = cls.name
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise PipelineError(
            f"register_pass: {cls.__qualname__}.name = {name!r} is not a pass name (letters, digits, '_', "
            "'-'-separated words, e.g. 'head-chunk')"
        )
    other = _REGISTRY.get(name)
    if other is not None and _qualified(other) != _qualified(cls):  # the same class re-imported replaces itself
        raise PipelineError(
            f"register_pass: the name {name!r} is taken by {_qualified(other)}; cannot register {_qualified(cls)}"
        )
    _REGISTRY[name] = cls
    return cls


def _suggestion(name: str, names: list[str]) -> str:
    """What an unknown pass name was likely meant to be: passes joined by spaces (``dce head-chunk``) are
    comma-separated, a misspelt name has a close registered one; ``''`` when nothing is close."""
    words = name.split()
    if len(words) > 1:
        meant = [w if w in names else next(iter(difflib.get_close_matches(w, names, n=1)), w) for w in words]
        return f"; passes are separated by ',', not spaces: did you mean {','.join(meant)!r}?"
    close = difflib.get_close_matches(name, names, n=3)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_passes() -> list[str]:
    """Every pass name a pipeline may use: registered ones and entry points (not loaded), sorted."""
    return sorted(set(_REGISTRY) | set(_entry_points()))


def get_pass(name: str) -> type[Pass]:
    """The pass class called ``name``; loads its entry point on first use. Raises PipelineError."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    ep = _entry_points().get(name)
    if ep is None:
        names = available_passes()
        raise PipelineError(f"unknown pass {name!r}; available passes: {', '.join(names)}{_suggestion(name, names)}")
    try:
        cls = ep.load()
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise PipelineError(f"pass {name!r}: loading entry point {ep.value!r} failed: {reason}") from exc
    if isinstance(cls, type) and issubclass(cls, Pass) and cls.name != name:
        raise PipelineError(f"pass {name!r}: entry point {ep.value!r} names a pass called {cls.name!r}")
    return register_pass(cls)


__all__ = ["ENTRY_POINT_GROUP", "PipelineError", "available_passes", "get_pass", "register_pass"]
