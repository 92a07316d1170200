"""On/off policies read from the environment at use (never written): one rule for every pass.

An explicit ``True``/``False`` wins. Otherwise the variable is read when the
pass runs: ``false``, ``off``, ``no`` or ``0`` (any case, surrounding
whitespace ignored) turns the rewrite off; any other value, or none, leaves it on.
"""

from __future__ import annotations

import os

OFF_VALUES = frozenset({"false", "off", "no", "0"})


def resolve_switch(enabled: bool | None, env_var: str) -> tuple[bool, str]:
    """``(on, source)``: what decided, ``"enabled=False"`` or e.g. ``"ATTNPASS_QSA_GATHER=off"``."""
    if enabled is not None:
        return enabled, f"enabled={enabled}"
    raw = os.environ.get(env_var)
    if raw is None:
        return True, f"{env_var} unset"
    return raw.strip().lower() not in OFF_VALUES, f"{env_var}={raw.strip()}"
