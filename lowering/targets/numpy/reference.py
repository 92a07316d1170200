"""Runtime of the numpy reference target: every op computed in float64, rounded to the node's dtype.

This is the oracle the tests compare MLX and JAX programs with. Integer and
boolean ops stay exact; layout ops (slice, reshape, take, ...) move values
without arithmetic. ``wide``, ``rounded``, ``constant``, ``softmax``, ``conv1d``, ``scan``, ``remainder``, ``argtopk``,
``dequantize`` and ``quantized_matmul``
are the op semantics
of :mod:`attnpass.ir.dialects.evaluate`, which constant folding shares.
"""

from __future__ import annotations

import math

import numpy as np

from attnpass.ir import DType
from attnpass.ir.dialects.attention import visible

# ``ref.*`` in generated code:
from attnpass.ir.dialects.evaluate import (  # noqa: F401
    argtopk,
    constant,
    conv1d,
    dequantize,
    quantize,
    quantized_matmul,
    quantized_sdpa,
    remainder,
    rounded,
    scan,
    softmax,
    wide,
)


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise in float64 (numpy has none; ``math.erf`` per element)."""
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _scores(
    q, k, mask, scale: float, causal: str, softcap: float | None = None, window: tuple | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """float64 ``q k^T * scale`` (soft-capped: ``c tanh(s / c)``) plus an additive mask, and the bool
    ``[.., S, T]`` of allowed keys (None: all).

    The sum with an additive mask is rounded once to float32, the precision of the logits a float32 source and
    the fused kernels add it in: a finite fill such as ``-1e9`` then absorbs the scores of a row it covers
    entirely, which softmaxes to the mean of V as in the source, where float64 would keep the scores'
    differences (docs/semantics.md §1.3). A float64 q (an oracle's own input) keeps the float64 sum."""
    widened = np.asarray(q).dtype == np.float64
    q, k = wide(q), wide(k)
    (b, hq, s, _), (hkv, t) = q.shape, k.shape[1:3]
    folded = q.reshape(b, hkv, (hq // hkv) * s, q.shape[3])
    scores = np.matmul(folded, np.swapaxes(k, -1, -2)).reshape(b, hq, s, t) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    allowed = visible(s, t, causal, window)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == np.bool_:
            allowed = mask if allowed is None else np.logical_and(mask, allowed)
        else:
            scores = scores + wide(mask)
            if not widened:
                with np.errstate(over="ignore"):  # past float32's max: -inf, as the source's add gives
                    scores = wide(rounded(scores, DType.float32))
    return scores, allowed


def sdpa(
    q,
    k,
    v,
    mask=None,
    sinks=None,
    *,
    scale: float,
    causal: str,
    dtype: str,
    softcap: float | None = None,
    window: tuple | None = None,
) -> np.ndarray:
    """softmax(q k^T * scale + mask) v in float64; query head h reads kv head h // (Hq / Hkv).

    The query heads of each KV group are folded into the rows of one matmul
    per KV head, so K/V are never copied per query head. A bool mask and
    ``causal`` exclude keys; a row they leave without any key weighs all ``T``
    keys equally (the mean of V), as MLX's and JAX's fused calls do. An
    additive mask is arithmetic, added to the logits in float32: a row it sets to -inf everywhere is NaN, and a
    row a finite fill such as -1e9 covers entirely rounds to equal scores (the mean of V), as in the source.
    ``softcap`` c: the scaled scores become ``c tanh(s / c)`` before the mask.
    ``window`` (left, right, chunk) excludes keys as :func:`~attnpass.ir.dialects.attention.visible` says.
    ``sinks`` ``[Hq]``: head h's logit joins each of its rows' softmax as one
    more column without a value; a row without any key then weighs only the
    sink: 0 (as MLX's fused call gives).
    """
    scores, allowed = _scores(q, k, mask, scale, causal, softcap, window)
    (b, hq, s, t), hkv = scores.shape, k.shape[1]
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
        if sinks is None:  # no key left: uniform
            scores = np.where(np.any(allowed, axis=-1, keepdims=True), scores, 0.0)
    sink = None if sinks is None else np.broadcast_to(wide(sinks).reshape(1, hq, 1, 1), (b, hq, s, 1))
    peak = np.max(scores if sink is None else np.concatenate([scores, sink], axis=-1), axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.exp(scores - peak)
    total = np.sum(e, axis=-1, keepdims=True) + (0.0 if sink is None else np.exp(sink - peak))
    with np.errstate(invalid="ignore"):  # an additive row of -inf: 0/0 = NaN, as in MLX and JAX
        probs = (e / total).reshape(b, hkv, (hq // hkv) * s, t)
    return rounded(np.matmul(probs, wide(v)).reshape(b, hq, s, v.shape[3]), dtype)


def sdpa_lse(q, k, mask=None, *, scale: float, causal: str, softcap: float | None = None) -> np.ndarray:
    """float32 logsumexp over the keys sdpa attends of its logits: -inf for a row with no key.

    Unlike sdpa, a row that the bool mask and ``causal`` leave without any key
    is not given uniform weights here: its log-sum-exp is log(0) = -inf, so a
    combine of partial attentions (split-kv) gives it no weight.
    """
    scores, allowed = _scores(q, k, mask, scale, causal, softcap)
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    peak = np.max(scores, axis=-1)
    finite = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(divide="ignore"):  # log(0) = -inf for a row that attends no key
        return rounded(finite + np.log(np.sum(np.exp(scores - finite[..., None]), axis=-1)), "float32")


def put_along_axis(x: np.ndarray, indices: np.ndarray, values: np.ndarray, axis: int) -> np.ndarray:
    """numpy.put_along_axis on a copy (values broadcast to the indices)."""
    out = np.array(x, copy=True)
    np.put_along_axis(out, indices, np.broadcast_to(values, indices.shape), axis)
    return out


def dynamic_update_slice(buffer: np.ndarray, update: np.ndarray, start: np.ndarray) -> np.ndarray:
    """A copy of ``buffer`` with ``update`` at ``start``, each index clamped to ``[0, dim - update_dim]``."""
    limit = np.subtract(buffer.shape, update.shape)
    at = np.clip(np.asarray(start, dtype=np.int64), 0, limit)
    out = np.array(buffer, copy=True)
    out[tuple(slice(a, a + n) for a, n in zip(at, update.shape))] = update
    return out
