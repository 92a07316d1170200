"""Emitter pieces shared by the targets: indexing, sdpa defaults, causal masks."""

from __future__ import annotations

import math

from attnpass.ir import Node

from .codegen import EmitEnv, py_float


def slice_expr(node: Node, x: str) -> str:
    """``x[a:b:c, ...]`` for a static slice node (plain Python indexing on every target)."""
    parts = []
    for lo, hi, st in zip(node.attrs["start"], node.attrs["stop"], node.attrs["step"]):
        parts.append(f"{lo}:{hi}" + (f":{st}" if st != 1 else ""))
    return f"{x}[{', '.join(parts)}]" if parts else x


def sdpa_scale(node: Node, env: EmitEnv) -> str:
    scale = node.attrs["scale"]
    if scale is None:
        scale = 1.0 / math.sqrt(env.type_of(node.inputs[0]).shape[-1])
    return py_float(scale)


def sdpa_lengths(node: Node, env: EmitEnv) -> tuple[int, int]:
    return env.type_of(node.inputs[0]).shape[2], env.type_of(node.inputs[1]).shape[2]


def causal_offset(node: Node, env: EmitEnv) -> int | None:
    """None when not causal; else the diagonal offset (top_left 0, bottom_right T - S)."""
    causal = node.attrs["causal"]
    if causal == "none":
        return None
    s, t = sdpa_lengths(node, env)
    return t - s if causal == "bottom_right" else 0


def mask_rank4(node: Node, env: EmitEnv) -> tuple[int, ...] | None:
    """The mask's shape padded with leading ones to rank 4, or None if it is already rank 4."""
    shape = env.type_of(node.inputs[3]).shape
    return None if len(shape) == 4 else (1,) * (4 - len(shape)) + shape
