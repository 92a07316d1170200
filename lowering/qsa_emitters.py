"""Emitters for the QSA dialect: one call into the target's ``qsa`` runtime helper per op.

Every target's ``qsa`` helper (``Target.runtime["qsa"]``) offers the same
functions (``pool``, ``block_scores``, ``select``, ``mask``, ``cells``,
``cell_valid``, ``gather``), so the generated line reads
``sel = qsa.select(scores, positions, ratio=4, top_k_blocks=512)``.
"""

from __future__ import annotations

from attnpass.ir import Node

from .codegen import py_literal
from .target import EmitEnv, Emitter

_FUNCTIONS = {
    "qsa_pool": "pool",
    "qsa_block_scores": "block_scores",
    "qsa_select": "select",
    "qsa_mask": "mask",
    "qsa_cells": "cells",
    "qsa_cell_valid": "cell_valid",
    "qsa_gather": "gather",
}


def _call(function: str) -> Emitter:
    def emit(n: Node, a: list[str], env: EmitEnv) -> str:
        kwargs = [f"{key}={py_literal(value)}" for key, value in n.attrs.items()]
        return f"{env.runtime('qsa')}.{function}({', '.join(a + kwargs)})"

    return emit


QSA_EMITTERS: dict[str, Emitter] = {op: _call(fn) for op, fn in _FUNCTIONS.items()}
