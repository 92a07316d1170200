"""JAX implementations of the QSA ops, built from ``jax.numpy``/``jax.lax`` primitives.

Exact top-k with ties to the lower block id: ``jax.lax.top_k`` documents
"if two elements are equal, the lower-index element appears first". Its order
is a total order on float bits, so -0.0 is first folded into +0.0 (and NaN
into -inf) to make equal scores compare equal.

Out-of-range block ids and positions beyond the cache are dropped (never read
out of bounds); the numpy reference raises on them instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def pool(raw_keys, *, ratio: int):
    """float32 mean of each complete block (the r rows added in order, then divided), cast back.

    XLA's CPU float32 division is not always correctly rounded, so for a ratio that is not a
    power of two the result may differ from numpy/MLX by one ulp.
    """
    *lead, t, d = raw_keys.shape
    nb = t // ratio
    blocks = jnp.reshape(raw_keys[..., : nb * ratio, :], (*lead, nb, ratio, d)).astype(jnp.float32)
    acc = blocks[..., 0, :]
    for i in range(1, ratio):
        acc = acc + blocks[..., i, :]
    return (acc / ratio).astype(raw_keys.dtype)


def block_scores(idx_q, block_keys):
    b, s, h, d = idx_q.shape
    q = jnp.reshape(idx_q.astype(jnp.float32), (b, s * h, d))
    dots = jnp.reshape(jnp.matmul(q, jnp.swapaxes(block_keys.astype(jnp.float32), -1, -2)), (b, s, h, -1))
    return jnp.sum(jnp.maximum(dots, 0.0), axis=2) / math.sqrt(d)


def select(block_scores, positions, *, ratio: int, top_k_blocks: int):
    b, s, nb = block_scores.shape
    k = min(top_k_blocks, nb)
    blocks = jnp.arange(nb, dtype=jnp.int32)
    n_complete = ((positions + 1) // ratio)[..., None]
    score = jnp.where((blocks < n_complete) & ~jnp.isnan(block_scores), block_scores, -jnp.inf)
    score = jnp.where(score == 0, 0.0, score)  # -0.0 == +0.0
    _, top = jax.lax.top_k(score, k)  # invisible blocks rank last; ties: lower id first
    chosen = jnp.sort(top.astype(jnp.int32), axis=-1)
    chosen = jnp.where(chosen < n_complete, chosen, -1)  # invisible picks sort after the visible ones
    if k < top_k_blocks:
        chosen = jnp.concatenate([chosen, jnp.full((b, s, top_k_blocks - k), -1, dtype=jnp.int32)], axis=-1)
    return chosen


def mask(selection, positions, *, ratio: int, kv_len: int):
    b, s, _k = selection.shape
    n_blocks = -(-kv_len // ratio)
    in_range = (selection >= 0) & (selection < n_blocks)
    picked = jnp.put_along_axis(
        jnp.zeros((b, s, n_blocks + 1), dtype=jnp.bool_),
        jnp.where(in_range, selection, n_blocks),  # unused ids land in a spare slot
        True,
        axis=-1,
        inplace=False,
    )
    cells = jnp.arange(kv_len, dtype=jnp.int32)
    p = positions[..., None]
    tail = cells >= ((p + 1) // ratio) * ratio
    return ((jnp.take(picked, cells // ratio, axis=-1) | tail) & (cells <= p))[:, None]


def _slots(selection, positions, ratio: int, width: int, kv_len: int):
    b, s, k = selection.shape
    p = positions[..., None]
    n_complete = (p + 1) // ratio
    blk = selection[..., None]
    block_cells = jnp.reshape(blk * ratio + jnp.arange(ratio, dtype=jnp.int32), (b, s, k * ratio))
    block_ok = jnp.reshape(
        jnp.broadcast_to((blk >= 0) & (blk < n_complete[..., None]), (b, s, k, ratio)), (b, s, k * ratio)
    )
    tail_cells = n_complete * ratio + jnp.arange(ratio - 1, dtype=jnp.int32)
    parts = [(block_cells, block_ok), (tail_cells, tail_cells <= p)]
    pad = width - k * ratio - (ratio - 1)
    if pad:
        parts.append((jnp.zeros((b, s, pad), dtype=jnp.int32), jnp.zeros((b, s, pad), dtype=jnp.bool_)))
    cells = jnp.concatenate([c for c, _ in parts], axis=-1)
    ok = jnp.concatenate([o for _, o in parts], axis=-1) & (cells >= 0) & (cells < kv_len)
    return cells, ok


def cells(selection, positions, *, ratio: int, width: int, kv_len: int):
    found, ok = _slots(selection, positions, ratio, width, kv_len)
    return jnp.where(ok, found, 0)


def cell_valid(selection, positions, *, ratio: int, width: int, kv_len: int):
    return _slots(selection, positions, ratio, width, kv_len)[1]
