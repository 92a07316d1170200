"""Emitters for the QSA dialect: one call into the target's ``qsa_runtime_*`` module per op.

Every target's runtime module offers the same functions (``pool``,
``block_scores``, ``select``, ``mask``, ``cells``, ``cell_valid``), so the
generated line reads ``sel = qsa.select(scores, positions, ratio=4, top_k_blocks=512)``.
"""

from __future__ import annotations

from attnpass.ir import Node

from .codegen import EmitEnv, Emitter, py_literal

_FUNCTIONS = {
    "qsa_pool": "pool",
    "qsa_block_scores": "block_scores",
    "qsa_select": "select",
    "qsa_mask": "mask",
    "qsa_cells": "cells",
    "qsa_cell_valid": "cell_valid",
}
ALIAS = "qsa"


def _call(function: str, target: str) -> Emitter:
    def emit(n: Node, a: list[str], env: EmitEnv) -> str:
        env.need(f"from attnpass.lowering import qsa_runtime_{target} as {ALIAS}")
        kwargs = [f"{key}={py_literal(value)}" for key, value in n.attrs.items()]
        return f"{ALIAS}.{function}({', '.join(a + kwargs)})"

    return emit


def qsa_emitters(target: str) -> dict[str, Emitter]:
    """The emitter table entries for every QSA op on ``target`` ("numpy", "mlx" or "jax").

    A program that uses one imports ``attnpass.lowering.qsa_runtime_<target>`` as ``qsa``.
    """
    return {op: _call(fn, target) for op, fn in _FUNCTIONS.items()}
