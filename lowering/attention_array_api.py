"""``sdpa_lse`` and the explicit ``sdpa`` written once over a numpy-named array library ``xp`` (``mlx.core``,
``jax.numpy``).

The logits are formed as the JAX lowering's explicit attention forms them
(float32, the query heads of each KV group folded into the rows of one matmul
per KV head). Keys that the bool mask or causality exclude are left out of the
sum (-inf logits), so a row without any key gives log(0) = -inf, as on the
numpy reference (sdpa itself gives such a row the mean of V; its log-sum-exp
says it attended nothing, so a split-KV combine weighs it 0). An additive
mask is added to the logits.
"""

from __future__ import annotations

from typing import Any

from attnpass.ir.dialects.attention import visible

_EXCLUDED = -3.4028234663852886e38  # float32 min: the finite fill of a key a bool mask excludes (no sinks)


def _logits(xp: Any, q: Any, k: Any, scale: float, softcap: float | None) -> Any:
    """float32 ``q k^T * scale`` ``[B, Hq, S, T]``, soft-capped ``c tanh(s / c)`` when ``softcap`` is set."""
    b, hq, s, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    folded = xp.reshape(q, (b, hkv, (hq // hkv) * s, d)).astype(xp.float32)
    logits = xp.reshape(xp.matmul(folded, xp.swapaxes(k.astype(xp.float32), -1, -2)) * scale, (b, hq, s, t))
    return logits if softcap is None else softcap * xp.tanh(logits / softcap)


def explicit_sdpa(
    xp: Any, q: Any, k: Any, v: Any, mask: Any, sinks: Any = None, *, scale: float, mask_is_bool: bool,
    softcap: float | None = None,
) -> Any:  # fmt: skip
    """sdpa written out: float32 logits, soft-capped, masked, one sink column per head, softmax, then ``@ v``.

    Without sinks a bool mask's excluded keys get a finite fill (a row without keys: the mean of V); with
    sinks they are -inf, so such a row weighs only its sink: 0, as MLX's fused call gives.
    """
    b, hq, s, _ = q.shape
    hkv, t = k.shape[1], k.shape[2]
    logits = _logits(xp, q, k, scale, softcap)
    if mask is not None and mask_is_bool:
        logits = xp.where(mask, logits, -float("inf") if sinks is not None else _EXCLUDED)
    elif mask is not None:
        logits = logits + mask.astype(xp.float32)
    if sinks is not None:
        column = xp.broadcast_to(xp.reshape(sinks.astype(xp.float32), (1, hq, 1, 1)), (b, hq, s, 1))
        logits = xp.concatenate([logits, column], axis=-1)
    peak = xp.max(logits, axis=-1, keepdims=True)
    e = xp.exp(logits - xp.where(xp.isfinite(peak), peak, 0.0))
    probs = (e / xp.sum(e, axis=-1, keepdims=True))[..., :t].astype(q.dtype)
    out = xp.matmul(xp.reshape(probs, (b, hkv, (hq // hkv) * s, t)), v)
    return xp.reshape(out, (b, hq, s, v.shape[3]))


def sdpa_lse(
    xp: Any, q: Any, k: Any, mask: Any, *, scale: float, mask_is_bool: bool, causal: str = "none",
    softcap: float | None = None,
) -> Any:  # fmt: skip
    """float32 logsumexp over T of the masked ``q k^T * scale``: q ``[B, Hq, S, D]``, k ``[B, Hkv, T, D]``;
    ``causal`` as sdpa's (:func:`attnpass.ir.dialects.attention.visible`)."""
    logits = _logits(xp, q, k, scale, softcap)
    allowed = visible(q.shape[2], k.shape[2], causal, None, xp)
    if mask is not None and mask_is_bool:
        allowed = mask if allowed is None else xp.logical_and(mask, allowed)
    elif mask is not None:
        logits = logits + mask.astype(xp.float32)
    if allowed is not None:
        logits = xp.where(allowed, logits, -float("inf"))
    peak = xp.max(logits, axis=-1, keepdims=True)
    peak = xp.where(xp.isfinite(peak), peak, 0.0)  # a row without keys: log(0) = -inf, not NaN
    return xp.log(xp.sum(xp.exp(logits - peak), axis=-1)) + peak[..., 0]
