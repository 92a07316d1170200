"""On/off policies read from the environment at use (never written): one rule for every pass.

An explicit ``True``/``False`` wins. Otherwise the variable is read when the
pass runs: ``false``, ``off``, ``no`` or ``0`` (any case, surrounding
whitespace ignored) turns the rewrite off; any other value, or none, leaves it
on (docs/semantics.md §2.5). ``true``, ``on``, ``yes`` and ``1`` are the
recognised "on" values: any other value still leaves the rewrite on, with a
warning once per process and variable (:func:`attnpass.ir.core.switches.env_switch`,
the one reader of every switch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir.core.switches import env_switch

from .base import Pass


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
        on, source = env_switch(self.env_var, self.enabled, default=True, subject="the rewrite")
        if on:
            return None
        return f"disabled by {type(self).__name__}(enabled=False)" if self.enabled is False else f"disabled by {source}"
