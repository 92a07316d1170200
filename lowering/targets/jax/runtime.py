"""Runtime of the JAX target: the ``jrt``, ``qsa`` and ``lse`` helpers, from ``jax.numpy``/``jax.lax``.

``explicit_sdpa`` is the attention the JAX lowering writes where
``jax.nn.dot_product_attention`` does not fit. Exact top-k with ties to the
lower block id: ``jax.lax.top_k`` documents "if two elements are equal, the
lower-index element appears first". Its order is a total order on float bits,
so -0.0 is first folded into +0.0 (and NaN into -inf) to make equal scores
compare equal. The other QSA ops are shared with MLX
(:class:`attnpass.lowering.qsa_array_api.QSAOps`).

XLA's CPU float32 division is not always correctly rounded, so ``qsa.pool``
with a ratio that is not a power of two may differ from numpy/MLX by one ulp.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from attnpass.lowering import attention_array_api
from attnpass.lowering.checks import check_qsa_operands
from attnpass.lowering.qsa_array_api import QSAOps

_EXCLUDED = float(jnp.finfo(jnp.float32).min)


def explicit_sdpa(q, k, v, mask, *, scale: float, mask_is_bool: bool):
    """softmax(q k^T * scale + mask) v on ``[B, H, S, D]`` with GQA folded into the query rows."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    qg = jnp.reshape(q, (b, hkv, (hq // hkv) * s, d))
    # float32 logits (products of half inputs are exact in float32; no float16 overflow of q.k).
    scores = jnp.matmul(qg.astype(jnp.float32), jnp.swapaxes(k, -1, -2).astype(jnp.float32)) * scale
    scores = jnp.reshape(scores, (b, hq, s, k.shape[2]))
    if mask is not None:  # excluded keys get a finite fill, as in jax.nn.dot_product_attention: no key -> mean of V
        scores = jnp.where(mask, scores, _EXCLUDED) if mask_is_bool else scores + mask.astype(jnp.float32)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.matmul(jnp.reshape(probs, (b, hkv, (hq // hkv) * s, k.shape[2])), v)
    return jnp.reshape(out, (b, hq, s, v.shape[3]))


def _top_k(score: jax.Array, k: int) -> jax.Array:
    score = jnp.where(jnp.isnan(score), -jnp.inf, score)
    score = jnp.where(score == 0, 0.0, score)  # -0.0 == +0.0
    return jax.lax.top_k(score, k)[1]  # ties: lower id


def _put(array: jax.Array, indices: jax.Array, values: jax.Array) -> jax.Array:
    return jnp.put_along_axis(array, indices, values, axis=-1, inplace=False)


def _check(op: str, selection: jax.Array, positions: jax.Array, ratio: int, kv_len: int) -> None:
    """Check concrete operands at once; traced ones (under ``jax.jit``) through ``jax.debug.callback``."""
    check = functools.partial(check_qsa_operands, op, ratio=ratio, kv_len=kv_len)
    if isinstance(selection, jax.core.Tracer) or isinstance(positions, jax.core.Tracer):
        jax.debug.callback(check, selection, positions)
    else:
        check(selection, positions)


qsa = QSAOps(jnp, top_k=_top_k, put=_put, check=_check)
qsa_checked = dataclasses.replace(qsa, checks=True)  # the ``qsa`` of programs lowered with checks=True
sdpa_lse = functools.partial(attention_array_api.sdpa_lse, jnp)  # the ``lse`` helper
sinks_sdpa = functools.partial(attention_array_api.explicit_sdpa, jnp)  # sdpa with sinks or soft-capping
