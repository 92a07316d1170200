"""MLX implementations of the QSA ops, built from native ``mlx.core`` primitives.

Exact top-k with ties to the lower block id, without relying on the tie
behaviour of ``mx.topk``/``argpartition``: each score becomes a unique int64
key ``ordered(score) * 2**32 + (2**32 - 1 - block)``, where ``ordered`` maps a
float32 to an int32 of the same order (its bits, with the magnitude bits
flipped for negatives; -0.0 is first folded into +0.0 and NaN into -inf).
``mx.topk`` on these distinct keys is exact, and the block id is read back
from the key's low 32 bits. The other ops are shared with JAX
(:mod:`attnpass.lowering.qsa_array_api`).
"""

from __future__ import annotations

import math

import mlx.core as mx

from . import qsa_array_api as xp_ops

_LOW = 2**32 - 1


def pool(raw_keys: mx.array, *, ratio: int) -> mx.array:
    return xp_ops.pool(mx, raw_keys, ratio)


def block_scores(idx_q: mx.array, block_keys: mx.array) -> mx.array:
    return xp_ops.block_scores(mx, idx_q, block_keys)


def _ordered(score: mx.array) -> mx.array:
    """int32 keys in the order of the float32 scores (-0.0 == +0.0, NaN lowest with -inf)."""
    score = mx.where(mx.isnan(score), -math.inf, score)
    bits = mx.where(score == 0, 0.0, score).view(mx.int32)
    return mx.where(bits < 0, mx.bitwise_xor(bits, 0x7FFFFFFF), bits)


def select(block_scores: mx.array, positions: mx.array, *, ratio: int, top_k_blocks: int) -> mx.array:
    nb = block_scores.shape[-1]
    blocks = mx.arange(nb, dtype=mx.int32)
    n_complete = ((positions + 1) // ratio)[..., None]
    score = mx.where(blocks < n_complete, block_scores, -math.inf)  # invisible blocks rank last
    key = _ordered(score).astype(mx.int64) * (2**32) + (_LOW - blocks.astype(mx.int64))
    top = mx.topk(key, min(top_k_blocks, nb), axis=-1)  # distinct keys: exact, whatever the order
    return xp_ops.finish_selection(mx, _LOW - mx.bitwise_and(top, _LOW), n_complete, top_k_blocks)


def _put(array: mx.array, indices: mx.array, values: mx.array) -> mx.array:
    return mx.put_along_axis(array, indices, values, axis=-1)


def mask(selection: mx.array, positions: mx.array, *, ratio: int, kv_len: int) -> mx.array:
    return xp_ops.mask(mx, _put, selection, positions, ratio, kv_len)


def cells(selection: mx.array, positions: mx.array, *, ratio: int, width: int, kv_len: int) -> mx.array:
    return xp_ops.slots(mx, selection, positions, ratio, width, kv_len)[0]


def cell_valid(selection: mx.array, positions: mx.array, *, ratio: int, width: int, kv_len: int) -> mx.array:
    return xp_ops.slots(mx, selection, positions, ratio, width, kv_len)[1]
