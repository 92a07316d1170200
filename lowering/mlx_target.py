"""The MLX target: ``mlx.core`` calls; sdpa becomes ``mx.fast.scaled_dot_product_attention``."""

from __future__ import annotations

import numpy as np

from attnpass.ir import DType, Node

from .codegen import EmitEnv, Target, py_float, py_literal
from .common import causal_offset, sdpa_lengths, sdpa_scale, slice_expr
from .qsa_emitters import ALIAS as QSA, qsa_emitters, qsa_prelude

_DTYPES = {
    DType.float32: "mx.float32",
    DType.float16: "mx.float16",
    DType.bfloat16: "mx.bfloat16",
    DType.int32: "mx.int32",
    DType.bool: "mx.bool_",
}
_LOGIC = {
    "logical_and": "mx.logical_and",
    "logical_or": "mx.logical_or",
    "equal": "mx.equal",
    "less": "mx.less",
    "greater_equal": "mx.greater_equal",
}
_BINARY = {"add": "mx.add", "sub": "mx.subtract", "mul": "mx.multiply", "div": "mx.divide", "maximum": "mx.maximum"}


def _constant(n: Node, a: list[str], env: EmitEnv) -> str:
    values, shape, dt = n.attrs["value"], n.type.shape, _DTYPES[n.type.dtype]
    if n.type.dtype.is_float:
        # MLX converts Python floats through float32; writing the values already rounded to the
        # node's dtype (as the reference does) avoids a second rounding for float16.
        values = tuple(float(v) for v in np.asarray(values, np.float64).astype(n.type.dtype.numpy))
    if len(values) == 1:
        value = py_literal(values[0])
        return f"mx.array({value}, dtype={dt})" if not shape else f"mx.full({py_literal(shape)}, {value}, dtype={dt})"
    return f"mx.array({py_literal(values)}, dtype={dt}).reshape({py_literal(shape)})"


def _reduce(fn: str):
    def emit(n: Node, a: list[str], env: EmitEnv) -> str:
        axes = list(n.attrs["axes"])
        return f"{fn}({a[0]}, axis={axes}, keepdims={n.attrs['keepdims']})" if axes else a[0]

    return emit


def _matmul(n: Node, a: list[str], env: EmitEnv) -> str:
    if n.type.dtype.is_float:
        return f"mx.matmul({a[0]}, {a[1]})"
    # mx.matmul takes floating types only; an exact int32 product: broadcast multiply, sum over K.
    return f"mx.sum(mx.expand_dims({a[0]}, -1) * mx.expand_dims({a[1]}, -3), axis=-2)"


def _take(n: Node, a: list[str], env: EmitEnv) -> str:
    """``mx.take``; along an inner axis with 1-D indices, ``mx.take_along_axis`` instead.

    MLX 0.32's ``take`` on an inner axis returns a transposed view, and its CPU sdpa on such a
    view was ~5x slower (the QSA gather of K/V rows); ``take_along_axis`` writes a row-major
    result. (``mx.contiguous`` would too, but ``mx.export_function`` cannot export it.)
    """
    rank, axis = env.type_of(n.inputs[0]).rank, n.attrs["axis"] % env.type_of(n.inputs[0]).rank
    if axis == 0 or env.type_of(n.inputs[1]).rank != 1:
        return f"mx.take({a[0]}, {a[1]}, axis={n.attrs['axis']})"
    shape = tuple(-1 if i == axis else 1 for i in range(rank))
    return f"mx.take_along_axis({a[0]}, mx.reshape({a[1]}, {py_literal(shape)}), axis={axis})"


def _sdpa(n: Node, a: list[str], env: EmitEnv) -> str:
    q, k, v = a[:3]
    mask = a[3] if len(a) == 4 else None
    offset = causal_offset(n, env)
    s, t = sdpa_lengths(n, env)
    if offset is not None:
        if mask is None and offset == t - s and s <= t:
            mask = '"causal"'
        else:
            allowed = f"(mx.arange({t})[None, :] <= mx.arange({s})[:, None] + {offset})"
            if mask is None:
                mask = allowed
            elif env.type_of(n.inputs[3]).dtype is DType.bool:
                mask = f"mx.logical_and({mask}, {allowed})"
            else:
                mask = f"mx.where({allowed}, {mask}, mx.array({py_float(float('-inf'))}, dtype={_DTYPES[n.type.dtype]}))"
    extra = f", mask={mask}" if mask is not None else ""
    return f"mx.fast.scaled_dot_product_attention({q}, {k}, {v}, scale={sdpa_scale(n, env)}{extra})"


EMITTERS = {
    **{op: (lambda fn: lambda n, a, env: f"{fn}({a[0]}, {a[1]})")(fn) for op, fn in _BINARY.items()},
    "constant": _constant,
    "neg": lambda n, a, env: f"mx.negative({a[0]})",
    "exp": lambda n, a, env: f"mx.exp({a[0]})",
    "relu": lambda n, a, env: f"mx.maximum({a[0]}, mx.array(0, dtype={_DTYPES[n.type.dtype]}))",
    "where": lambda n, a, env: f"mx.where({a[0]}, {a[1]}, {a[2]})",
    "cast": lambda n, a, env: f"{a[0]}.astype({_DTYPES[n.type.dtype]})",
    "reshape": lambda n, a, env: f"mx.reshape({a[0]}, {py_literal(n.attrs['shape'])})",
    "transpose": lambda n, a, env: f"mx.transpose({a[0]}, {list(n.attrs['perm'])})",
    "slice": lambda n, a, env: slice_expr(n, a[0]),
    "concat": lambda n, a, env: f"mx.concatenate([{', '.join(a)}], axis={n.attrs['axis']})",
    "take": _take,
    "sum": _reduce("mx.sum"),
    "max": _reduce("mx.max"),
    "matmul": _matmul,
    "softmax": lambda n, a, env: f"mx.softmax({a[0]}, axis={n.attrs['axis']}, precise={n.attrs['precise']})",
    "sdpa": _sdpa,
    **{op: (lambda fn: lambda n, a, env: f"{fn}({a[0]}, {a[1]})")(fn) for op, fn in _LOGIC.items()},
    "rsqrt": lambda n, a, env: f"mx.rsqrt({a[0]})",
    **qsa_emitters(),
}


# Ops of imported models (attnpass.ir.from_mlx / from_jax).
EMITTERS.update(
    {
        "broadcast_to": lambda n, a, env: f"mx.broadcast_to({a[0]}, {py_literal(n.attrs['shape'])})",
        "sin": lambda n, a, env: f"mx.sin({a[0]})",
        "cos": lambda n, a, env: f"mx.cos({a[0]})",
        "sigmoid": lambda n, a, env: f"mx.sigmoid({a[0]})",
        "floor_divide": lambda n, a, env: f"mx.floor_divide({a[0]}, {a[1]})",
        "argpartition": lambda n, a, env: (
            f"mx.argpartition({a[0]}, {n.attrs['kth']}, axis={n.attrs['axis']}).astype(mx.int32)"
        ),
        "put_along_axis": lambda n, a, env: f"mx.put_along_axis({a[0]}, {a[1]}, {a[2]}, axis={n.attrs['axis']})",
    }
)

TARGET = Target("mlx", ("import mlx.core as mx", qsa_prelude("mlx")), EMITTERS, frozenset({"mx", QSA}))
