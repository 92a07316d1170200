"""Runtime of the MLX target: the ``qsa`` helper (the shared QSA ops over native ``mlx.core`` primitives), ``lse``,
``quantized_sdpa`` and ``argtopk``.

Exact top-k with ties to the lower block id, without relying on the tie
behaviour of ``mx.topk``/``argpartition``: each score becomes a unique int64
key ``ordered(score) * 2**32 + (2**32 - 1 - block)``, where ``ordered`` maps a
float32 to an int32 of the same order (its bits, with the magnitude bits
flipped for negatives; -0.0 is first folded into +0.0 and NaN into -inf).
``mx.topk`` on these distinct keys is exact, and the block id is read back
from the key's low 32 bits. The other ops are shared with JAX
(:class:`attnpass.lowering.qsa_array_api.QSAOps`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import mlx.core as mx
import numpy as np

from attnpass.lowering import attention_array_api
from attnpass.lowering.checks import check_qsa_operands
from attnpass.lowering.qsa_array_api import QSAOps

_LOW = 2**32 - 1


def _ordered(score: mx.array) -> mx.array:
    """int32 keys in the order of the float32 scores (-0.0 == +0.0, NaN lowest with -inf)."""
    score = mx.where(mx.isnan(score), -math.inf, score)
    bits = mx.where(score == 0, 0.0, score).view(mx.int32)
    return mx.where(bits < 0, mx.bitwise_xor(bits, 0x7FFFFFFF), bits)


def _top_k(score: mx.array, k: int) -> mx.array:
    blocks = mx.arange(score.shape[-1], dtype=mx.int64)
    key = _ordered(score).astype(mx.int64) * (2**32) + (_LOW - blocks)
    top = mx.topk(key, k, axis=-1)  # distinct keys: exact, whatever the order
    return _LOW - mx.bitwise_and(top, _LOW)


_KEY_BITS = {mx.float32: (mx.int32, 0x7FFFFFFF), mx.float16: (mx.int16, 0x7FFF), mx.bfloat16: (mx.int16, 0x7FFF)}


def argtopk(x: mx.array, k: int, axis: int) -> mx.array:
    """The ``argtopk`` op (``jax.lax.top_k``'s indices): the same unique int64 keys as the QSA top-k, ``key(x) *
    2**32 + (2**32 - 1 - index)``, but ``key`` the IEEE total order of x's own bits (a float's bits with the
    magnitude flipped when negative: -NaN < -inf < -0.0 < +0.0 < +inf < +NaN; an int32 is its own key), so that
    ``mx.topk`` and ``mx.sort`` of distinct keys give the largest first, ties to the lower index, exactly."""
    x = mx.moveaxis(x, axis, -1)
    n = x.shape[-1]
    if k == 0:
        return mx.moveaxis(mx.zeros((*x.shape[:-1], 0), dtype=mx.int32), -1, axis)
    if x.dtype in _KEY_BITS:
        width, magnitude = _KEY_BITS[x.dtype]
        bits = x.view(width).astype(mx.int32)
        x = mx.where(bits < 0, mx.bitwise_xor(bits, magnitude), bits)
    key = x.astype(mx.int64) * (2**32) + (_LOW - mx.arange(n, dtype=mx.int64))
    top = key if k == n else mx.topk(key, k, axis=-1)  # distinct keys: exact, in some order
    top = mx.sort(top, axis=-1)[..., ::-1]
    return mx.moveaxis((_LOW - mx.bitwise_and(top, _LOW)).astype(mx.int32), -1, axis)


def _put(array: mx.array, indices: mx.array, values: mx.array) -> mx.array:
    return mx.put_along_axis(array, indices, values, axis=-1)


def _check(op: str, selection: mx.array, positions: mx.array, ratio: int, kv_len: int) -> None:
    """Evaluate the operands and check them on the host (not possible inside ``mx.compile`` or an export)."""
    check_qsa_operands(op, np.array(selection), np.array(positions), ratio=ratio, kv_len=kv_len)


def _row_major(x: mx.array) -> mx.array:
    """A row-major copy (a reshape to 1-D copies a non-contiguous view; ``mx.contiguous`` cannot be exported)."""
    return mx.reshape(mx.reshape(x, (-1,)), x.shape)


qsa = QSAOps(mx, top_k=_top_k, put=_put, check=_check, row_major=_row_major, flat_gather=True)
qsa_checked = dataclasses.replace(qsa, checks=True)  # the ``qsa`` of programs lowered with checks=True
sdpa_lse = functools.partial(attention_array_api.sdpa_lse, mx)  # the ``lse`` helper
explicit_sdpa = functools.partial(attention_array_api.explicit_sdpa, mx)  # sdpa with logit soft-capping


def quantized_sdpa(
    q, kq, ks, kb, vq, vs, vb, mask=None, *, scale: float, group_size: int, bits: int, precision: str = "dtype"
) -> mx.array:
    """The ``quantized_sdpa`` op, GQA folded: the G query heads of each kv head are the rows of one
    ``mx.quantized_matmul`` against that head's packed keys (never dequantized as a whole, never repeated),
    the mask applied to the scores viewed per query head, then one ``mx.quantized_matmul`` with the packed values.
    Each step is mlx-lm's own op (``q * scale``, ``where`` with the dtype's lowest value or ``+ mask``, a precise
    softmax); MLX's CPU kernels compute each row of a quantized_matmul alone, so folding the heads into the rows
    keeps mlx-lm's bits. ``precision="float32"``: q, the scales and biases (and an additive mask) cast to float32
    first, the result cast back (the words are the same either way)."""
    if precision == "float32" and q.dtype != mx.float32:
        up = [a.astype(mx.float32) for a in (q, ks, kb, vs, vb)]
        mask = mask if mask is None or mask.dtype == mx.bool_ else mask.astype(mx.float32)
        opts = {"scale": scale, "group_size": group_size, "bits": bits}
        out = quantized_sdpa(up[0], kq, up[1], up[2], vq, up[3], up[4], mask, **opts)
        return out.astype(q.dtype)
    b, hq, s, d = q.shape
    hkv, t = kq.shape[1], kq.shape[2]
    opts = {"group_size": group_size, "bits": bits}
    folded = mx.reshape(q * scale, (b, hkv, hq // hkv * s, d))
    scores = mx.quantized_matmul(folded, mx.view(kq, mx.uint32), ks, kb, transpose=True, **opts)
    if mask is not None:
        scores = mx.reshape(scores, (b, hq, s, t))
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
        scores = mx.reshape(scores, (b, hkv, hq // hkv * s, t))
    p = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(p, mx.view(vq, mx.uint32), vs, vb, transpose=False, **opts)
    return mx.reshape(out, (b, hq, s, out.shape[-1]))
