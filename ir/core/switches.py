"""On/off switches: one reading of the words, and of environment variables (read at use, never written).

``true``, ``on``, ``yes``, ``1`` mean on and ``false``, ``off``, ``no``, ``0``
mean off, in any case, surrounding whitespace ignored: the textual pipeline's
bool options, the passes' on/off policies (:mod:`attnpass.passes.infra.policy`) and
the runtime checks (:mod:`attnpass.lowering.checks`) all read them here. An
explicit argument wins over the environment; an unset variable leaves the
default; any other value leaves the default too, with a warning once per
process and variable naming the variable, its value and the accepted values
(a typo such as ``flase`` should not pass silently).
"""

from __future__ import annotations

import os
import warnings

ON = ("true", "on", "yes", "1")
OFF = ("false", "off", "no", "0")
ON_VALUES, OFF_VALUES = frozenset(ON), frozenset(OFF)
_WARNED: set[str] = set()  # variables already warned about in this process


class SwitchWarning(UserWarning):
    """An environment switch holds a value that is neither a recognised "on" nor "off" value."""


def parse_switch(text: str) -> bool | None:
    """True for an "on" word, False for an "off" word, None for anything else."""
    word = text.strip().lower()
    return True if word in ON_VALUES else False if word in OFF_VALUES else None


def env_switch(env_var: str, explicit: bool | None, *, default: bool, subject: str) -> tuple[bool, str]:
    """``(on, source)``: ``explicit`` when given, else ``env_var`` read now, else ``default``.

    ``source`` says what decided: ``"enabled=False"`` (an explicit value), ``"X unset"`` or ``"X=off"``.
    ``subject`` names what the switch turns on in the warning, e.g. ``"the rewrite"``.
    """
    if explicit is not None:
        return explicit, f"enabled={explicit}"
    raw = os.environ.get(env_var)
    if raw is None:
        return default, f"{env_var} unset"
    on = parse_switch(raw)
    if on is None and env_var not in _WARNED:
        _WARNED.add(env_var)
        state, flip = ("on", "off") if default else ("off", "on")
        change, keep = (OFF, ON) if default else (ON, OFF)
        warnings.warn(
            f"{env_var}={raw!r} is not a recognised value, so {subject} stays {state}; accepted: "
            f"{'/'.join(change)} turn it {flip}, {'/'.join(keep)} (or unset) leave it {state}",
            SwitchWarning,
            stacklevel=3,
        )
    return default if on is None else on, f"{env_var}={raw.strip()}"


__all__ = ["OFF", "ON", "SwitchWarning", "env_switch", "parse_switch"]
