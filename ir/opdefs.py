"""The core op set: one declarative entry per op, each with a pure shape/dtype rule.

Families (named sets, not a class hierarchy): ``source`` (input, constant),
``elementwise`` (binary with numpy broadcasting, unary), ``layout`` (cast,
reshape, transpose, slice, concat, take), ``reduction`` (sum, max), and
``attention`` (matmul, softmax, sdpa).
"""

from __future__ import annotations

import math
from math import prod

import numpy as np

from .registry import OpDef, attr, register
from .types import DType, ShapeError, TensorType

FLOATS = (DType.float32, DType.float16, DType.bfloat16)
NUMERIC = FLOATS + (DType.int32,)


def _types(ts: list[TensorType]) -> str:
    return ", ".join(str(t) for t in ts)


def normalize_axis(op: str, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise ShapeError(f"{op}: axis {axis} out of range for rank {rank} (valid: {-rank}..{rank - 1})")
    return axis % rank


def broadcast_shapes(op: str, *shapes: tuple[int, ...]) -> tuple[int, ...]:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        shown = ", ".join("[" + ",".join(map(str, s)) + "]" for s in shapes)
        raise ShapeError(f"{op}: shapes {shown} do not broadcast (numpy broadcasting rules)") from None


def _require_dtype(op: str, t: TensorType, allowed: tuple[DType, ...], what: str = "operand") -> None:
    if t.dtype not in allowed:
        valid = ", ".join(d.value for d in allowed)
        raise ShapeError(f"{op}: {what} has dtype {t.dtype.value} ({t}); valid: {valid}")


def _same_dtype(op: str, ts: list[TensorType]) -> DType:
    dtypes = {t.dtype for t in ts}
    if len(dtypes) != 1:
        raise ShapeError(f"{op}: operands must share one dtype, got {_types(ts)}; insert a cast")
    return ts[0].dtype


# ----------------------------------------------------------------------------- sources


def _check_source_shape(op: str, shape: tuple[int, ...]) -> None:
    if any(d < 0 for d in shape):
        raise ShapeError(f"{op}: shape {list(shape)} has negative dims")


def _infer_input(ts, *, shape, dtype, role):
    _check_source_shape("input", shape)
    return TensorType(shape, dtype)


def _infer_constant(ts, *, value, shape, dtype):
    _check_source_shape("constant", shape)
    size = prod(shape)
    if len(value) not in (1, size):
        raise ShapeError(f"constant: {len(value)} values for shape {list(shape)} (need 1 or {size})")
    for v in value:
        if dtype is DType.int32 and not (isinstance(v, int) or (math.isfinite(v) and float(v).is_integer())):
            raise ShapeError(f"constant: value {v!r} is not an integer, but dtype is int32")
        if dtype is DType.bool and v not in (0, 1):
            raise ShapeError(f"constant: value {v!r} is not a bool, but dtype is bool")
    return TensorType(shape, dtype)


register(
    OpDef(
        "input",
        (),
        _infer_input,
        {"shape": attr("ints"), "dtype": attr("dtype"), "role": attr("choice:streamed|resident", "streamed")},
        "source",
        "A graph input. role: 'streamed' (filled by the host every call) or 'resident' (lives on device).",
    )
)
register(
    OpDef(
        "constant",
        (),
        _infer_constant,
        {"value": attr("scalars"), "shape": attr("ints"), "dtype": attr("dtype")},
        "source",
        "A constant tensor: a flat tuple of values in C order, or one value splatted over the shape.",
    )
)

# ----------------------------------------------------------------------------- elementwise


def _binary(name: str, allowed: tuple[DType, ...], doc: str) -> None:
    def infer(ts):
        dtype = _same_dtype(name, ts)
        _require_dtype(name, ts[0], allowed)
        return TensorType(broadcast_shapes(name, ts[0].shape, ts[1].shape), dtype)

    register(OpDef(name, ("x", "y"), infer, {}, "elementwise", doc))


def _unary(name: str, allowed: tuple[DType, ...], doc: str) -> None:
    def infer(ts):
        _require_dtype(name, ts[0], allowed)
        return ts[0]

    register(OpDef(name, ("x",), infer, {}, "elementwise", doc))


_binary("add", NUMERIC, "x + y with numpy broadcasting.")
_binary("sub", NUMERIC, "x - y with numpy broadcasting.")
_binary("mul", NUMERIC, "x * y with numpy broadcasting.")
_binary("div", FLOATS, "x / y (true division) with numpy broadcasting.")
_binary("maximum", NUMERIC, "Elementwise maximum with numpy broadcasting.")
_unary("neg", NUMERIC, "-x.")
_unary("exp", FLOATS, "e**x.")
_unary("relu", NUMERIC, "max(x, 0).")


def _infer_where(ts):
    cond, a, b = ts
    _require_dtype("where", cond, (DType.bool,), "condition")
    dtype = _same_dtype("where", [a, b])
    return TensorType(broadcast_shapes("where", cond.shape, a.shape, b.shape), dtype)


register(OpDef("where", ("cond", "x", "y"), _infer_where, {}, "elementwise", "cond ? x : y, broadcast."))

# ----------------------------------------------------------------------------- layout


def _infer_cast(ts, *, dtype):
    return TensorType(ts[0].shape, dtype)


def _infer_reshape(ts, *, shape):
    (x,) = ts
    if any(d < 0 for d in shape):
        raise ShapeError(f"reshape: target shape {list(shape)} has negative dims (resolve -1 before building)")
    if prod(shape) != x.size:
        raise ShapeError(f"reshape: cannot reshape {x} ({x.size} elements) to {list(shape)} ({prod(shape)} elements)")
    return TensorType(shape, x.dtype)


def _infer_transpose(ts, *, perm):
    (x,) = ts
    if sorted(perm) != list(range(x.rank)):
        raise ShapeError(f"transpose: perm {list(perm)} is not a permutation of 0..{x.rank - 1} for operand {x}")
    return TensorType(tuple(x.shape[p] for p in perm), x.dtype)


def _infer_slice(ts, *, start, stop, step):
    (x,) = ts
    if not len(start) == len(stop) == len(step) == x.rank:
        raise ShapeError(
            f"slice: start/stop/step need one entry per axis of {x}, got "
            f"start={list(start)} stop={list(stop)} step={list(step)}"
        )
    dims = []
    for axis, (lo, hi, st, n) in enumerate(zip(start, stop, step, x.shape)):
        if st < 1 or not 0 <= lo <= n or not lo <= hi <= n:
            raise ShapeError(
                f"slice: axis {axis} of {x}: start={lo} stop={hi} step={st} invalid "
                f"(need 0 <= start <= stop <= {n} and step >= 1)"
            )
        dims.append(-(-(hi - lo) // st))
    return TensorType(tuple(dims), x.dtype)


def _infer_concat(ts, *, axis):
    first = ts[0]
    ax = normalize_axis("concat", axis, first.rank)
    _same_dtype("concat", ts)
    for t in ts[1:]:
        if t.rank != first.rank or any(a != b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != ax):
            raise ShapeError(f"concat: operands {_types(ts)} differ outside axis {axis}")
    shape = list(first.shape)
    shape[ax] = sum(t.shape[ax] for t in ts)
    return TensorType(tuple(shape), first.dtype)


def _infer_take(ts, *, axis):
    x, idx = ts
    _require_dtype("take", idx, (DType.int32,), "indices")
    if x.rank == 0:
        raise ShapeError(f"take: operand {x} is a scalar; need rank >= 1")
    ax = normalize_axis("take", axis, x.rank)
    return TensorType(x.shape[:ax] + idx.shape + x.shape[ax + 1 :], x.dtype)


register(OpDef("cast", ("x",), _infer_cast, {"dtype": attr("dtype")}, "layout", "Convert to dtype."))
register(OpDef("reshape", ("x",), _infer_reshape, {"shape": attr("ints")}, "layout", "Row-major reshape."))
register(OpDef("transpose", ("x",), _infer_transpose, {"perm": attr("ints")}, "layout", "Permute axes."))
register(
    OpDef(
        "slice",
        ("x",),
        _infer_slice,
        {"start": attr("ints"), "stop": attr("ints"), "step": attr("ints")},
        "layout",
        "Static strided slice x[start:stop:step] per axis (positive steps, bounds already clamped).",
    )
)
register(OpDef("concat", ("*xs",), _infer_concat, {"axis": attr("int")}, "layout", "Concatenate along axis."))
register(
    OpDef(
        "take",
        ("x", "indices"),
        _infer_take,
        {"axis": attr("int")},
        "layout",
        "numpy.take: gather along axis by int32 indices, which must lie in [0, dim).",
    )
)

# ----------------------------------------------------------------------------- reductions


def _reduction(name: str) -> None:
    def infer(ts, *, axes, keepdims):
        (x,) = ts
        _require_dtype(name, x, NUMERIC)
        norm = sorted({normalize_axis(name, a, x.rank) for a in axes})
        if len(norm) != len(axes):
            raise ShapeError(f"{name}: repeated axes {list(axes)} for operand {x}")
        if keepdims:
            shape = tuple(1 if i in norm else d for i, d in enumerate(x.shape))
        else:
            shape = tuple(d for i, d in enumerate(x.shape) if i not in norm)
        return TensorType(shape, x.dtype)

    register(
        OpDef(
            name,
            ("x",),
            infer,
            {"axes": attr("ints"), "keepdims": attr("bool", False)},
            "reduction",
            f"{name} over axes; result keeps the operand dtype.",
        )
    )


_reduction("sum")
_reduction("max")

# ----------------------------------------------------------------------------- attention


def _infer_matmul(ts):
    a, b = ts
    dtype = _same_dtype("matmul", ts)
    _require_dtype("matmul", a, NUMERIC)
    if a.rank < 2 or b.rank < 2:
        raise ShapeError(f"matmul: operands need rank >= 2, got {a} and {b}")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"matmul: contraction dims differ: {a} @ {b} ({a.shape[-1]} != {b.shape[-2]})")
    batch = broadcast_shapes("matmul", a.shape[:-2], b.shape[:-2])
    return TensorType(batch + (a.shape[-2], b.shape[-1]), dtype)


def _infer_softmax(ts, *, axis, precise):
    (x,) = ts
    _require_dtype("softmax", x, FLOATS)
    normalize_axis("softmax", axis, x.rank)
    return x


CAUSAL_KINDS = ("none", "top_left", "bottom_right")


def _infer_sdpa(ts, *, scale, causal):
    q, k, v = ts[:3]
    mask = ts[3] if len(ts) == 4 else None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.rank != 4:
            raise ShapeError(f"sdpa: {name} must be rank 4 [B, H, S, D], got {name}={t}")
        _require_dtype("sdpa", t, FLOATS, name)
    _same_dtype("sdpa", [q, k, v])
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
        if mask.dtype not in (DType.bool, q.dtype):
            raise ShapeError(
                f"sdpa: mask {mask} must be bool (True = attend) or additive with q's dtype {q.dtype.value}"
            )
        if mask.rank > 4:
            raise ShapeError(f"sdpa: mask rank {mask.rank} > 4: {mask}")
        full = (b, hq, s, t)
        if broadcast_shapes("sdpa mask", mask.shape, full) != full:
            raise ShapeError(f"sdpa: mask {mask} does not broadcast to [B, Hq, S, T] = {list(full)}")
    return TensorType((b, hq, s, v.shape[3]), q.dtype)


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
        ("q", "k", "v", "mask?"),
        _infer_sdpa,
        {"scale": attr("float?", None), "causal": attr("choice:" + "|".join(CAUSAL_KINDS), "none")},
        "attention",
        "softmax(q @ k^T * scale + mask) @ v; layout [B, H, S, D]; GQA: query head h uses kv head "
        "h // (Hq / Hkv); scale None = 1/sqrt(D); mask bool (True = attend) or additive in q's dtype, broadcast "
        "to [B, Hq, S, T]; causal 'top_left' (JAX: query i sees keys <= i) or 'bottom_right' "
        "(MLX: query i sees keys <= i + T - S).",
    )
)

# ----------------------------------------------------------------------------- masks: logic and comparisons


def _logical(name: str, doc: str) -> None:
    def infer(ts):
        for t in ts:
            _require_dtype(name, t, (DType.bool,))
        return TensorType(broadcast_shapes(name, ts[0].shape, ts[1].shape), DType.bool)

    register(OpDef(name, ("x", "y"), infer, {}, "elementwise", doc))


def _compare(name: str, doc: str) -> None:
    def infer(ts):
        _same_dtype(name, ts)
        _require_dtype(name, ts[0], NUMERIC)
        return TensorType(broadcast_shapes(name, ts[0].shape, ts[1].shape), DType.bool)

    register(OpDef(name, ("x", "y"), infer, {}, "elementwise", doc))


_logical("logical_and", "x & y on bool tensors, numpy broadcasting.")
_logical("logical_or", "x | y on bool tensors, numpy broadcasting.")
_compare("equal", "x == y -> bool, numpy broadcasting.")
_compare("less", "x < y -> bool, numpy broadcasting.")
_compare("greater_equal", "x >= y -> bool, numpy broadcasting.")
_unary("rsqrt", FLOATS, "1 / sqrt(x) (for RMSNorm).")

# ----------------------------------------------------------------------------- imported-model ops (from_mlx, from_jax)


def _infer_broadcast_to(ts, *, shape):
    (x,) = ts
    if any(d < 0 for d in shape):
        raise ShapeError(f"broadcast_to: target shape {list(shape)} has negative dims")
    padded = (1,) * (len(shape) - x.rank) + x.shape
    if x.rank > len(shape) or any(d not in (1, n) for d, n in zip(padded, shape)):
        raise ShapeError(f"broadcast_to: operand {x} does not broadcast to {list(shape)} (numpy broadcasting rules)")
    return TensorType(tuple(shape), x.dtype)


def _infer_argpartition(ts, *, kth, axis):
    (x,) = ts
    _require_dtype("argpartition", x, NUMERIC)
    if x.rank == 0:
        raise ShapeError(f"argpartition: operand {x} is a scalar; need rank >= 1")
    n = x.shape[normalize_axis("argpartition", axis, x.rank)]
    if not 0 <= kth < n:
        raise ShapeError(f"argpartition: kth={kth} out of range for axis {axis} of {x} (need 0 <= kth < {n})")
    return TensorType(x.shape, DType.int32)


def _infer_put_along_axis(ts, *, axis):
    x, idx, values = ts
    _require_dtype("put_along_axis", idx, (DType.int32,), "indices")
    if values.dtype != x.dtype:
        raise ShapeError(f"put_along_axis: values {values} must have the dtype of x {x}")
    if idx.rank != x.rank:
        raise ShapeError(f"put_along_axis: indices {idx} must have the rank of x {x}")
    ax = normalize_axis("put_along_axis", axis, x.rank)
    if any(i != n and i != 1 for a, (i, n) in enumerate(zip(idx.shape, x.shape)) if a != ax):
        raise ShapeError(f"put_along_axis: indices {idx} do not broadcast against x {x} outside axis {axis}")
    broadcast_shapes("put_along_axis", values.shape, idx.shape)
    return x


register(
    OpDef(
        "broadcast_to",
        ("x",),
        _infer_broadcast_to,
        {"shape": attr("ints")},
        "layout",
        "numpy.broadcast_to: repeat size-1 axes and prepend axes to reach shape (no arithmetic).",
    )
)
_unary("sin", FLOATS, "sin(x).")
_unary("cos", FLOATS, "cos(x).")
_unary("sigmoid", FLOATS, "1 / (1 + exp(-x)).")
_binary("floor_divide", NUMERIC, "numpy floor division x // y with numpy broadcasting.")
register(
    OpDef(
        "argpartition",
        ("x",),
        _infer_argpartition,
        {"kth": attr("int"), "axis": attr("int", -1)},
        "reduction",
        "int32 indices that partition x along axis: the element at kth is in sorted position, smaller ones "
        "before, larger ones after. The order inside each side (and among ties) is target-defined.",
    )
)
register(
    OpDef(
        "put_along_axis",
        ("x", "indices", "values"),
        _infer_put_along_axis,
        {"axis": attr("int")},
        "layout",
        "numpy.put_along_axis on a copy of x: indices in [-n, n) (negative ones wrap); values broadcast to "
        "the indices. Writes to one cell must agree, otherwise which one wins is target-defined.",
    )
)
