"""JAX implementations of the QSA ops, built from ``jax.numpy``/``jax.lax`` primitives.

Exact top-k with ties to the lower block id: ``jax.lax.top_k`` documents
"if two elements are equal, the lower-index element appears first". Its order
is a total order on float bits, so -0.0 is first folded into +0.0 (and NaN
into -inf) to make equal scores compare equal. The other ops are shared with
MLX (:mod:`attnpass.lowering.qsa_array_api`).

XLA's CPU float32 division is not always correctly rounded, so ``pool`` with a
ratio that is not a power of two may differ from numpy/MLX by one ulp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import qsa_array_api as xp_ops


def pool(raw_keys: jax.Array, *, ratio: int) -> jax.Array:
    return xp_ops.pool(jnp, raw_keys, ratio)


def block_scores(idx_q: jax.Array, block_keys: jax.Array) -> jax.Array:
    return xp_ops.block_scores(jnp, idx_q, block_keys)


def select(block_scores: jax.Array, positions: jax.Array, *, ratio: int, top_k_blocks: int) -> jax.Array:
    nb = block_scores.shape[-1]
    blocks = jnp.arange(nb, dtype=jnp.int32)
    n_complete = ((positions + 1) // ratio)[..., None]
    score = jnp.where((blocks < n_complete) & ~jnp.isnan(block_scores), block_scores, -jnp.inf)
    score = jnp.where(score == 0, 0.0, score)  # -0.0 == +0.0
    _, top = jax.lax.top_k(score, min(top_k_blocks, nb))  # invisible blocks rank last; ties: lower id
    return xp_ops.finish_selection(jnp, top, n_complete, top_k_blocks)


def _put(array: jax.Array, indices: jax.Array, values: jax.Array) -> jax.Array:
    return jnp.put_along_axis(array, indices, values, axis=-1, inplace=False)


def mask(selection: jax.Array, positions: jax.Array, *, ratio: int, kv_len: int) -> jax.Array:
    return xp_ops.mask(jnp, _put, selection, positions, ratio, kv_len)


def cells(selection: jax.Array, positions: jax.Array, *, ratio: int, width: int, kv_len: int) -> jax.Array:
    return xp_ops.slots(jnp, selection, positions, ratio, width, kv_len)[0]


def cell_valid(selection: jax.Array, positions: jax.Array, *, ratio: int, width: int, kv_len: int) -> jax.Array:
    return xp_ops.slots(jnp, selection, positions, ratio, width, kv_len)[1]
