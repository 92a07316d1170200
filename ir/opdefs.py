"""The core op set: one declarative entry per op, each with a pure shape/dtype rule.

Families (named sets, not a class hierarchy): ``source`` (input, constant),
``elementwise`` (binary with numpy broadcasting, unary), ``layout`` (cast,
reshape, transpose, slice, concat, take), ``reduction`` (sum, max), and
``attention`` (matmul, softmax, sdpa).
"""

from __future__ import annotations

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


def _infer_input(ts, *, shape, dtype, role):
    return TensorType(shape, dtype)


def _infer_constant(ts, *, value, shape, dtype):
    size = prod(shape)
    if len(value) not in (1, size):
        raise ShapeError(f"constant: {len(value)} values for shape {list(shape)} (need 1 or {size})")
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
        if mask.dtype is not DType.bool and not mask.dtype.is_float:
            raise ShapeError(f"sdpa: mask must be bool (True = attend) or additive float, got {mask}")
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
        "h // (Hq / Hkv); scale None = 1/sqrt(D); mask bool (True = attend) or additive, broadcast "
        "to [B, Hq, S, T]; causal 'top_left' (JAX: query i sees keys <= i) or 'bottom_right' "
        "(MLX: query i sees keys <= i + T - S).",
    )
)
