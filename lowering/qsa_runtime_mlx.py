"""MLX implementations of the QSA ops, built from native ``mlx.core`` primitives.

Exact top-k with ties to the lower block id, without relying on the tie
behaviour of ``mx.topk``/``argpartition``: each score becomes a unique int64
key ``ordered(score) * 2**32 + (2**32 - 1 - block)``, where ``ordered`` maps a
float32 to an int32 of the same order (its bits, with the magnitude bits
flipped for negatives; -0.0 is first folded into +0.0 and NaN into -inf).
``mx.topk`` on these distinct keys is exact, and the block id is read back
from the key's low 32 bits.

Out-of-range block ids and positions beyond the cache are dropped (never read
out of bounds); the numpy reference raises on them instead.
"""

from __future__ import annotations

import math

import mlx.core as mx

_LOW = 2**32 - 1


def pool(raw_keys: mx.array, *, ratio: int) -> mx.array:
    """float32 mean of each complete block (the r rows added in order, then divided), cast back."""
    *lead, t, d = raw_keys.shape
    nb = t // ratio
    blocks = raw_keys[..., : nb * ratio, :].reshape(*lead, nb, ratio, d).astype(mx.float32)
    acc = blocks[..., 0, :]
    for i in range(1, ratio):
        acc = acc + blocks[..., i, :]
    return (acc / ratio).astype(raw_keys.dtype)


def block_scores(idx_q: mx.array, block_keys: mx.array) -> mx.array:
    b, s, h, d = idx_q.shape
    q = idx_q.astype(mx.float32).reshape(b, s * h, d)
    dots = mx.matmul(q, block_keys.astype(mx.float32).swapaxes(-1, -2)).reshape(b, s, h, -1)
    return mx.maximum(dots, 0.0).sum(axis=2) / math.sqrt(d)


def _ordered(score: mx.array) -> mx.array:
    """int32 keys in the order of the float32 scores (-0.0 == +0.0, NaN lowest with -inf)."""
    score = mx.where(mx.isnan(score), -math.inf, score)
    bits = mx.where(score == 0, 0.0, score).view(mx.int32)
    return mx.where(bits < 0, mx.bitwise_xor(bits, 0x7FFFFFFF), bits)


def select(block_scores: mx.array, positions: mx.array, *, ratio: int, top_k_blocks: int) -> mx.array:
    b, s, nb = block_scores.shape
    k = min(top_k_blocks, nb)
    blocks = mx.arange(nb, dtype=mx.int32)
    n_complete = ((positions + 1) // ratio)[..., None]
    score = mx.where(blocks < n_complete, block_scores, -math.inf)  # invisible blocks rank last
    key = _ordered(score).astype(mx.int64) * (2**32) + (_LOW - blocks.astype(mx.int64))
    top = mx.topk(key, k, axis=-1)  # distinct keys: exact, whatever the order within the result
    chosen = mx.sort((_LOW - mx.bitwise_and(top, _LOW)).astype(mx.int32), axis=-1)
    chosen = mx.where(chosen < n_complete, chosen, -1)  # invisible picks sort after the visible ones
    if k < top_k_blocks:
        chosen = mx.concatenate([chosen, mx.full((b, s, top_k_blocks - k), -1, dtype=mx.int32)], axis=-1)
    return chosen


def mask(selection: mx.array, positions: mx.array, *, ratio: int, kv_len: int) -> mx.array:
    b, s, _k = selection.shape
    n_blocks = -(-kv_len // ratio)
    in_range = (selection >= 0) & (selection < n_blocks)
    picked = mx.put_along_axis(
        mx.zeros((b, s, n_blocks + 1), dtype=mx.bool_),
        mx.where(in_range, selection, n_blocks),  # unused ids land in a spare slot
        mx.array(True),
        axis=-1,
    )
    cells = mx.arange(kv_len, dtype=mx.int32)
    p = positions[..., None]
    tail = cells >= ((p + 1) // ratio) * ratio
    return ((mx.take(picked, cells // ratio, axis=-1) | tail) & (cells <= p))[:, None]


def _slots(selection, positions, ratio: int, width: int, kv_len: int) -> tuple[mx.array, mx.array]:
    b, s, k = selection.shape
    p = positions[..., None]
    n_complete = (p + 1) // ratio
    blk = selection[..., None]
    block_cells = (blk * ratio + mx.arange(ratio, dtype=mx.int32)).reshape(b, s, k * ratio)
    block_ok = mx.broadcast_to((blk >= 0) & (blk < n_complete[..., None]), (b, s, k, ratio)).reshape(b, s, k * ratio)
    tail_cells = n_complete * ratio + mx.arange(ratio - 1, dtype=mx.int32)
    parts = [(block_cells, block_ok), (tail_cells, tail_cells <= p)]
    pad = width - k * ratio - (ratio - 1)
    if pad:
        parts.append((mx.zeros((b, s, pad), dtype=mx.int32), mx.zeros((b, s, pad), dtype=mx.bool_)))
    cells = mx.concatenate([c for c, _ in parts], axis=-1)
    ok = mx.concatenate([o for _, o in parts], axis=-1) & (cells >= 0) & (cells < kv_len)
    return cells, ok


def cells(selection, positions, *, ratio: int, width: int, kv_len: int) -> mx.array:
    found, ok = _slots(selection, positions, ratio, width, kv_len)
    return mx.where(ok, found, 0)


def cell_valid(selection, positions, *, ratio: int, width: int, kv_len: int) -> mx.array:
    return _slots(selection, positions, ratio, width, kv_len)[1]
