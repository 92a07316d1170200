"""The MLX target: ``mlx.core`` calls; sdpa becomes ``mx.fast.scaled_dot_product_attention``."""

from __future__ import annotations

from attnpass.ir import DType, Node

from .codegen import EmitEnv, Target, py_float, py_literal
from .common import causal_offset, sdpa_lengths, sdpa_scale, slice_expr

_DTYPES = {
    DType.float32: "mx.float32",
    DType.float16: "mx.float16",
    DType.bfloat16: "mx.bfloat16",
    DType.int32: "mx.int32",
    DType.bool: "mx.bool_",
}
_BINARY = {"add": "mx.add", "sub": "mx.subtract", "mul": "mx.multiply", "div": "mx.divide", "maximum": "mx.maximum"}


def _constant(n: Node, a: list[str], env: EmitEnv) -> str:
    values, shape, dt = n.attrs["value"], n.type.shape, _DTYPES[n.type.dtype]
    if len(values) == 1:
        value = py_literal(values[0])
        return f"mx.array({value}, dtype={dt})" if not shape else f"mx.full({py_literal(shape)}, {value}, dtype={dt})"
    return f"mx.array({py_literal(values)}, dtype={dt}).reshape({py_literal(shape)})"


def _reduce(fn: str):
    def emit(n: Node, a: list[str], env: EmitEnv) -> str:
        axes = list(n.attrs["axes"])
        return f"{fn}({a[0]}, axis={axes}, keepdims={n.attrs['keepdims']})" if axes else a[0]

    return emit


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
    "take": lambda n, a, env: f"mx.take({a[0]}, {a[1]}, axis={n.attrs['axis']})",
    "sum": _reduce("mx.sum"),
    "max": _reduce("mx.max"),
    "matmul": lambda n, a, env: f"mx.matmul({a[0]}, {a[1]})",
    "softmax": lambda n, a, env: f"mx.softmax({a[0]}, axis={n.attrs['axis']}, precise={n.attrs['precise']})",
    "sdpa": _sdpa,
}

TARGET = Target("mlx", ("import mlx.core as mx",), EMITTERS, frozenset({"mx"}))
