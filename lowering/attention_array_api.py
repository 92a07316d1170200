"""``sdpa_lse`` written once over a numpy-named array library ``xp`` (``mlx.core``, ``jax.numpy``).

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


def sdpa_lse(
    xp: Any, q: Any, k: Any, mask: Any, *, scale: float, mask_is_bool: bool, causal_offset: int | None = None
) -> Any:
    """float32 logsumexp over T of the masked ``q k^T * scale``: q ``[B, Hq, S, D]``, k ``[B, Hkv, T, D]``.

    ``causal_offset``: query ``i`` sees keys ``j <= i + offset`` (None: no causal part).
    """
    b, hq, s, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    folded = xp.reshape(q, (b, hkv, (hq // hkv) * s, d)).astype(xp.float32)
    logits = xp.matmul(folded, xp.swapaxes(k.astype(xp.float32), -1, -2)) * scale
    logits = xp.reshape(logits, (b, hq, s, t))
    allowed = None
    if causal_offset is not None:
        allowed = xp.arange(t)[None, :] <= xp.arange(s)[:, None] + causal_offset
    if mask is not None and mask_is_bool:
        allowed = mask if allowed is None else xp.logical_and(mask, allowed)
    elif mask is not None:
        logits = logits + mask.astype(xp.float32)
    if allowed is not None:
        logits = xp.where(allowed, logits, -float("inf"))
    peak = xp.max(logits, axis=-1, keepdims=True)
    peak = xp.where(xp.isfinite(peak), peak, 0.0)  # a row without keys: log(0) = -inf, not NaN
    return xp.log(xp.sum(xp.exp(logits - peak), axis=-1)) + peak[..., 0]
