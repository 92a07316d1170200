"""Quantized weights and K/V: MLX's affine quantization (``mx.quantize``'s packed words, scales and biases).

A quantized matrix ``w [..., N, K]`` is three tensors:

- ``wq`` int32 ``[..., N, K * bits / 32]``: the packed words. The IR has no unsigned type: each int32
  holds the bits of MLX's uint32 word unchanged. Row by row, the words form one little-endian bit
  stream: element ``j`` of a row is the ``bits`` bits starting at bit ``j * bits`` of the stream (bit
  ``b`` of the stream is bit ``b % 32`` of word ``b // 32``), so with 3, 5 or 6 bits an element may
  straddle two words.
- ``scales``, ``biases`` ``[..., N, K / group_size]``, one float dtype: one pair per ``group_size``
  consecutive elements of a row.

Dequantized, ``w[..., j] = scale * q + bias`` of its group, computed in the scales' dtype as MLX does:
the product is rounded to that dtype, then the sum (two roundings, no fused multiply-add).

``quantize`` is ``mx.quantize``, one op per output (``output``: ``wq``, ``scales`` or ``biases``); the three
share their operand and attributes, and each is computed alone.

``quantized_sdpa`` is attention over quantized K/V as mlx-lm computes it
(``quantized_scaled_dot_product_attention``): two ``quantized_matmul`` around a softmax.
"""

from __future__ import annotations

from attnpass.ir.core.registry import OpDef, attr, operand, opt_operand, register
from attnpass.ir.core.types import DType, ShapeError, TensorType

from .rules import FLOATS, broadcast_shapes, describe_types, require_dtype

BITS = (1, 2, 3, 4, 5, 6, 8)  # mx.quantize's affine bit widths (MLX 0.32)
GROUP_SIZES = (32, 64, 128)  # mx.quantize's affine group sizes


def _unpacked_width(op: str, wq: TensorType, bits: int) -> int:
    """Elements per row of the packed words ``wq``; a clear error when its rows do not hold whole elements."""
    words = wq.shape[-1]
    if words * 32 % bits:
        raise ShapeError(
            f"{op}: wq {wq}: rows of {words} packed words ({words * 32} bits) do not hold a whole number of "
            f"{bits}-bit elements"
        )
    return words * 32 // bits


def _check_quantized(
    op: str, wq: TensorType, scales: TensorType, biases: TensorType, group_size: int, bits: int
) -> int:
    """Validate ``(wq, scales, biases)`` as one quantized matrix; returns its unpacked row length K."""
    if bits not in BITS:
        raise ShapeError(f"{op}: bits={bits} is not an affine quantization width; valid: {', '.join(map(str, BITS))}")
    if group_size not in GROUP_SIZES:
        valid = ", ".join(map(str, GROUP_SIZES))
        raise ShapeError(f"{op}: group_size={group_size} is not an affine group size; valid: {valid}")
    require_dtype(op, wq, (DType.int32,), "wq (packed uint32 words, held as int32)")
    require_dtype(op, scales, FLOATS, "scales")
    if biases.dtype is not scales.dtype:
        raise ShapeError(f"{op}: scales and biases must share one float dtype, got {describe_types([scales, biases])}")
    if wq.rank < 2:
        raise ShapeError(f"{op}: wq must have rank >= 2 [..., N, words], got {wq}")
    k = _unpacked_width(op, wq, bits)
    if k % group_size:
        raise ShapeError(f"{op}: rows of {k} {bits}-bit elements ({wq}) are not whole groups of {group_size}")
    expected = wq.shape[:-1] + (k // group_size,)
    for name, t in (("scales", scales), ("biases", biases)):
        if t.shape != expected:
            raise ShapeError(
                f"{op}: {name} {t} must be [{','.join(map(str, expected))}] (wq {wq}: {k} elements a row, "
                f"one {name[:-1]} per group of {group_size})"
            )
    return k


def _infer_dequantize(ts, *, group_size, bits, dtype):
    wq, scales, biases = ts
    k = _check_quantized("dequantize", wq, scales, biases, group_size, bits)
    if not dtype.is_float:
        valid = ", ".join(d.value for d in FLOATS)
        raise ShapeError(f"dequantize: dtype {dtype.value} is not a float dtype; valid: {valid}")
    return TensorType(wq.shape[:-1] + (k,), dtype)


def _infer_quantized_matmul(ts, *, transpose, group_size, bits):
    x, wq, scales, biases = ts
    op = "quantized_matmul"
    k = _check_quantized(op, wq, scales, biases, group_size, bits)
    if x.dtype is not scales.dtype:
        raise ShapeError(f"{op}: x and scales must share one float dtype, got x={x}, scales={scales}; insert a cast")
    if x.rank < 2:
        raise ShapeError(f"{op}: x must have rank >= 2 [..., M, D], got {x}")
    rows, cols = (k, wq.shape[-2]) if transpose else (wq.shape[-2], k)  # w^T when transpose: [K, N]
    if x.shape[-1] != rows:
        shown = f"[..., {wq.shape[-2]}, {k}] (dequantized), used transposed" if transpose else f"[..., {rows}, {k}]"
        raise ShapeError(
            f"{op}: contraction dims differ: x {x} @ w {shown}: {x.shape[-1]} != {rows} (transpose={transpose})"
        )
    batch = broadcast_shapes(op, x.shape[:-2], wq.shape[:-2])
    return TensorType(batch + (x.shape[-2], cols), x.dtype)


def _infer_quantize(ts, *, group_size, bits, output):
    (w,) = ts
    if bits not in BITS:
        raise ShapeError(
            f"quantize: bits={bits} is not an affine quantization width; valid: {', '.join(map(str, BITS))}"
        )
    if group_size not in GROUP_SIZES:
        valid = ", ".join(map(str, GROUP_SIZES))
        raise ShapeError(f"quantize: group_size={group_size} is not an affine group size; valid: {valid}")
    require_dtype("quantize", w, FLOATS, "w")
    if w.rank < 2 or w.shape[-1] % group_size:
        raise ShapeError(
            f"quantize: w {w} must have rank >= 2 and rows of whole groups of {group_size} (a last dim divisible "
            f"by {group_size})"
        )
    k = w.shape[-1]
    if output == "wq":
        return TensorType(w.shape[:-1] + (k * bits // 32,), DType.int32)
    return TensorType(w.shape[:-1] + (k // group_size,), w.dtype)


def _infer_quantized_sdpa(ts, *, scale, group_size, bits, precision="dtype"):
    op = "quantized_sdpa"
    q, kq, ks, kb, vq, vs, vb, mask = ts
    require_dtype(op, q, FLOATS, "q")
    d = _check_quantized(op, kq, ks, kb, group_size, bits)
    dv = _check_quantized(op, vq, vs, vb, group_size, bits)
    if ks.dtype is not q.dtype or vs.dtype is not q.dtype:
        raise ShapeError(f"{op}: q and the K/V scales must share one float dtype, got q={q}, ks={ks}, vs={vs}")
    if q.rank != 4 or kq.rank != 4 or vq.rank != 4:
        raise ShapeError(f"{op}: q, kq and vq must have rank 4 [B, H, S|T, ...], got q={q}, kq={kq}, vq={vq}")
    (b, hq, s, qd), (kb_, hkv, t, _), (vb_, vh, vt, _) = q.shape, kq.shape, vq.shape
    if qd != d:
        raise ShapeError(f"{op}: q {q} has head dim {qd}, the keys (kq {kq}, {bits} bits) hold {d}")
    if (kb_, hkv, t) != (b, vh, vt) or vb_ != b:
        raise ShapeError(f"{op}: kq {kq} and vq {vq} must share [B, Hkv, T] with B={b} of q {q}")
    if hq % hkv:
        raise ShapeError(f"{op}: {hq} query heads are not a multiple of {hkv} kv heads (q {q}, kq {kq})")
    if mask is not None:
        if mask.dtype not in (DType.bool, q.dtype):
            raise ShapeError(f"{op}: mask {mask} must be bool (True = attend) or additive in q's dtype {q.dtype.value}")
        full = (b, hq, s, t)
        if mask.rank > 4 or broadcast_shapes(f"{op} mask", mask.shape, full) != full:
            raise ShapeError(f"{op}: mask {mask} does not broadcast to [B, Hq, S, T] = {list(full)}")
    return TensorType((b, hq, s, dv), q.dtype)


_QUANT_ATTRS = {"group_size": attr("int", 64), "bits": attr("int", 4)}
register(
    OpDef(
        "dequantize",
        (operand("wq"), operand("scales"), operand("biases")),
        _infer_dequantize,
        {**_QUANT_ATTRS, "dtype": attr("dtype")},
        "quant",
        "mx.dequantize (affine): w [..., N, K] from packed int32 words wq [..., N, K*bits/32] (uint32 bits, a "
        "little-endian bit stream per row), scales and biases [..., N, K/group_size]: w = scale * q + bias of "
        "q's group, the product rounded to the scales' dtype, then the sum; then converted to dtype.",
    )
)
register(
    OpDef(
        "quantize",
        (operand("w"),),
        _infer_quantize,
        {**_QUANT_ATTRS, "output": attr("choice:wq|scales|biases")},
        "quant",
        "mx.quantize (affine), one output: w [..., N, K] -> wq int32 [..., N, K*bits/32] (uint32 bits, a "
        "little-endian bit stream per row), or scales or biases [..., N, K/group_size] in w's dtype. Per group, "
        "in float32: the edge (the min or max of larger magnitude) is q0 * scale + bias exactly, "
        "q = clip(rint((w - bias) / scale), 0, 2^bits - 1) with the float32 scale and bias, which are then "
        "rounded to w's dtype; 1 bit: scale max - min, bias min (docs/semantics.md §1.5).",
    )
)
register(
    OpDef(
        "quantized_matmul",
        (operand("x"), operand("wq"), operand("scales"), operand("biases")),
        _infer_quantized_matmul,
        {"transpose": attr("bool", True), **_QUANT_ATTRS},
        "quant",
        "mx.quantized_matmul (affine): x @ w^T (transpose=True) or x @ w, w the dequantize of (wq, scales, "
        "biases) in x's dtype, which the scales share; batch dims broadcast. The accumulation order and "
        "precision are the target's (MLX's own kernel on MLX).",
    )
)
register(
    OpDef(
        "quantized_sdpa",
        (
            operand("q"),
            operand("kq"),
            operand("ks"),
            operand("kb"),
            operand("vq"),
            operand("vs"),
            operand("vb"),
            opt_operand("mask"),
        ),
        _infer_quantized_sdpa,
        {"scale": attr("float"), **_QUANT_ATTRS, "precision": attr("choice:dtype|float32", "dtype")},
        "quant",
        "mlx-lm's quantized_scaled_dot_product_attention: q [B, Hq, S, D], K and V quantized [B, Hkv, T, ...] "
        "(kq, ks, kb and vq, vs, vb as for dequantize); query head h reads kv head h // (Hq / Hkv). "
        "s = quantized_matmul(q * scale, K) (q * scale rounded to q's dtype); a bool mask (True = attend) "
        "sets the others to the dtype's lowest finite value, an additive one is added; p = softmax(s) in at "
        "least float32, rounded to q's dtype; out = quantized_matmul(p, V, transpose=False). precision float32: "
        "q, the scales and biases and an additive mask widened to float32 (exactly), every step in float32, "
        "the result rounded once to q's dtype.",
    )
)
