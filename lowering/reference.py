"""Runtime of the numpy reference target: every op computed in float64, rounded to the node's dtype.

This is the oracle the tests compare MLX and JAX programs with. Integer and
boolean ops stay exact; layout ops (slice, reshape, take, ...) move values
without arithmetic.
"""

from __future__ import annotations

import numpy as np

from attnpass.ir import DType


def wide(x: np.ndarray) -> np.ndarray:
    """float64 for floating operands, int64 for integers, bool as is."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        return x
    if x.dtype.kind in "iu":
        return x.astype(np.int64)
    return x.astype(np.float64)


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(x).astype(DType.parse(dtype).numpy)


def constant(values: tuple, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    flat = np.asarray(values, dtype=np.float64 if DType.parse(dtype).is_float else None)
    return rounded(np.broadcast_to(flat, shape) if flat.size == 1 else flat.reshape(shape), dtype)


def softmax(x: np.ndarray, axis: int, dtype: str) -> np.ndarray:
    x = wide(x)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return rounded(e / np.sum(e, axis=axis, keepdims=True), dtype)


def causal_mask(s: int, t: int, causal: str) -> np.ndarray | None:
    """bool [S, T]: query i sees key j iff j <= i + offset (top_left: 0, bottom_right: T - S)."""
    if causal == "none":
        return None
    offset = t - s if causal == "bottom_right" else 0
    return np.arange(t)[None, :] <= np.arange(s)[:, None] + offset


def sdpa(q, k, v, mask=None, *, scale: float, causal: str, dtype: str) -> np.ndarray:
    """softmax(q k^T * scale + mask) v in float64, GQA by mapping query head h to kv head h // g."""
    q, k, v = wide(q), wide(k), wide(v)
    groups = q.shape[1] // k.shape[1]
    k = np.repeat(k, groups, axis=1)
    v = np.repeat(v, groups, axis=1)
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    allowed = causal_mask(q.shape[2], k.shape[2], causal)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            allowed = mask if allowed is None else np.logical_and(mask, allowed)
        else:
            scores = scores + wide(mask)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    peak = np.max(scores, axis=-1, keepdims=True)
    e = np.exp(scores - np.where(np.isfinite(peak), peak, 0.0))
    return rounded(np.matmul(e / np.sum(e, axis=-1, keepdims=True), v), dtype)
