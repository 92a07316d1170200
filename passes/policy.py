"""On/off policies read from the environment at use (never written): one rule for every pass.

An explicit ``True``/``False`` wins. Otherwise the variable is read when the
pass runs: ``false``, ``off``, ``no`` or ``0`` (any case, surrounding
whitespace ignored) turns the rewrite off; any other value, or none, leaves it
on (docs/semantics.md §2.5). ``true``, ``on``, ``yes`` and ``1`` are the
recognised "on" values: any other value still leaves the rewrite on, with a
warning once per process and variable naming the variable, its value and the
accepted values (a typo such as ``flase`` should not pass silently).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import ClassVar

from .base import Pass

OFF = ("false", "off", "no", "0")
ON = ("true", "on", "yes", "1")
OFF_VALUES, ON_VALUES = frozenset(OFF), frozenset(ON)
_WARNED: set[str] = set()  # variables already warned about in this process


class SwitchWarning(UserWarning):
    """An environment switch holds a value that is neither a recognised "on" nor "off" value."""


def resolve_switch(enabled: bool | None, env_var: str) -> tuple[bool, str]:
    """``(on, source)``: what decided, ``"enabled=False"`` or e.g. ``"ATTNPASS_QSA_GATHER=off"``."""
    if enabled is not None:
        return enabled, f"enabled={enabled}"
    raw = os.environ.get(env_var)
    if raw is None:
        return True, f"{env_var} unset"
    value = raw.strip().lower()
    if value not in OFF_VALUES | ON_VALUES and env_var not in _WARNED:
        _WARNED.add(env_var)
        warnings.warn(
            f"{env_var}={raw!r} is not a recognised value, so the rewrite stays on; accepted: "
            f"{'/'.join(OFF)} turn it off, {'/'.join(ON)} (or unset) leave it on",
            SwitchWarning,
            stacklevel=2,
        )
    return value not in OFF_VALUES, f"{env_var}={raw.strip()}"


@dataclass(frozen=True)
class SwitchedPass(Pass):
    """A pass with an on/off policy: ``enabled`` (True, False or None = read ``env_var`` when it runs)."""

    env_var: ClassVar[str] = ""
    enabled: bool | None = None

    def __post_init__(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise ValueError(f"{type(self).__name__}: enabled must be True, False or None, got {self.enabled!r}")

    def disabled(self) -> str | None:
        """None when the rewrite is on now; otherwise the reason, e.g. ``disabled by ATTNPASS_QSA_GATHER=off``."""
        on, source = resolve_switch(self.enabled, self.env_var)
        if on:
            return None
        return f"disabled by {type(self).__name__}(enabled=False)" if self.enabled is False else f"disabled by {source}"
