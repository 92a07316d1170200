"""Helpers the generated JAX code calls where ``jax.nn.dot_product_attention`` does not fit."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def explicit_sdpa(q, k, v, mask, *, scale: float, mask_is_bool: bool):
    """softmax(q k^T * scale + mask) v on ``[B, H, S, D]`` with GQA folded into the query rows."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    qg = jnp.reshape(q, (b, hkv, (hq // hkv) * s, d))
    # float32 logits (products of half inputs are exact in float32; no float16 overflow of q.k).
    scores = jnp.matmul(qg.astype(jnp.float32), jnp.swapaxes(k, -1, -2).astype(jnp.float32)) * scale
    scores = jnp.reshape(scores, (b, hq, s, k.shape[2]))
    if mask is not None:
        scores = jnp.where(mask, scores, -jnp.inf) if mask_is_bool else scores + mask.astype(jnp.float32)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.matmul(jnp.reshape(probs, (b, hkv, (hq // hkv) * s, k.shape[2])), v)
    return jnp.reshape(out, (b, hq, s, v.shape[3]))
