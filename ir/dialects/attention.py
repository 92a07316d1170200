"""Attention ops: matmul, softmax, the fused ``sdpa`` (GQA, masks, causal kinds) and its ``sdpa_lse`` companion."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from attnpass.ir.core.registry import AttrSpec, OpDef, attr, get_op, operand, opt_operand, register
from attnpass.ir.core.types import DType, ShapeError, TensorType

from .rules import FLOATS, NUMERIC, broadcast_shapes, normalize_axis, require_dtype, same_dtype


def _infer_matmul(ts):
    a, b = ts
    dtype = same_dtype("matmul", ts)
    require_dtype("matmul", a, NUMERIC)
    if a.rank < 2 or b.rank < 2:
        raise ShapeError(f"matmul: operands need rank >= 2, got {a} and {b}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: contraction dims differ: {a} @ {b} ({a.shape[-1]} != {b.shape[-2]})")
    batch = broadcast_shapes("matmul", a.shape[:-2], b.shape[:-2])
    return TensorType(batch + (a.shape[-2], b.shape[-1]), dtype)


def _infer_softmax(ts, *, axis, precise):
    (x,) = ts
    require_dtype("softmax", x, FLOATS)
    normalize_axis("softmax", axis, x.rank)
    return x


CAUSAL_KINDS = ("none", "top_left", "bottom_right")


class Window(NamedTuple):
    """sdpa's structured mask beyond causality (docs/semantics.md §1.4): query row ``i`` sits at position
    ``p = i + off`` (``off`` = T - S when causal is bottom_right, else 0) and sees key ``j`` only if
    ``p - j < left`` (None: no bound), ``j - p <= right`` (None: no bound; only without causal) and, with
    ``chunk``, ``j // chunk == p // chunk`` (llama4's chunked attention). Prints as ``(left, right, chunk)``."""

    left: int | None = None
    right: int | None = None
    chunk: int | None = None


def _window(v: Any) -> Window | None:
    if v is None:
        return None
    if not isinstance(v, (tuple, list)) or len(v) != 3:
        raise ValueError(f"expected None or (left, right, chunk), each an int or None, got {v!r}")
    for name, x in zip(Window._fields, v):
        if x is not None and (isinstance(x, bool) or not isinstance(x, int)):
            raise ValueError(f"window {name} must be an int or None, got {x!r}")
    w = Window(*v)
    if w == Window():
        raise ValueError("window (None, None, None) bounds nothing; write window=None")
    if w.left is not None and w.left < 1:
        raise ValueError(f"window left {w.left} must be >= 1 (a query sees keys p - left < j; 1: itself only)")
    if w.right is not None and w.right < 0:
        raise ValueError(f"window right {w.right} must be >= 0 (keys j <= p + right)")
    if w.chunk is not None and w.chunk < 1:
        raise ValueError(f"window chunk {w.chunk} must be >= 1")
    return w


def window_offset(causal: str, s: int, t: int) -> int:
    """The position of query row 0: T - S when bottom-right aligned, else 0 (docs/semantics.md §1.4)."""
    return t - s if causal == "bottom_right" else 0


def key_ranges(s: int, t: int, causal: str, window: Window | None, xp: Any = np) -> tuple[Any, Any]:
    """The one statement of sdpa's structured visibility (docs/semantics.md §1.4): int ``[S]`` each, row i sees
    exactly the keys ``lo[i] <= j < hi[i]`` that causality and ``window`` leave (every bound is an interval of
    keys); ``hi <= lo``: none. ``xp``: the array library (numpy, ``mlx.core``, ``jax.numpy``)."""
    p = xp.arange(s) + window_offset(causal, s, t)
    lo, hi = xp.zeros_like(p), xp.full(p.shape, t, dtype=p.dtype)
    left, right, chunk = window or Window()
    if causal != "none":
        hi = xp.minimum(hi, p + 1)
    if left is not None:
        lo = xp.maximum(lo, p - left + 1)
    if right is not None:
        hi = xp.minimum(hi, p + right + 1)
    if chunk is not None:
        start = xp.floor_divide(p, chunk) * chunk
        lo, hi = xp.maximum(lo, start), xp.minimum(hi, start + chunk)
    return lo, hi


def visible(s: int, t: int, causal: str, window: Window | tuple | None, xp: Any = np) -> Any | None:
    """bool ``[S, T]`` in the array library ``xp``: whether row i sees key j, from :func:`key_ranges` (None: no
    structure, every key). The numpy reference and the emitted programs build sdpa's mask with this."""
    if causal == "none" and window is None:
        return None
    lo, hi = key_ranges(s, t, causal, Window(*window) if window is not None else None, xp)
    j = xp.arange(t)[None, :]
    return (j >= lo[:, None]) & (j < hi[:, None])


def effective_scale(scale: float | None, head_dim: int) -> float:
    """The scale an sdpa applies to its scores: ``scale``, or ``1/sqrt(head_dim)`` (q's head dim) when None."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def sdpa_variants(node) -> str | None:
    """``"sinks"``, ``"window=(l, r, c)"``, ``"logit_softcap=c"`` joined by "and", for the variants an sdpa
    ``node`` turns on (None: none)."""
    window = node.attrs.get("window")
    parts = (
        (["sinks"] if node.sinks is not None else [])
        + ([f"window={tuple(window)}"] if window else [])
        + ([f"logit_softcap={node.attrs['logit_softcap']:g}"] if node.attrs.get("logit_softcap") is not None else [])
    )
    return " and ".join(parts) or None


def _infer_sdpa(ts, *, scale, causal, logit_softcap=None, window=None):
    q, k, v, mask, sinks = ts
    if window is not None and window.right is not None and causal != "none":
        raise ShapeError(
            f"sdpa: window right {window.right} with causal={causal!r}: causality already hides every key right "
            "of the query (valid: right=None)"
        )
    if logit_softcap is not None and not logit_softcap > 0:
        raise ShapeError(f"sdpa: logit_softcap {logit_softcap!r} must be > 0 (None = off)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.rank != 4:
            raise ShapeError(f"sdpa: {name} must be rank 4 [B, H, S, D], got {name}={t}")
        require_dtype("sdpa", t, FLOATS, name)
    same_dtype("sdpa", [q, k, v])
    (b, hq, s, d), (bk, hkv, t, dk), (bv, hv, tv, _dv) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise ShapeError(f"sdpa: batch sizes differ: q={q} k={k} v={v}")
    if hkv != hv or t != tv:
        raise ShapeError(f"sdpa: k and v must agree on heads and length: k={k} v={v}")
    if hkv == 0 or hq % hkv != 0:
        raise ShapeError(
            f"sdpa: query heads {hq} not divisible by kv heads {hkv} (q={q}, k={k}); GQA needs Hq % Hkv == 0"
        )
    if d != dk:
        raise ShapeError(f"sdpa: head dims differ: q={q} k={k} ({d} != {dk})")
    if mask is not None:
        if mask.dtype not in (DType.bool, q.dtype) and not (q.dtype is DType.float32 and mask.dtype in FLOATS):
            raise ShapeError(
                f"sdpa: mask {mask} must be bool (True = attend) or additive with q's dtype {q.dtype.value} "
                "(with float32 q, a half-float mask is promoted exactly)"
            )
        if mask.rank > 4:
            raise ShapeError(f"sdpa: mask rank {mask.rank} > 4: {mask}")
        full = (b, hq, s, t)
        if broadcast_shapes("sdpa mask", mask.shape, full) != full:
            raise ShapeError(f"sdpa: mask {mask} does not broadcast to [B, Hq, S, T] = {list(full)}")
    if sinks is not None:
        if sinks.shape != (hq,):
            raise ShapeError(f"sdpa: sinks {sinks} must be [Hq] = [{hq}] (one logit per query head)")
        if sinks.dtype is not q.dtype and not (q.dtype is DType.float32 and sinks.dtype in FLOATS):
            raise ShapeError(
                f"sdpa: sinks {sinks} must have q's dtype {q.dtype.value} "
                "(with float32 q, any float dtype, promoted exactly, as MLX does)"
            )
    return TensorType((b, hq, s, v.shape[3]), q.dtype)


def _infer_sdpa_lse(ts, *, scale, causal, logit_softcap=None, window=None):
    if window is not None:
        raise ShapeError(f"sdpa_lse: window {tuple(window)} is not supported (valid: window=None)")
    if ts[4] is not None:
        raise ShapeError(
            f"sdpa_lse: a sinks operand ({ts[4]}) is not supported: the log-sum-exp is over the keys only; "
            "a split-KV combine adds the sinks once (valid: no sinks)"
        )
    b, hq, s, _ = _infer_sdpa(ts, scale=scale, causal=causal, logit_softcap=logit_softcap).shape
    return TensorType((b, hq, s), DType.float32)


register(
    OpDef(
        "matmul",
        (operand("a"), operand("b")),
        _infer_matmul,
        {},
        "attention",
        "Batched a @ b with broadcast batch dims.",
    )
)
register(
    OpDef(
        "softmax",
        (operand("x"),),
        _infer_softmax,
        {"axis": attr("int", -1), "precise": attr("bool", False)},
        "attention",
        "Softmax over axis; precise=True computes in float32 for half inputs.",
    )
)
register(
    OpDef(
        "sdpa",
        (operand("q"), operand("k"), operand("v"), opt_operand("mask"), opt_operand("sinks")),
        _infer_sdpa,
        {
            "scale": attr("float?", None),
            "causal": attr("choice:" + "|".join(CAUSAL_KINDS), "none"),
            "logit_softcap": attr("float?", None, quiet=True),
            "window": AttrSpec("window?", _window, None, quiet=True),
        },
        "attention",
        "softmax(q @ k^T * scale + mask) @ v; layout [B, H, S, D]; GQA: query head h uses kv head "
        "h // (Hq / Hkv); scale None = 1/sqrt(D); mask bool (True = attend) or additive in q's dtype (a "
        "half-float mask with float32 q is promoted exactly, as MLX does), broadcast "
        "to [B, Hq, S, T]; causal 'top_left' (JAX: query i sees keys <= i) or 'bottom_right' "
        "(MLX: query i sees keys <= i + T - S). A row that the bool mask and causal leave without any key "
        "weighs all T keys equally (the mean of V, as MLX's and JAX's fused calls return); an additive mask "
        "is added to the scores and the sum rounded once to float32 (the fused kernels' logits), so a row of -inf "
        "is NaN and a row a finite fill such as -1e9 covers entirely has equal scores (the mean of V). "
        "logit_softcap c (None = off): the scaled scores become "
        "c * tanh(s / c) before the mask (gemma2's order). sinks: f32-or-q-dtype "
        "[Hq], one logit per query head that joins each row's softmax denominator and carries no value (MLX's "
        "sinks=); a row with sinks and no key left is 0. window (left, right, chunk) (None = off): query i at "
        "position p = i + (T - S if bottom_right else 0) also needs p - j < left, j - p <= right and j // chunk "
        "== p // chunk, each where set (docs/semantics.md §1.4).",
    )
)


def _infer_addmm(ts, *, alpha, beta):
    c, a, b = ts
    product = _infer_matmul([a, b])
    same_dtype("addmm", ts)
    require_dtype("addmm", a, FLOATS)
    padded = (1,) * (product.rank - c.rank) + c.shape
    if c.rank > product.rank or any(d not in (1, n) for d, n in zip(padded, product.shape)):
        raise ShapeError(f"addmm: c {c} does not broadcast to the product a @ b = {product}")
    return product


register(
    OpDef(
        "addmm",
        (operand("c"), operand("a"), operand("b")),
        _infer_addmm,
        {"alpha": attr("float", 1.0), "beta": attr("float", 1.0)},
        "attention",
        "beta * c + alpha * (a @ b) (MLX's fused addmm: a biased linear layer), rounded once where the target "
        "fuses it; c broadcasts to the product.",
    )
)
_SDPA = get_op("sdpa")
register(
    OpDef(
        "sdpa_lse",
        _SDPA.operands,
        _infer_sdpa_lse,
        _SDPA.attrs,  # the companion takes exactly sdpa's attributes
        "attention",
        "Companion of sdpa (its optional log-sum-exp output, JAX's return_residual): f32[B, Hq, S] = "
        "logsumexp over the keys of the scaled, masked logits of the sdpa with the same operands and "
        "attributes. Kept in float32 (JAX casts its residual to the key dtype). A row that the bool mask "
        "and causal leave without any key is -inf on every target (sdpa gives it the mean of V; it attends "
        "nothing, so a split-KV combine weighs it 0), as is a row an additive mask sets to -inf.",
    )
)
