"""Attention ops: matmul, softmax, the fused ``sdpa`` (GQA, masks, causal kinds) and its ``sdpa_lse`` companion."""

from __future__ import annotations

from attnpass.ir.core.registry import OpDef, attr, get_op, register
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


def sdpa_operands(node_or_types, has_sinks: bool) -> tuple:
    """``(mask, sinks)`` of an sdpa/sdpa_lse's operands (inputs or types), each None when absent."""
    rest = list(node_or_types)[3:]
    sinks = rest.pop() if has_sinks and rest else None
    return (rest[0] if rest else None), sinks


def sdpa_variants(attrs) -> str | None:
    """``"sinks"``, ``"logit_softcap=c"`` or both, for the variants an sdpa's ``attrs`` turn on (None: neither)."""
    parts = (["sinks"] if attrs.get("has_sinks") else []) + (
        [f"logit_softcap={attrs['logit_softcap']:g}"] if attrs.get("logit_softcap") is not None else []
    )
    return " and ".join(parts) or None


def _infer_sdpa(ts, *, scale, causal, has_sinks=False, logit_softcap=None):
    q, k, v = ts[:3]
    if has_sinks and len(ts) == 3:
        raise ShapeError("sdpa: has_sinks=True but no sinks operand (operands: q, k, v, mask?, sinks)")
    if not has_sinks and len(ts) == 5:
        raise ShapeError(f"sdpa: 5 operands but has_sinks=False; the fifth, {ts[4]}, is sinks only with has_sinks=True")
    mask, sinks = sdpa_operands(ts, has_sinks)
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
            f"sdpa: query heads {hq} not divisible by kv heads {hkv} (q={q}, k={k}); "
            "GQA needs Hq % Hkv == 0"
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


def _infer_sdpa_lse(ts, *, scale, causal, has_sinks=False, logit_softcap=None):
    if has_sinks:
        raise ShapeError(
            "sdpa_lse: has_sinks=True is not supported: the log-sum-exp is over the keys only; "
            "a split-KV combine adds the sinks once (valid: has_sinks=False)"
        )
    b, hq, s, _ = _infer_sdpa(ts, scale=scale, causal=causal, logit_softcap=logit_softcap).shape
    return TensorType((b, hq, s), DType.float32)


register(OpDef("matmul", ("a", "b"), _infer_matmul, {}, "attention", "Batched a @ b with broadcast batch dims."))
register(
    OpDef(
        "softmax",
        ("x",),
        _infer_softmax,
        {"axis": attr("int", -1), "precise": attr("bool", False)},
        "attention",
        "Softmax over axis; precise=True computes in float32 for half inputs.",
    )
)
register(
    OpDef(
        "sdpa",
        ("q", "k", "v", "mask?", "sinks?"),
        _infer_sdpa,
        {
            "scale": attr("float?", None),
            "causal": attr("choice:" + "|".join(CAUSAL_KINDS), "none"),
            "has_sinks": attr("bool", False, quiet=True),
            "logit_softcap": attr("float?", None, quiet=True),
        },
        "attention",
        "softmax(q @ k^T * scale + mask) @ v; layout [B, H, S, D]; GQA: query head h uses kv head "
        "h // (Hq / Hkv); scale None = 1/sqrt(D); mask bool (True = attend) or additive in q's dtype (a "
        "half-float mask with float32 q is promoted exactly, as MLX does), broadcast "
        "to [B, Hq, S, T]; causal 'top_left' (JAX: query i sees keys <= i) or 'bottom_right' "
        "(MLX: query i sees keys <= i + T - S). A row that the bool mask and causal leave without any key "
        "weighs all T keys equally (the mean of V, as MLX's and JAX's fused calls return); an additive mask "
        "is added to the scores, so a row of -inf is NaN. logit_softcap c (None = off): the scaled scores become "
        "c * tanh(s / c) before the mask (gemma2's order). has_sinks: the last operand is sinks, f32-or-q-dtype "
        "[Hq], one logit per query head that joins each row's softmax denominator and carries no value (MLX's "
        "sinks=); a row with sinks and no key left is 0.",
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
        ("c", "a", "b"),
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
