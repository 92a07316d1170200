"""Predict where MLX 0.32 routes an SDPA call on Metal, on a machine without a GPU (docs/semantics.md §2.6).

The model follows ``mlx/backend/metal/scaled_dot_product_attention.cpp``
(ml-explore/mlx; read at commit 00703ea6, the stored version closest to 0.32):
``has_fused_kernel`` and ``use_fallback`` pick fused or unfused, and
``eval_gpu`` picks the vector kernel's one- or two-pass form. The gates and
their numbers live in :mod:`attnpass.passes.analysis.devices`:

- CPU streams always take the unfused fallback.
- ``q_len <= METAL_VECTOR_MAX_ROWS`` (vector family): the calls
  :func:`~attnpass.passes.analysis.devices.metal_vector_gate` lets through (head
  dims, ``q_len <= k_len``, ``q_len * gqa <= METAL_VECTOR_BUDGET``, not a head
  dim the default heuristic sends to the fallback). The two-pass form runs from
  ``METAL_TWO_PASS_MIN_KEYS_GQA`` keys with GQA (``Hkv < Hq``), or from
  ``METAL_TWO_PASS_MIN_KEYS_LARGE_GPU`` on a large GPU (``METAL_LARGE_GPU_ARCH``).
- longer calls (full "steel" kernel): need ``D == Dv`` in ``METAL_FULL_HEAD_DIMS``,
  and for a ``"causal"`` string mask ``q_len <= k_len``; the default heuristic
  sends ``METAL_FULL_UNFUSED_FASTER`` to the fallback.

Assumptions, stated because 0.32.4's own source was not available: its gates
match the read commit for the cases above; the NAX (M5) full-kernel route for
``q_len >= 1024`` with head dim 256 and the head-dim-512 decode kernel of
later releases are not modelled (both predict "fallback").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from attnpass.ir import DType
from attnpass.lowering import Program
from attnpass.lowering.target import EmitEnv
from attnpass.lowering.targets.mlx import MLX, mask_kind
from attnpass.passes.analysis.devices import (
    METAL_FULL_HEAD_DIMS,
    METAL_FULL_UNFUSED_FASTER,
    METAL_LARGE_GPU_ARCH,
    METAL_TWO_PASS_MIN_KEYS_GQA,
    METAL_TWO_PASS_MIN_KEYS_LARGE_GPU,
    METAL_VECTOR_BUDGET,
    METAL_VECTOR_MAX_ROWS,
    metal_vector_gate,
)

Kernel = Literal["vector", "vector_2pass", "full", "fallback", "explicit"]  # explicit: no fused call at all
MaskKind = Literal["causal", "array"] | None


@dataclass(frozen=True)
class Route:
    """The kernel one SDPA call takes and why."""

    kernel: Kernel
    reason: str


def sdpa_route(
    q_shape: Sequence[int],
    k_shape: Sequence[int],
    *,
    dtype: DType | str,
    mask: MaskKind,
    device: str = "metal",
    v_head_dim: int | None = None,
    arch: str = "g",
) -> Route:
    """The predicted route of ``mx.fast.scaled_dot_product_attention`` for these shapes.

    ``q_shape`` is ``[B, Hq, q_len, D]``, ``k_shape`` ``[B, Hkv, k_len, D]``;
    ``mask`` is None, ``"causal"`` (MLX's string mask) or ``"array"`` (any
    bool or additive array); ``v_head_dim`` defaults to D; ``arch`` is the
    last letter of ``mx.metal.device_info()["architecture"]`` (``g`` base,
    ``s`` Pro/Max, ``d`` Ultra). ``device="cpu"`` is always the fallback.
    """
    if not DType.parse(dtype).is_float:
        raise ValueError(f"sdpa_route: dtype {dtype!r} is not a float type; MLX SDPA takes float16/bfloat16/float32")
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(f"sdpa_route: q and k must be rank 4 [B, H, L, D], got {list(q_shape)} and {list(k_shape)}")
    if mask not in (None, "causal", "array"):
        raise ValueError(f"sdpa_route: mask must be None, 'causal' or 'array', got {mask!r}")
    if device == "cpu":
        return Route("fallback", "CPU stream: MLX always runs the unfused fallback")
    if device != "metal":
        raise ValueError(f"sdpa_route: device must be 'metal' or 'cpu', got {device!r}")
    _, hq, s, d = q_shape
    _, hkv, t, _ = k_shape
    dv = d if v_head_dim is None else v_head_dim
    rows = METAL_VECTOR_MAX_ROWS
    if s > rows:
        if d != dv or d not in METAL_FULL_HEAD_DIMS:
            return Route("fallback", f"q_len {s} > {rows}: the full kernel has no head dims D={d}, Dv={dv}")
        if mask == "causal" and s > t:
            return Route("fallback", f"q_len {s} > k_len {t}: the full kernel's causal mask needs q_len <= k_len")
        if d in METAL_FULL_UNFUSED_FASTER:
            return Route(
                "fallback", f"q_len {s} > {rows} with head dim {d}: the default heuristic prefers the unfused path"
            )
        return Route("full", f"q_len {s} > {rows}, head dim {d}: full (steel) attention kernel")
    gqa = hq // hkv
    budget = METAL_VECTOR_BUDGET
    refused = metal_vector_gate(s, gqa, d, dv, t)
    if refused is not None:
        reasons = {
            "head_dims": f"q_len {s} <= {rows}: the vector kernel has no head dims D={d}, Dv={dv}",
            "keys": f"q_len {s} > k_len {t}: the vector kernel needs q_len <= k_len",
            "budget": f"q_len*gqa = {s * gqa} > {budget} (q_len {s}, gqa {gqa}): no vector kernel",
            "unfused_faster": f"head dim {d} with q_len <= {rows}: the default heuristic prefers the unfused path",
        }
        return Route("fallback", reasons[refused])
    large = arch in METAL_LARGE_GPU_ARCH and t >= METAL_TWO_PASS_MIN_KEYS_LARGE_GPU
    if large or (hkv < hq and t >= METAL_TWO_PASS_MIN_KEYS_GQA):
        return Route("vector_2pass", f"q_len*gqa = {s * gqa} <= {budget}, k_len {t}: two-pass vector kernel")
    return Route("vector", f"q_len*gqa = {s * gqa} <= {budget}, k_len {t}: vector kernel")


def sdpa_routes(program: Program, device: str = "metal", *, arch: str = "g") -> list[tuple[str, Route]]:
    """``(sdpa node name, predicted Route)`` for every SDPA call of an MLX program, in program order."""
    program.require_target(MLX, "sdpa_routes()")
    env = EmitEnv(program.graph, MLX)
    routes = []
    for node in program.graph.nodes():
        if node.op == "sdpa" and node.attrs.get("logit_softcap") is not None:
            reason = "logit_softcap: MLX's fused call has no soft-capping, so the program writes the attention out"
            routes.append((node.name, Route("explicit", reason)))
        elif node.op == "sdpa":
            q, k, v = (env.type_of(i) for i in node.inputs[:3])
            route = sdpa_route(
                q.shape,
                k.shape,
                dtype=q.dtype,
                mask=mask_kind(node, env),
                device=device,
                v_head_dim=v.shape[3],
                arch=arch,
            )
            routes.append((node.name, route))
    return routes


__all__ = ["Route", "sdpa_route", "sdpa_routes"]
