"""``sdpa_lse`` written once over a numpy-named array library ``xp`` (``mlx.core``, ``jax.numpy``).

The logits are formed as the JAX lowering's explicit attention forms them
(float32, the query heads of each KV group folded into the rows of one matmul
per KV head); a bool mask fills forbidden keys with JAX's finite large
negative (``-0.7 * float32 max``, as ``jax.nn.dot_product_attention`` does),
so a row that attends no key gets a finite value, like the targets' own sdpa
(an additive mask of -inf everywhere gives -inf).
"""

from __future__ import annotations

from typing import Any

import numpy as np

LARGE_NEGATIVE = -0.7 * float(np.finfo(np.float32).max)


def sdpa_lse(xp: Any, q: Any, k: Any, mask: Any, *, scale: float, mask_is_bool: bool) -> Any:
    """float32 logsumexp over T of the masked ``q k^T * scale``: q ``[B, Hq, S, D]``, k ``[B, Hkv, T, D]``."""
    b, hq, s, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    folded = xp.reshape(q, (b, hkv, (hq // hkv) * s, d)).astype(xp.float32)
    logits = xp.matmul(folded, xp.swapaxes(k.astype(xp.float32), -1, -2)) * scale
    logits = xp.reshape(logits, (b, hq, s, t))
    if mask is not None:
        logits = xp.where(mask, logits, LARGE_NEGATIVE) if mask_is_bool else logits + mask.astype(xp.float32)
    peak = xp.max(logits, axis=-1, keepdims=True)
    peak = xp.where(xp.isfinite(peak), peak, 0.0)  # an additive -inf row: log(0) = -inf, not NaN
    return xp.log(xp.sum(xp.exp(logits - peak), axis=-1)) + peak[..., 0]
