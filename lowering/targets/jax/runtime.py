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
import numpy as np

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


def unpack(wq: jax.Array, bits: int) -> jax.Array:
    """The ``bits``-bit integers packed in the int32 words ``wq`` (MLX's uint32 bits), uint32 ``[..., N, K]``:
    element ``j`` is the bits from bit ``j * bits`` of the row's little-endian stream, the next word's low bits
    completing an element that straddles two words (3, 5 and 6 bits)."""
    words = jax.lax.bitcast_convert_type(wq, jnp.uint32)
    start = np.arange(words.shape[-1] * 32 // bits) * bits
    word, shift = start // 32, start % 32
    q = jnp.take(words, word, axis=-1) >> shift.astype(np.uint32)
    spill = shift + bits > 32
    if spill.any():  # the high bits from the next word (never shifted by 32: those elements have no spill)
        nxt = jnp.take(words, np.minimum(word + 1, words.shape[-1] - 1), axis=-1)
        q = q | jnp.where(spill, nxt << np.where(spill, 32 - shift, 0).astype(np.uint32), jnp.uint32(0))
    return q & jnp.uint32((1 << bits) - 1)


def dequantize(wq, scales, biases, *, group_size: int, bits: int, dtype) -> jax.Array:
    """``scale * q + bias`` as MLX computes it in the scales' dtype: the product rounded to that dtype, then the
    sum; then converted to ``dtype``.

    Computed in float32. XLA contracts a multiply feeding an add into one fused multiply-add (one rounding), so
    the product is formed as ``hi * q + lo * q``: ``hi``, the scale's upper 16 significand bits, and ``lo = s - hi``
    give products exact in float32 (q has at most 8 bits), their sum is the correctly rounded ``s * q`` whichever
    of them is fused, and the sum with the bias then has no multiply to fuse. A half-float product is then
    rounded to its dtype by ``reduce_precision``; float32 + float32 rounded once to a half float is the
    correctly rounded half-float sum (24 >= 2 * 11 + 2 bits).
    """
    inner = scales.dtype
    q = unpack(wq, bits).astype(jnp.float32)
    s, b = (jnp.repeat(a.astype(jnp.float32), group_size, axis=-1) for a in (scales, biases))
    finite = jnp.isfinite(s)
    bits_of_s = jax.lax.bitcast_convert_type(s, jnp.uint32)
    upper = jax.lax.bitcast_convert_type(bits_of_s & jnp.uint32(0xFFFFFF00), jnp.float32)
    hi, lo = jnp.where(finite, upper, s), jnp.where(finite, s - upper, 0.0)  # inf and NaN: s * q itself
    product = hi * q + lo * q
    if inner != jnp.float32:
        info = jnp.finfo(inner)
        product = jax.lax.reduce_precision(product, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return (product + b).astype(inner).astype(dtype)


def quantized_matmul(x, wq, scales, biases, *, transpose: bool, group_size: int, bits: int) -> jax.Array:
    """``x @ w^T`` (or ``x @ w``), w the :func:`dequantize` in x's dtype, accumulated in float32, rounded once."""
    w = dequantize(wq, scales, biases, group_size=group_size, bits=bits, dtype=x.dtype)
    w = jnp.swapaxes(w, -1, -2) if transpose else w
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _full(divisor, shape) -> jax.Array:
    """``divisor`` broadcast to ``shape`` where XLA cannot see the broadcast (no reciprocal rewrite)."""
    return jax.lax.optimization_barrier(jnp.broadcast_to(divisor, shape))


def quantize(w, *, group_size: int, bits: int, output: str) -> jax.Array:
    """``mx.quantize``'s ``output`` (``wq`` as int32 words, ``scales``, ``biases``), computed per group in float32
    as :func:`attnpass.ir.dialects.evaluate.quantize` describes.

    XLA rewrites a division by a broadcast value into a multiply by its reciprocal (two roundings, so
    ``rint`` may then land on the other side of a half): each divisor is broadcast to the dividend's shape
    behind an optimization barrier, which leaves XLA a plain, correctly rounded division."""
    x = w.astype(jnp.float32).reshape(w.shape[:-1] + (w.shape[-1] // group_size, group_size))
    top, bottom = x.max(axis=-1), x.min(axis=-1)
    low_edge = jnp.abs(bottom) > jnp.abs(top)
    scale = jnp.maximum((top - bottom) / _full(np.float32((1 << bits) - 1), top.shape), np.float32(1e-7))
    scale = jnp.where(low_edge, scale, -scale)
    edge = jnp.where(low_edge, bottom, top)
    q0 = jnp.round(edge / scale)  # jnp.round: half to even, as rint
    moved = q0 != 0
    scale = jnp.where(moved, edge / jnp.where(moved, q0, 1.0), scale)
    bias = jnp.where(moved, edge, 0.0)
    if bits == 1:  # MLX's 1-bit rule: the range and the min, no edge
        scale, bias = jnp.maximum(top - bottom, np.float32(1e-7)), bottom
    if output != "wq":
        return (scale if output == "scales" else bias).astype(w.dtype)
    q = jnp.round((x - bias[..., None]) / _full(scale[..., None], x.shape))
    q = jnp.clip(q, 0, (1 << bits) - 1).astype(jnp.uint32).reshape(w.shape)
    stream = (q[..., None] >> np.arange(bits, dtype=np.uint32)) & jnp.uint32(1)  # [..., K, bits], low bit first
    stream = stream.reshape(w.shape[:-1] + (w.shape[-1] * bits // 32, 32)) << np.arange(32, dtype=np.uint32)
    words = jax.lax.reduce(stream, jnp.uint32(0), jax.lax.bitwise_or, (stream.ndim - 1,))
    return jax.lax.bitcast_convert_type(words, jnp.int32)


def quantized_sdpa(
    q, kq, ks, kb, vq, vs, vb, mask=None, *, scale: float, group_size: int, bits: int, precision: str = "dtype"
) -> jax.Array:
    """The ``quantized_sdpa`` op, GQA folded into the rows of :func:`quantized_matmul` as on MLX; the softmax in
    float32, rounded to q's dtype (``precision="float32"``: every float operand widened first, rounded once)."""
    if precision == "float32" and q.dtype != jnp.float32:
        up = [a.astype(jnp.float32) for a in (q, ks, kb, vs, vb)]
        mask = mask if mask is None or mask.dtype == jnp.bool_ else mask.astype(jnp.float32)
        opts = {"scale": scale, "group_size": group_size, "bits": bits}
        return quantized_sdpa(up[0], kq, up[1], up[2], vq, up[3], up[4], mask, **opts).astype(q.dtype)
    b, hq, s, d = q.shape
    hkv, t = kq.shape[1], kq.shape[2]
    opts = {"group_size": group_size, "bits": bits}
    folded = jnp.reshape(q * jnp.asarray(scale, q.dtype), (b, hkv, hq // hkv * s, d))
    scores = jnp.reshape(quantized_matmul(folded, kq, ks, kb, transpose=True, **opts), (b, hq, s, t))
    if mask is not None and mask.dtype == jnp.bool_:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    elif mask is not None:
        scores = scores + mask
    p = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    out = quantized_matmul(jnp.reshape(p, (b, hkv, hq // hkv * s, t)), vq, vs, vb, transpose=False, **opts)
    return jnp.reshape(out, (b, hq, s, out.shape[-1]))


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
