"""On/off policies read from the environment at use (never written): one rule for every pass.

An explicit ``True``/``False`` wins. Otherwise the variable is read when the
pass runs: ``false``, ``off``, ``no`` or ``0`` (any case, surrounding
whitespace ignored) turns the rewrite off; any other value, or none, leaves it on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from .base import Pass

OFF_VALUES = frozenset({"false", "off", "no", "0"})


def resolve_switch(enabled: bool | None, env_var: str) -> tuple[bool, str]:
    """``(on, source)``: what decided, ``"enabled=False"`` or e.g. ``"ATTNPASS_QSA_GATHER=off"``."""
    if enabled is not None:
        return enabled, f"enabled={enabled}"
    raw = os.environ.get(env_var)
    if raw is None:
        return True, f"{env_var} unset"
    return raw.strip().lower() not in OFF_VALUES, f"{env_var}={raw.strip()}"


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
