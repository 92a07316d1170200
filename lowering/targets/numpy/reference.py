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
    return rounded(np.broadcast_to(flat.reshape(()), shape) if flat.size == 1 else flat.reshape(shape), dtype)


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


def _logits(q, k, mask, scale: float, causal: str) -> np.ndarray:
    """float64 ``q k^T * scale`` plus an additive mask, -inf where a bool mask or causality forbids."""
    q, k = wide(q), wide(k)
    (b, hq, s, _), (hkv, t) = q.shape, k.shape[1:3]
    folded = q.reshape(b, hkv, (hq // hkv) * s, q.shape[3])
    scores = np.matmul(folded, np.swapaxes(k, -1, -2)).reshape(b, hq, s, t) * scale
    allowed = causal_mask(s, t, causal)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            allowed = mask if allowed is None else np.logical_and(mask, allowed)
        else:
            scores = scores + wide(mask)
    return scores if allowed is None else np.where(allowed, scores, -np.inf)


def sdpa(q, k, v, mask=None, *, scale: float, causal: str, dtype: str) -> np.ndarray:
    """softmax(q k^T * scale + mask) v in float64; query head h reads kv head h // (Hq / Hkv).

    The query heads of each KV group are folded into the rows of one matmul
    per KV head, so K/V are never copied per query head.
    """
    scores = _logits(q, k, mask, scale, causal)
    (b, hq, s, t), hkv = scores.shape, k.shape[1]
    peak = np.max(scores, axis=-1, keepdims=True)
    e = np.exp(scores - np.where(np.isfinite(peak), peak, 0.0))
    probs = (e / np.sum(e, axis=-1, keepdims=True)).reshape(b, hkv, (hq // hkv) * s, t)
    return rounded(np.matmul(probs, wide(v)).reshape(b, hq, s, v.shape[3]), dtype)


def sdpa_lse(q, k, mask=None, *, scale: float, causal: str) -> np.ndarray:
    """float32 logsumexp over the keys of sdpa's logits (-inf for a row that attends no key)."""
    scores = _logits(q, k, mask, scale, causal)
    peak = np.max(scores, axis=-1)
    finite = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore"):  # log(0) = -inf for a row that attends no key
        return rounded(finite + np.log(np.sum(np.exp(scores - finite[..., None]), axis=-1)), "float32")


def put_along_axis(x: np.ndarray, indices: np.ndarray, values: np.ndarray, axis: int) -> np.ndarray:
    """numpy.put_along_axis on a copy (values broadcast to the indices)."""
    out = np.array(x, copy=True)
    np.put_along_axis(out, indices, np.broadcast_to(values, indices.shape), axis)
    return out
