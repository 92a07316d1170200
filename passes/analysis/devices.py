"""What the passes and the MLX router know of each device: one keyed table, :data:`DEVICES`, and the Metal kernel gates.

:data:`DEVICES` maps a device name (the ``device`` option of ``decompose-sdpa``,
``block-sparse`` and :func:`~attnpass.passes.default_pipeline`; an MLX frontend's
``device()``) to its :class:`Device`, every per-device fact a pass, a default
pipeline or the MLX router's bounds (:mod:`attnpass.backends.mlx.bounds`) read;
each value cites where it was measured in docs/ (or says it was not). A new fact
is a new field, a new device a new row. The Metal constants below are MLX 0.32's
Metal SDPA gates, read from ``mlx/backend/metal/scaled_dot_product_attention.cpp``
(ml-explore/mlx at commit 00703ea6; docs/semantics.md §2.6): :func:`metal_vector_gate`
is the vector kernel's gate, which ``decompose-sdpa`` (through :func:`metal_vector_serves`:
the calls it keeps fused) and :func:`attnpass.backends.mlx.sdpa_route` (the full route
model) both read; ``head-chunk`` splits wider GQA calls under its budget.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from attnpass.ir import DType


@dataclass(frozen=True)
class Device:
    """The per-device facts the passes, the default pipelines and the MLX router read."""

    block_q: int  # block-sparse: query rows per tile
    prefill_tile: int  # qsa-gather under default_pipeline: query rows per prefill tile
    mla_crossover_factor: float  # mla-absorb: measured crossover rows / the FLOP model's crossover rows
    dsa_tile_bytes: int  # dsa-gather: the most bytes of gathered K/V one tile of query rows may hold
    own_passes: tuple[str, ...]  # default_pipeline: the device's own passes before decompose-sdpa, as pipeline text
    # the MLX router: the fewest key rows of a program's cut worth routing, per (program kind, the dtype it computes
    # in); None routes none (quantized_tie), a missing pair every depth
    min_keys: Mapping[tuple[str, DType], int | None] = field(hash=False)
    # the MLX router: the dtypes in which a program that is only MLX's CPU fallback's own ops (decompose-sdpa's
    # fused rounding, no other rewrite) is declined (fallback_ops): the client runs those ops over the valid keys
    fallback_declined: frozenset[DType] = frozenset()


DEVICES: dict[str, Device] = {
    # block_q 512: measured on MLX and JAX CPU (docs/semantics.md §1.4, benchmarks/block_sparse.py);
    # prefill_tile 16: measured (docs/qsa.md, "Prefill"); mla_crossover_factor and dsa_tile_bytes: measured
    # on MLX CPU (docs/mla.md, "Crossover" and "Tiles", benchmarks/mla_absorb.py); block-sparse: measured on CPU
    # only (docs/semantics.md §1.4); min_keys: measured on MLX CPU (docs/benchmarks.md, "Short contexts" and
    # "Quantized caches on CPU"); fallback_declined: measured on MLX CPU (docs/benchmarks.md, "Float32 decode on CPU")
    "cpu": Device(
        block_q=512,
        prefill_tile=16,
        mla_crossover_factor=0.85,
        dsa_tile_bytes=8 << 20,
        own_passes=("block-sparse{device=cpu}",),
        min_keys=MappingProxyType(
            {
                ("float", DType.float32): 192,
                ("float", DType.bfloat16): 128,
                ("float", DType.float16): 128,
                ("quantized", DType.float32): 512,
                ("quantized", DType.bfloat16): None,
                ("quantized", DType.float16): None,
            }
        ),
        fallback_declined=frozenset({DType.float32}),
    ),
    # block_q: the CPU's size, not measured; prefill_tile: the CPU's, not measured (docs/qsa.md, "Prefill");
    # mla_crossover_factor 1 (the FLOP model) and dsa_tile_bytes: not measured (docs/mla.md, "Crossover");
    # head-chunk: GQA calls fit MLX's fused vector kernel (METAL_VECTOR_BUDGET); min_keys: none measured
    "metal": Device(
        block_q=512,
        prefill_tile=16,
        mla_crossover_factor=1.0,
        dsa_tile_bytes=32 << 20,
        own_passes=("head-chunk",),
        min_keys=MappingProxyType({}),
    ),
    # block_q: the CPU's size, not measured; prefill_tile 64 bounds the gathered K/V per tile, not tuned
    # (docs/qsa.md, "Prefill"); mla_crossover_factor 1 (the FLOP model) and dsa_tile_bytes: not measured
    # (docs/mla.md, "Crossover"); min_keys: none measured
    "gpu": Device(
        block_q=512,
        prefill_tile=64,
        mla_crossover_factor=1.0,
        dsa_tile_bytes=256 << 20,
        own_passes=(),
        min_keys=MappingProxyType({}),
    ),
}
DEVICES["tpu"] = DEVICES["gpu"]  # the same facts, none measured

METAL_VECTOR_MAX_ROWS = 8  # q_len of the vector (decode) kernel family; longer calls go to the full kernel
METAL_VECTOR_BUDGET = 32  # the most q_len * gqa one vector-kernel call serves; head-chunk's default budget
METAL_VECTOR_HEAD_DIMS = frozenset({64, 96, 128, 192, 256})  # D == Dv the vector kernel has (and D 192, Dv 128)
METAL_VECTOR_UNFUSED_FASTER = frozenset({192})  # D == Dv the default heuristic still sends to the fallback
METAL_FULL_HEAD_DIMS = frozenset({64, 72, 80, 96, 128, 192, 256})  # D == Dv the full ("steel") kernel has
METAL_FULL_UNFUSED_FASTER = frozenset({192, 256})  # full-kernel head dims the default heuristic sends to the fallback
METAL_TWO_PASS_MIN_KEYS_GQA = 4096  # k_len from which a GQA call takes the two-pass vector kernel
METAL_TWO_PASS_MIN_KEYS_LARGE_GPU = 1024  # the same on a large GPU (architecture suffix in METAL_LARGE_GPU_ARCH)
METAL_LARGE_GPU_ARCH = frozenset({"s", "d"})  # last letter of device_info()["architecture"]: Pro/Max, Ultra


MetalVectorGate = Literal["rows", "head_dims", "keys", "budget", "unfused_faster"]


def metal_vector_head_dims(d: int, dv: int) -> bool:
    """Whether the Metal vector kernel has head dims ``d``/``dv`` (before the default heuristic's choice)."""
    return (d == dv and d in METAL_VECTOR_HEAD_DIMS) or (d, dv) == (192, 128)


def metal_vector_gate(q_len: int, gqa: int, d: int, dv: int, kv_len: int) -> MetalVectorGate | None:
    """The first gate of MLX's Metal vector kernel (one- or two-pass) this call fails, in MLX's order, or None when
    the kernel serves it by default: ``rows`` (``q_len`` over :data:`METAL_VECTOR_MAX_ROWS`), ``head_dims`` (no
    kernel for ``d``/``dv``), ``keys`` (``q_len > kv_len``), ``budget`` (``q_len * gqa`` over
    :data:`METAL_VECTOR_BUDGET`), ``unfused_faster`` (the default heuristic prefers the fallback)."""
    if q_len > METAL_VECTOR_MAX_ROWS:
        return "rows"
    if not metal_vector_head_dims(d, dv):
        return "head_dims"
    if q_len > kv_len:
        return "keys"
    if q_len * gqa > METAL_VECTOR_BUDGET:
        return "budget"
    if d == dv and d in METAL_VECTOR_UNFUSED_FASTER:
        return "unfused_faster"
    return None


def metal_vector_serves(q_len: int, gqa: int, d: int, dv: int, kv_len: int) -> bool:
    """Whether MLX's Metal vector kernel (one- or two-pass) serves this call by default."""
    return metal_vector_gate(q_len, gqa, d, dv, kv_len) is None


__all__ = [
    "DEVICES", "Device", "METAL_FULL_HEAD_DIMS", "METAL_FULL_UNFUSED_FASTER", "METAL_LARGE_GPU_ARCH",
    "METAL_TWO_PASS_MIN_KEYS_GQA", "METAL_TWO_PASS_MIN_KEYS_LARGE_GPU", "METAL_VECTOR_BUDGET", "METAL_VECTOR_HEAD_DIMS",
    "METAL_VECTOR_MAX_ROWS", "METAL_VECTOR_UNFUSED_FASTER", "MetalVectorGate", "metal_vector_gate",
    "metal_vector_head_dims", "metal_vector_serves",
]  # fmt: skip
