"""MLA and DSA attention as the mlx-lm router traces it (docs/mla.md, "The traced form"), and inputs for it.

:func:`mla_graph` traces the expanded masked form of one call of more than one query row: ``k = latent @
w_uk``, ``v = latent @ w_uvᵀ``, the mask ``where(put_along_axis(False, idx, True), mask, finfo.min)`` when
``top_k`` is given, ``sdpa`` over the whole cache. :func:`mla_inputs` draws inputs of the scales a model has
(an RMS-normed latent, MultiLinear's uniform weights, rope scores as the additive mask), with a causal
prefix hidden behind ``finfo.min`` and per-row distinct top-k indices that may include hidden cells (every
row keeps at least one visible cell, what the router's ``rows_have_keys`` promises).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from attnpass.ir import DType, Graph, TensorSpec, ops, trace


@dataclass(frozen=True)
class Geometry:
    """One call: batch, heads, query rows, cache length, latent rank, nope and value head dims, top-k."""

    b: int = 1
    h: int = 2
    rows: int = 3
    t: int = 32
    r: int = 16
    dn: int = 8
    dv: int = 8
    top_k: int | None = 6
    dtype: DType = DType.float32
    scale: float | None = 0.25

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        d = self.dtype
        specs = [
            TensorSpec((self.b, self.h, self.rows, self.dn), d),
            TensorSpec((self.b, 1, self.t, self.r), d, "resident"),
            TensorSpec((self.h, self.r, self.dn), d, "resident"),
            TensorSpec((self.h, self.dv, self.r), d, "resident"),
            TensorSpec((self.b, self.h, self.rows, self.t), d),
        ]
        return tuple(specs + ([TensorSpec((self.b, 1, self.rows, self.top_k), "int32")] if self.top_k else []))


def draw_geometry(data, dtype: DType, *, rows: tuple[int, int], t: list[int], top_k) -> Geometry:
    """A hypothesis-drawn small geometry; ``top_k(t)`` draws K (or None) for the drawn cache length."""
    from hypothesis import strategies as st

    cache = data.draw(st.sampled_from(t), "t")
    return Geometry(
        b=data.draw(st.integers(1, 2), "b"),
        h=data.draw(st.sampled_from([1, 2, 4]), "h"),
        rows=data.draw(st.integers(*rows), "rows"),
        t=cache,
        r=data.draw(st.sampled_from([8, 32, 64]), "r"),
        dn=data.draw(st.sampled_from([4, 16]), "dn"),
        dv=data.draw(st.sampled_from([4, 8, 16]), "dv"),
        top_k=data.draw(top_k(cache), "top_k"),
        dtype=dtype,
        scale=data.draw(st.sampled_from([None, 0.2]), "scale"),
    )


def lowest(dtype: DType) -> float:
    return float(dtype.finfo.min)


def mla_graph(g: Geometry, *, fill: float | None = None) -> Graph:
    """The expanded masked form (DSA when ``g.top_k``); ``fill`` replaces ``finfo(dtype).min`` as the fill."""
    fill = lowest(g.dtype) if fill is None else fill

    def expanded(q, latent, w_uk, w_uv, mask):
        k = ops.matmul(latent, w_uk)
        v = ops.matmul(latent, ops.transpose(w_uv, (0, 2, 1)))
        return ops.sdpa(q, k, v, mask=mask, scale=g.scale)

    def dsa(q, latent, w_uk, w_uv, mask, idx):
        base = ops.constant(np.zeros((g.b, 1, g.rows, g.t), bool))
        sel = ops.put_along_axis(base, idx, ops.constant(True), axis=-1)
        return expanded(q, latent, w_uk, w_uv, ops.where(sel, mask, ops.constant(fill, g.dtype)))

    return trace(dsa if g.top_k else expanded, *g.specs, name="dsa" if g.top_k else "mla")


def _cast(x: np.ndarray, dtype: DType) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16 if dtype is DType.bfloat16 else dtype.numpy)


def mla_inputs(g: Geometry, seed: int = 0, *, offset: int | None = None, hidden_picks: bool = True) -> dict:
    """Inputs by name; query row ``i`` sits at position ``offset + i`` (default: the last rows of the cache)."""
    rng = np.random.default_rng(seed)
    offset = g.t - g.rows if offset is None else offset
    latent = rng.standard_normal((g.b, 1, g.t, g.r))
    latent /= np.sqrt(np.mean(latent**2, axis=-1, keepdims=True))  # kv_a_layernorm's RMS norm
    arrays = {
        "q": rng.standard_normal((g.b, g.h, g.rows, g.dn)),
        "latent": latent,
        "w_uk": rng.uniform(-1, 1, (g.h, g.r, g.dn)) / math.sqrt(g.dn),  # MultiLinear(dn -> r)
        "w_uv": rng.uniform(-1, 1, (g.h, g.dv, g.r)) / math.sqrt(g.r),  # MultiLinear(r -> dv)
    }
    scores = rng.standard_normal((g.b, g.h, g.rows, g.t)) * 0.5  # the rope scores q_pe·k_peᵀ·scale
    visible = np.arange(g.t)[None, :] <= offset + np.arange(g.rows)[:, None]  # [rows, T]
    arrays["mask"] = np.where(visible, scores, lowest(g.dtype))
    arrays = {n: _cast(a, g.dtype) for n, a in arrays.items()}
    if g.top_k:
        arrays["idx"] = selection(rng, visible, g.b, g.top_k, hidden_picks=hidden_picks)
    return arrays


def selection(rng: np.random.Generator, visible: np.ndarray, b: int, top_k: int, *, hidden_picks: bool) -> np.ndarray:
    """i32 ``[B, 1, L, K]``: per row ``K`` distinct cells, at least one visible; hidden ones too when allowed
    (the indexer's top-k of a row with fewer than ``K`` visible cells)."""
    rows, t = visible.shape
    out = np.empty((b, 1, rows, top_k), np.int32)
    for bi in range(b):
        for i in range(rows):
            seen = np.flatnonzero(visible[i])
            first = rng.choice(seen, 1)
            rest = np.setdiff1d(np.arange(t) if hidden_picks else seen, first)
            more = rng.choice(rest, min(top_k - 1, rest.size), replace=False)
            picks = np.concatenate([first, more])
            if picks.size < top_k:  # fewer visible cells than K: fill from the hidden ones
                picks = np.concatenate(
                    [picks, rng.choice(np.setdiff1d(np.arange(t), picks), top_k - picks.size, replace=False)]
                )
            out[bi, 0, i] = rng.permutation(picks)
    return out
