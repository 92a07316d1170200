"""Runtime checks: a value outside an op's contract raises :class:`RuntimeCheckError` naming the op.

The QSA ops' contract (:mod:`attnpass.ir.dialects.qsa`): positions in
``[0, kv_len)`` and block ids in ``[-1, ceil(kv_len / ratio))``. The numpy
reference always checks it. MLX and JAX programs drop such ids and cells
(never reading out of bounds) unless checks are on: lowered with
``lower(graph, target, checks=True)``, or :data:`ENV_VAR` set to ``1``,
``true``, ``on`` or ``yes`` (any case, surrounding whitespace ignored; any
other value but an "off" word warns once, :mod:`attnpass.ir.core.switches`),
read each time a QSA op runs (at trace time under ``jax.jit``: a JAX program,
jitted unless lowered with ``jit=False``, reads it when it is traced, at its
first call per input types), never written.

A check reads the values on the host: MLX evaluates the operands there (so a
checked MLX program cannot be traced by ``mx.compile`` or exported), a JAX
program lowered with ``checks=True`` is eager, and under ``jax.jit`` the
check is a ``jax.debug.callback``, whose error arrives as a
``JaxRuntimeError`` carrying this message.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnpass.ir import AttnpassError
from attnpass.ir.core.switches import env_switch

ENV_VAR = "ATTNPASS_RUNTIME_CHECKS"


class RuntimeCheckError(AttnpassError, ValueError):
    """A runtime value is outside its op's contract (a ValueError too, as the numpy reference always raised)."""


def env_checks() -> bool:
    """Whether :data:`ENV_VAR` turns the checks on now."""
    return env_switch(ENV_VAR, None, default=False, subject="runtime checking")[0]


def check_qsa_operands(op: str, selection: Any, positions: Any, *, ratio: int, kv_len: int) -> None:
    """Raise RuntimeCheckError for a position outside ``[0, kv_len)`` or a block id outside ``[-1, NB)``."""
    positions, selection = np.asarray(positions), np.asarray(selection)
    bad = positions[(positions < 0) | (positions >= kv_len)]
    if bad.size:
        raise RuntimeCheckError(f"{op}: position {int(bad[0])} is outside the cache [0, {kv_len})")
    n_blocks = -(-kv_len // ratio)
    bad = selection[(selection < -1) | (selection >= n_blocks)]
    if bad.size:
        raise RuntimeCheckError(f"{op}: block id {int(bad[0])} is out of range [-1, {n_blocks}) for kv_len={kv_len}")


__all__ = ["ENV_VAR", "RuntimeCheckError", "check_qsa_operands", "env_checks"]
