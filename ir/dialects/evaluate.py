"""The numpy reference semantics of the ops, as functions on arrays: what constant folding computes.

Every op is computed in float64 (int64 for integers, bools as is) and rounded
once to the node's dtype, exactly as the numpy target's generated programs do
(:mod:`attnpass.lowering.targets.numpy` imports :func:`wide`, :func:`rounded`,
:func:`constant` and :func:`softmax` from here; a test checks every op of :data:`EVALUATORS`
bit for bit against that target). Ops whose result a target may choose
(``argpartition``, ``put_along_axis``) and the fused/QSA ops have no evaluator.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from attnpass.ir.core.types import DType, TensorType

Evaluator = Callable[[Mapping, Sequence[np.ndarray], TensorType], np.ndarray]


def wide(x: np.ndarray) -> np.ndarray:
    """float64 for floating operands, int64 for integers, bool as is."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        return x
    if x.dtype.kind in "iu":
        return x.astype(np.int64)
    return x.astype(np.float64)


def rounded(x: np.ndarray, dtype: str | DType) -> np.ndarray:
    """``x`` converted to ``dtype``: floats round once to nearest even; float to int truncates.

    float16 and bfloat16 are reached through float32 rounded to odd, which gives
    the once-rounded value (24 >= 8 + 2 and 11 + 2 bits) whatever numpy or
    ml_dtypes do with a float64 (docs/semantics.md §1.1).
    """
    x, dt = np.asarray(x), DType.parse(dtype)
    if dt not in (DType.float16, DType.bfloat16) or x.dtype == dt.numpy:
        return x.astype(dt.numpy)
    y = _to_float32_odd(x.astype(np.float64))
    if dt is DType.float16:
        with np.errstate(over="ignore"):  # beyond the largest float16: inf, a value like any other
            return y.astype(np.float16)  # float32 -> float16 rounds once, to nearest even
    bits, one, sixteen = y.view(np.uint32).astype(np.uint64), np.uint64(1), np.uint64(16)
    nearest = (bits + np.uint64(0x7FFF) + ((bits >> sixteen) & one)) >> sixteen  # to nearest even at bit 16
    quiet_nan = (bits >> sixteen) | np.uint64(0x40)
    return np.where(np.isnan(y), quiet_nan, nearest).astype(np.uint16).view(dt.numpy)


def _to_float32_odd(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd: truncated toward zero, last bit set when inexact."""
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float32)
        y = np.where(np.abs(y) > np.abs(x), np.nextafter(y, np.float32(0)), y)  # inf above FLT_MAX too
        inexact = (y != x) & ~np.isnan(x)
    return np.where(inexact, y.view(np.uint32) | np.uint32(1), y.view(np.uint32)).view(np.float32)


def constant(values: tuple, shape: tuple[int, ...], dtype: str | DType) -> np.ndarray:
    """A ``constant`` node's array: its flat values (or one splatted value), rounded to ``dtype``."""
    flat = np.asarray(values, dtype=np.float64 if DType.parse(dtype).is_float else None)
    return rounded(np.broadcast_to(flat.reshape(()), shape) if flat.size == 1 else flat.reshape(shape), dtype)


def softmax(x: np.ndarray, axis: int, dtype: str | DType) -> np.ndarray:
    x = wide(x)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return rounded(e / np.sum(e, axis=axis, keepdims=True), dtype)


def _arith(fn: Callable[..., np.ndarray]) -> Evaluator:
    return lambda attrs, xs, t: rounded(fn(*(wide(x) for x in xs)), t.dtype)


def _exact(fn: Callable[..., np.ndarray]) -> Evaluator:
    """Ops that move or compare values without arithmetic."""
    return lambda attrs, xs, t: np.asarray(fn(*xs))


def _slice(attrs: Mapping, xs: Sequence[np.ndarray], t: TensorType) -> np.ndarray:
    index = tuple(slice(lo, hi, st) for lo, hi, st in zip(attrs["start"], attrs["stop"], attrs["step"]))
    return xs[0][index]


def _reduce(fn: Callable[..., np.ndarray]) -> Evaluator:
    return lambda attrs, xs, t: rounded(fn(wide(xs[0]), axis=tuple(attrs["axes"]), keepdims=attrs["keepdims"]), t.dtype)


def _arg_reduce(fn: Callable[..., np.ndarray]) -> Evaluator:
    return lambda attrs, xs, t: fn(wide(xs[0]), axis=attrs["axis"], keepdims=attrs["keepdims"]).astype(np.int32)


def conv1d(x, w, *, stride: int, padding: Sequence[int], dilation: int, groups: int, dtype: str | DType) -> np.ndarray:
    """The ``conv1d`` op: x [N, L, C_in] (zero-padded on L) cross-correlated with w [C_out, K, C_in/groups] in
    float64, rounded once to ``dtype``."""
    x, w = wide(x), wide(w)
    (n, _length, c_in), (c_out, k, per_group) = x.shape, w.shape
    x = np.pad(x, ((0, 0), tuple(padding), (0, 0)))
    l_out = (x.shape[1] - dilation * (k - 1) - 1) // stride + 1
    taps = np.stack([x[:, j * dilation : j * dilation + (l_out - 1) * stride + 1 : stride] for j in range(k)], axis=2)
    taps = taps.reshape(n, l_out, k, groups, per_group)
    out = np.einsum("nlkgc,gokc->nlgo", taps, w.reshape(groups, c_out // groups, k, per_group))
    return rounded(out.reshape(n, l_out, c_out), dtype)


def remainder(x, y, dtype: str | DType) -> np.ndarray:
    """The ``remainder`` op: fmod (exact) in float64 / int64, plus y where its sign differs from a nonzero
    fmod, rounded once to ``dtype``. A zero keeps x's sign, as MLX and JAX compute it (numpy's takes y's)."""
    x, y = wide(x), wide(y)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.fmod(x, y)
    return rounded(np.where((r != 0) & ((r < 0) != (y < 0)), r + y, r), dtype)


def total_order(x: np.ndarray) -> np.ndarray:
    """int64 keys in the IEEE total order of ``x``'s values (-NaN < -inf < -0.0 < +0.0 < +inf < +NaN, read from
    the bits of x's own dtype); integers are their own keys."""
    x = np.asarray(x)
    if x.dtype.kind in "iub":
        return x.astype(np.int64)
    signed = x.view(np.dtype(f"i{x.dtype.itemsize}")).astype(np.int64)
    return np.where(signed < 0, signed ^ (2 ** (8 * x.dtype.itemsize - 1) - 1), signed)


def argtopk(x: np.ndarray, k: int, axis: int) -> np.ndarray:
    """The ``argtopk`` op: indices of the k largest along ``axis`` in total order, largest first, ties by index
    (a stable sort of the complemented keys)."""
    order = np.argsort(~total_order(x), axis=axis, kind="stable")
    return np.take(order, np.arange(k), axis=axis).astype(np.int32)


_SCANS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum, "logsumexp": np.logaddexp}


def scan_identity(kind: str, dtype: str | DType) -> float | int:
    """The value an exclusive ``scan`` of ``kind`` starts from: 0, 1, the dtype's lowest / highest, or -inf
    (logsumexp)."""
    dt = DType.parse(dtype)
    if kind == "logsumexp":
        return -np.inf
    if kind in ("sum", "prod"):
        return int(kind == "prod")
    if dt.is_float:
        return -np.inf if kind == "max" else np.inf
    info = np.iinfo(dt.numpy)
    return int(info.min if kind == "max" else info.max)


def scan(x, *, kind: str, axis: int, reverse: bool, inclusive: bool, dtype: str | DType) -> np.ndarray:
    """The ``scan`` op in float64 (int64 for integers), rounded once to ``dtype``; exclusive scans are the
    inclusive scan of x shifted by one, the identity entering first."""
    x = wide(x)
    if reverse:
        x = np.flip(x, axis)
    if not inclusive:
        first = np.full_like(np.take(x, [0], axis=axis), scan_identity(kind, dtype))
        x = np.concatenate([first, np.take(x, np.arange(x.shape[axis] - 1), axis=axis)], axis=axis)
    out = _SCANS[kind].accumulate(x, axis=axis)
    return rounded(np.flip(out, axis) if reverse else out, dtype)


def unpack(wq: np.ndarray, bits: int) -> np.ndarray:
    """The ``bits``-bit integers packed in ``wq``'s words (int32 or uint32, the bits of MLX's uint32), int64
    ``[..., N, K]``: element ``j`` of a row is the bits from bit ``j * bits`` of the row's little-endian stream."""
    words = np.asarray(wq).view(np.uint32).astype(np.uint64)
    k = words.shape[-1] * 32 // bits
    start = np.arange(k) * bits
    word, shift = start // 32, (start % 32).astype(np.uint64)
    pair = words[..., word] | (np.take(words, np.minimum(word + 1, words.shape[-1] - 1), axis=-1) << np.uint64(32))
    return ((pair >> shift) & np.uint64((1 << bits) - 1)).astype(np.int64)


def dequantize(wq, scales, biases, *, group_size: int, bits: int, dtype: str | DType) -> np.ndarray:
    """The ``dequantize`` op: ``scale * q + bias`` with the product and the sum each rounded to the scales'
    dtype (as MLX computes it), then rounded to ``dtype``."""
    q = unpack(wq, bits).astype(np.float64)
    inner = DType.from_numpy(np.asarray(scales).dtype)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN scales or biases: values like any other
        s, b = (np.repeat(wide(a), group_size, axis=-1) for a in (scales, biases))
        return rounded(rounded(wide(rounded(s * q, inner)) + b, inner), dtype)


def quantized_matmul(x, wq, scales, biases, *, transpose: bool, group_size: int, bits: int) -> np.ndarray:
    """The ``quantized_matmul`` op: x @ w^T (or x @ w) in float64, w the ``dequantize`` in x's dtype, rounded once."""
    dtype = DType.from_numpy(np.asarray(x).dtype)
    w = wide(dequantize(wq, scales, biases, group_size=group_size, bits=bits, dtype=dtype))
    return rounded(np.matmul(wide(x), np.swapaxes(w, -1, -2) if transpose else w), dtype)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of :func:`unpack`: integers ``q`` in ``[0, 2^bits)`` ``[..., N, K]`` as int32 words (uint32
    bits) ``[..., N, K * bits / 32]``, element ``j`` at bit ``j * bits`` of the row's little-endian stream."""
    q = np.asarray(q).astype(np.uint64)
    stream = (q[..., None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)  # [..., K, bits], low bit first
    stream = stream.reshape(q.shape[:-1] + (q.shape[-1] * bits // 32, 32))
    return np.sum(stream << np.arange(32, dtype=np.uint64), axis=-1).astype(np.uint32).view(np.int32)


def quantize(w, *, group_size: int, bits: int, output: str) -> np.ndarray:
    """The ``quantize`` op (``mx.quantize``, affine), the ``output`` part: each group computed in float32 as MLX
    does. The scale is ``max((max - min) / (2^bits - 1), 1e-7)``, signed so that the edge (the min when its
    magnitude exceeds the max's, else the max) quantizes to ``q0 = rint(edge / scale)``; unless ``q0`` is 0,
    the scale becomes ``edge / q0`` and the bias the edge (else the bias is 0); with 1 bit the scale is
    ``max(max - min, 1e-7)`` and the bias the min. Then
    ``q = clip(rint((w - bias) / scale), 0, 2^bits - 1)``, and the float32 scale and bias are rounded to w's dtype."""
    w = np.asarray(w)
    x = w.astype(np.float32).reshape(w.shape[:-1] + (w.shape[-1] // group_size, group_size))
    bins = np.float32((1 << bits) - 1)
    top, bottom = x.max(axis=-1), x.min(axis=-1)
    low_edge = np.abs(bottom) > np.abs(top)
    scale = np.maximum((top - bottom) / bins, np.float32(1e-7))
    scale = np.where(low_edge, scale, -scale)
    edge = np.where(low_edge, bottom, top)
    q0 = np.rint(edge / scale)
    moved = q0 != 0
    scale = np.where(moved, edge / np.where(moved, q0, np.float32(1)), scale).astype(np.float32)
    bias = np.where(moved, edge, np.float32(0)).astype(np.float32)
    if bits == 1:  # MLX's 1-bit rule: the range and the min, no edge
        scale, bias = np.maximum(top - bottom, np.float32(1e-7)), bottom
    if output != "wq":
        return (scale if output == "scales" else bias).astype(w.dtype)
    q = np.clip(np.rint((x - bias[..., None]) / scale[..., None]), 0, bins)
    return pack(q.reshape(w.shape).astype(np.int64), bits)


def quantized_sdpa(
    q, kq, ks, kb, vq, vs, vb, mask=None, *, scale: float, group_size: int, bits: int, precision: str = "dtype"
) -> np.ndarray:
    """The ``quantized_sdpa`` op: mlx-lm's quantized attention, each step an op of its own rounded to q's dtype
    (``q * scale``, the scores, the masked scores, the softmax from float64, ``P·V``); query head ``h`` reads kv
    head ``h // G``, computed with the G heads of a group folded into the rows of one ``quantized_matmul``.
    ``precision="float32"``: the float operands widened to float32, the steps in float32, rounded once at the end."""
    dtype = DType.from_numpy(np.asarray(q).dtype)
    if precision == "float32" and dtype is not DType.float32:
        wide32 = [None if a is None or a.dtype == np.bool_ else np.asarray(a, np.float32) for a in (q, ks, kb, vs, vb)]
        extra = mask if mask is None or np.asarray(mask).dtype == np.bool_ else np.asarray(mask, np.float32)
        out = quantized_sdpa(
            wide32[0], kq, wide32[1], wide32[2], vq, wide32[3], wide32[4], extra, scale=scale,
            group_size=group_size, bits=bits,
        )  # fmt: skip
        return rounded(out, dtype)
    b, hq, s, d = q.shape
    hkv, t = kq.shape[1], kq.shape[2]
    opts = {"group_size": group_size, "bits": bits}
    folded = rounded(wide(q) * scale, dtype).reshape(b, hkv, hq // hkv * s, d)
    scores = quantized_matmul(folded, kq, ks, kb, transpose=True, **opts).reshape(b, hq, s, t)
    if mask is not None and np.asarray(mask).dtype == np.bool_:
        scores = rounded(np.where(mask, wide(scores), float(dtype.finfo.min)), dtype)
    elif mask is not None:
        scores = rounded(wide(scores) + wide(mask), dtype)
    p = softmax(scores, -1, dtype).reshape(b, hkv, hq // hkv * s, t)
    out = quantized_matmul(p, vq, vs, vb, transpose=False, **opts)
    return out.reshape(b, hq, s, out.shape[-1])


EVALUATORS: dict[str, Evaluator] = {
    "add": _arith(np.add),
    "sub": _arith(np.subtract),
    "mul": _arith(np.multiply),
    "div": _arith(np.divide),
    "maximum": _arith(np.maximum),
    "floor_divide": _arith(np.floor_divide),
    "neg": _arith(np.negative),
    "exp": _arith(np.exp),
    "relu": _arith(lambda x: np.maximum(x, 0)),
    "rsqrt": _arith(lambda x: 1.0 / np.sqrt(x)),
    "sqrt": _arith(np.sqrt),
    "sin": _arith(np.sin),
    "cos": _arith(np.cos),
    "sigmoid": _arith(lambda x: 1.0 / (1.0 + np.exp(-x))),
    "matmul": _arith(np.matmul),
    "logical_and": _exact(np.logical_and),
    "logical_or": _exact(np.logical_or),
    "equal": _exact(np.equal),
    "less": _exact(np.less),
    "greater_equal": _exact(np.greater_equal),
    "where": _exact(np.where),
    "cast": lambda attrs, xs, t: rounded(xs[0], t.dtype),
    "reshape": lambda attrs, xs, t: np.reshape(xs[0], attrs["shape"]),
    "transpose": lambda attrs, xs, t: np.transpose(xs[0], attrs["perm"]),
    "broadcast_to": lambda attrs, xs, t: np.broadcast_to(xs[0], attrs["shape"]),
    "slice": _slice,
    "concat": lambda attrs, xs, t: np.concatenate(list(xs), axis=attrs["axis"]),
    "take": lambda attrs, xs, t: np.take(xs[0], xs[1], axis=attrs["axis"]),
    "sum": _reduce(np.sum),
    "max": _reduce(np.max),
    "softmax": lambda attrs, xs, t: softmax(xs[0], attrs["axis"], t.dtype),
    "floor": _arith(np.floor),
    "ceil": _arith(np.ceil),
    "round": _arith(np.round),  # halves to even
    "argmax": _arg_reduce(np.argmax),
    "argmin": _arg_reduce(np.argmin),
    "argtopk": lambda attrs, xs, t: argtopk(xs[0], **attrs),
    "conv1d": lambda attrs, xs, t: conv1d(*xs, **attrs, dtype=t.dtype),
    "scan": lambda attrs, xs, t: scan(*xs, **attrs, dtype=t.dtype),
    "remainder": lambda attrs, xs, t: remainder(*xs, dtype=t.dtype),
    "dequantize": lambda attrs, xs, t: dequantize(*xs, **attrs),
    "quantized_matmul": lambda attrs, xs, t: quantized_matmul(*xs, **attrs),
    "quantize": lambda attrs, xs, t: quantize(*xs, **attrs),
    "quantized_sdpa": lambda attrs, xs, t: quantized_sdpa(*xs, **attrs),
}


def evaluate(op: str, attrs: Mapping, operands: Sequence[np.ndarray], result: TensorType) -> np.ndarray:
    """``op(operands)`` under the reference semantics, as an array of ``result``'s dtype and shape.

    Raises KeyError for an op without an evaluator; numpy's errors (an index out of range) pass through.
    """
    fn = EVALUATORS[op]
    with np.errstate(all="ignore"):  # inf/nan results are values like any other
        out = np.asarray(fn(attrs, operands, result))
    return np.array(np.broadcast_to(out, result.shape), dtype=result.dtype.numpy)


__all__ = [
    "EVALUATORS", "argtopk", "constant", "conv1d", "dequantize", "evaluate", "pack", "quantize", "quantized_matmul",
    "quantized_sdpa", "remainder", "rounded", "scan", "scan_identity", "softmax", "total_order", "unpack", "wide",
]  # fmt: skip
