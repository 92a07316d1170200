"""The Qwen3.8-Flash-Next QSA decode attention layer, traced in masked form (docs/semantics.md §3).

:func:`qsa_attention` is the layer's attention written with ``attnpass.ir.ops``
(callable inside any trace, e.g. one layer of a whole model);
:func:`build_layer` traces it alone for a KV cache of ``n_kv`` cells and
:func:`make_inputs` fills it with random data for given positions.

Inputs (role): ``q`` [B, 24, S, 256] (streamed), ``k_cache``/``v_cache``
[B, 2, T, 256] (resident), indexer queries ``idx_q`` [B, S, 4, 128] (streamed,
un-normed, un-rotated), raw indexer keys ``idx_keys`` [B, T, 128] (resident,
un-normed, un-rotated), the indexer RMSNorm scales (``1 + weight`` for Qwen's
zero-centred weights) and a RoPE table ``rope_cos``/``rope_sin`` [T, rotary_dim/2]
(resident), ``positions`` [B, S] int32 and
the runtime's padded additive mask ``mask`` [B, 64, T] float16 (0 / -inf,
carrying causality and visibility; streamed every step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from attnpass.ir import DType, Graph, Tensor, TensorSpec, ops, trace
from attnpass.passes import DeadCodeElimination, NarrowInputs, PassManager, QSAGather

VISIBILITY_FORMS = ("additive", "bool", "none")


@dataclass(frozen=True)
class QSAConfig:
    """Model constants; the defaults are Qwen3.8-Flash-Next's QSA layer."""

    n_q_heads: int = 24
    n_kv_heads: int = 2
    head_dim: int = 256
    idx_heads: int = 4
    idx_dim: int = 128
    budget: int = 2048  # tokens attended besides the tail
    ratio: int = 4
    mask_rows: int = 64  # the runtime pads the mask's token axis to this
    dtype: str = "float32"
    mask_dtype: str = "float16"
    rotary_dim: int = 64  # the indexer applies the attention's partial RoPE (256 * 0.25) to its first dims
    eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.ratio < 1 or self.budget % self.ratio:
            raise ValueError(f"QSAConfig: ratio={self.ratio} does not divide the budget {self.budget}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.idx_dim:
            raise ValueError(f"QSAConfig: rotary_dim={self.rotary_dim} must be even and within idx_dim={self.idx_dim}")

    @property
    def top_k_blocks(self) -> int:
        return self.budget // self.ratio

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def layer_specs(cfg: QSAConfig, n_kv: int, batch: int = 1, rows: int = 1) -> dict[str, TensorSpec]:
    """The layer's inputs in signature order."""
    if rows > cfg.mask_rows:
        raise ValueError(f"{rows} query rows do not fit the padded mask's {cfg.mask_rows} rows")
    half = cfg.rotary_dim // 2
    return {
        "q": TensorSpec((batch, cfg.n_q_heads, rows, cfg.head_dim), cfg.dtype),
        "k_cache": TensorSpec((batch, cfg.n_kv_heads, n_kv, cfg.head_dim), cfg.dtype, "resident"),
        "v_cache": TensorSpec((batch, cfg.n_kv_heads, n_kv, cfg.head_dim), cfg.dtype, "resident"),
        "idx_q": TensorSpec((batch, rows, cfg.idx_heads, cfg.idx_dim), "float32"),
        "idx_keys": TensorSpec((batch, n_kv, cfg.idx_dim), "float32", "resident"),
        "idx_q_norm": TensorSpec((cfg.idx_dim,), "float32", "resident"),
        "idx_k_norm": TensorSpec((cfg.idx_dim,), "float32", "resident"),
        "rope_cos": TensorSpec((n_kv, half), "float32", "resident"),
        "rope_sin": TensorSpec((n_kv, half), "float32", "resident"),
        "positions": TensorSpec((batch, rows), "int32"),
        "mask": TensorSpec((batch, cfg.mask_rows, n_kv), cfg.mask_dtype),
    }


def rms_norm(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) * scale over the last axis."""
    mean_square = ops.sum(x * x, axis=-1, keepdims=True) / x.shape[-1]
    return x * ops.rsqrt(mean_square + eps) * scale


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Partial rotate-half RoPE on the first ``2 * cos.shape[-1]`` dims; ``cos``/``sin`` broadcast."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin] + ([rest] if rest.shape[-1] else [])
    return ops.concat(parts, axis=-1)


def qsa_attention(cfg: QSAConfig, x: Mapping[str, Tensor], *, visibility: str = "additive") -> Tensor:
    """The masked-form QSA attention over the tensors ``x`` named as in :func:`layer_specs`.

    ``visibility``: how the padded mask meets the selection: ``"additive"``
    (``where(qsa_mask, mask_row, -inf)``), ``"bool"`` (``qsa_mask & (mask_row == 0)``)
    or ``"none"`` (the selection alone; the padded mask is then unused).
    """
    if visibility not in VISIBILITY_FORMS:
        raise ValueError(f"visibility must be one of {VISIBILITY_FORMS}, got {visibility!r}")
    batch, _, rows, _ = x["q"].shape
    n_kv = x["k_cache"].shape[2]
    r, k_blocks, n_blocks = cfg.ratio, cfg.top_k_blocks, n_kv // cfg.ratio
    # Indexer keys: pool each block of raw keys, RMSNorm, RoPE at the block's first position b*r.
    pooled = ops.qsa_pool(x["idx_keys"], ratio=r)
    starts = slice(0, n_blocks * r, r)
    block_keys = rope(rms_norm(pooled, x["idx_k_norm"], cfg.eps), x["rope_cos"][starts], x["rope_sin"][starts])
    # Indexer queries: RMSNorm per head, RoPE at the query position.
    half = cfg.rotary_dim // 2
    cos_q = ops.reshape(ops.take(x["rope_cos"], x["positions"], axis=0), (batch, rows, 1, half))
    sin_q = ops.reshape(ops.take(x["rope_sin"], x["positions"], axis=0), (batch, rows, 1, half))
    queries = rope(rms_norm(x["idx_q"], x["idx_q_norm"], cfg.eps), cos_q, sin_q)
    scores = ops.qsa_block_scores(queries, block_keys)
    selection = ops.qsa_select(scores, x["positions"], ratio=r, top_k_blocks=k_blocks)
    keep = ops.qsa_mask(selection, x["positions"], ratio=r, kv_len=n_kv)
    if visibility == "none":
        attend = keep
    else:
        mask_rows = ops.reshape(x["mask"][:, :rows, :], (batch, 1, rows, n_kv))
        if visibility == "additive":
            attend = ops.where(keep, ops.cast(mask_rows, cfg.dtype), -math.inf)
        else:
            attend = ops.logical_and(keep, ops.equal(mask_rows, 0.0))
    return ops.sdpa(x["q"], x["k_cache"], x["v_cache"], mask=attend, scale=cfg.scale)


def build_layer(cfg: QSAConfig, n_kv: int, *, batch: int = 1, rows: int = 1, visibility: str = "additive") -> Graph:
    """Trace :func:`qsa_attention` alone for a cache of ``n_kv`` cells (graph ``qsa_decode_layer``)."""
    specs = layer_specs(cfg, n_kv, batch, rows)

    def qsa_decode_layer(
        q, k_cache, v_cache, idx_q, idx_keys, idx_q_norm, idx_k_norm, rope_cos, rope_sin, positions, mask
    ):
        tensors = (q, k_cache, v_cache, idx_q, idx_keys, idx_q_norm, idx_k_norm, rope_cos, rope_sin, positions, mask)
        return qsa_attention(cfg, dict(zip(specs, tensors)), visibility=visibility)

    return trace(qsa_decode_layer, *specs.values())


def padded_mask(cfg: QSAConfig, positions: np.ndarray, n_kv: int, hidden: np.ndarray | None = None) -> np.ndarray:
    """The runtime's mask [B, 64, T]: row s is 0 on cells <= positions[b, s] not ``hidden``, else -inf."""
    batch, rows = positions.shape
    mask = np.full((batch, cfg.mask_rows, n_kv), -np.inf, dtype=np.float32)
    cells = np.arange(n_kv)
    for b in range(batch):
        for s in range(rows):
            visible = cells <= positions[b, s]
            if hidden is not None:
                visible &= ~hidden[b]
                visible[positions[b, s]] = True  # a token always sees itself
            mask[b, s, visible] = 0.0
    return mask.astype(DType.parse(cfg.mask_dtype).numpy)


def make_inputs(
    cfg: QSAConfig, n_kv: int, positions: np.ndarray, *, seed: int = 0, hidden_fraction: float = 0.0
) -> dict[str, np.ndarray]:
    """Random inputs for :func:`build_layer`; ``hidden_fraction`` of the cells are masked out as invisible."""
    positions = np.asarray(positions, dtype=np.int32)
    batch, rows = positions.shape
    rng = np.random.default_rng(seed)
    specs = layer_specs(cfg, n_kv, batch, rows)

    def normal(name: str) -> np.ndarray:
        return rng.standard_normal(specs[name].shape, dtype=np.float32).astype(specs[name].type.dtype.numpy)

    half = cfg.rotary_dim // 2
    angles = np.arange(n_kv)[:, None] * cfg.rope_theta ** (-np.arange(half) / half)
    hidden = rng.random((batch, n_kv)) < hidden_fraction if hidden_fraction else None
    return {
        "q": normal("q"),
        "k_cache": normal("k_cache"),
        "v_cache": normal("v_cache"),
        "idx_q": normal("idx_q"),
        "idx_keys": normal("idx_keys"),
        "idx_q_norm": (1.0 + 0.1 * rng.standard_normal(cfg.idx_dim)).astype(np.float32),
        "idx_k_norm": (1.0 + 0.1 * rng.standard_normal(cfg.idx_dim)).astype(np.float32),
        "rope_cos": np.cos(angles).astype(np.float32),
        "rope_sin": np.sin(angles).astype(np.float32),
        "positions": positions,
        "mask": padded_mask(cfg, positions, n_kv, hidden),
    }


def gather_pipeline(**gather_options) -> PassManager:
    """QSA gather, then drop the dead masked path, narrow the padded mask to its one read row, clean up."""
    return PassManager([QSAGather(**gather_options), DeadCodeElimination(), NarrowInputs(), DeadCodeElimination()])


def narrowed_inputs(graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``inputs`` cut to ``graph``'s signature: dropped inputs left out, narrowed ones cut to their shape.

    The layer reads the *first* ``S`` rows of the padded mask, so a narrowed input is its leading part.
    """
    out = {}
    for name, expected in zip(graph.inputs, graph.input_types()):
        value = inputs[name]
        out[name] = value[tuple(slice(0, n) for n in expected.shape)]
    return out


__all__ = [
    "QSAConfig", "VISIBILITY_FORMS", "build_layer", "gather_pipeline", "layer_specs", "make_inputs",
    "narrowed_inputs", "padded_mask", "qsa_attention", "rms_norm", "rope",
]  # fmt: skip
