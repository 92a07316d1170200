"""The JAX target: ``jax.numpy`` calls; sdpa becomes ``jax.nn.dot_product_attention``.

``jax.nn.dot_product_attention`` wants ``[B, T, N, H]`` and equal q/v head
dims; the emitter transposes around it, and writes the explicit
softmax(q k^T * scale + mask) v form when the value head dim differs or the
dtype is float16 (which ``jax.jit`` of it cannot compile on CPU).
"""

from __future__ import annotations

from attnpass.ir import DType, Node

from .codegen import EmitEnv, Target, py_float, py_literal
from .common import causal_offset, sdpa_lengths, sdpa_scale, slice_expr
from .qsa_emitters import ALIAS as QSA, qsa_emitters, qsa_prelude

_DTYPES = {
    DType.float32: "jnp.float32",
    DType.float16: "jnp.float16",
    DType.bfloat16: "jnp.bfloat16",
    DType.int32: "jnp.int32",
    DType.bool: "jnp.bool_",
}
_LOGIC = {
    "logical_and": "jnp.logical_and",
    "logical_or": "jnp.logical_or",
    "equal": "jnp.equal",
    "less": "jnp.less",
    "greater_equal": "jnp.greater_equal",
}
_BINARY = {"add": "jnp.add", "sub": "jnp.subtract", "mul": "jnp.multiply", "div": "jnp.divide", "maximum": "jnp.maximum"}


def _constant(n: Node, a: list[str], env: EmitEnv) -> str:
    values, shape, dt = n.attrs["value"], n.type.shape, _DTYPES[n.type.dtype]
    if len(values) == 1:
        value = py_literal(values[0])
        return f"jnp.asarray({value}, dtype={dt})" if not shape else f"jnp.full({py_literal(shape)}, {value}, dtype={dt})"
    return f"jnp.asarray({py_literal(values)}, dtype={dt}).reshape({py_literal(shape)})"


def _reduce(fn: str):
    def emit(n: Node, a: list[str], env: EmitEnv) -> str:
        axes = n.attrs["axes"]
        return f"{fn}({a[0]}, axis={py_literal(axes)}, keepdims={n.attrs['keepdims']})" if axes else a[0]

    return emit


def _sdpa(n: Node, a: list[str], env: EmitEnv) -> str:
    q, k, v = a[:3]
    mask = a[3] if len(a) == 4 else None
    mask_is_bool = mask is not None and env.type_of(n.inputs[3]).dtype is DType.bool
    s, t = sdpa_lengths(n, env)
    offset = causal_offset(n, env)
    # jax.nn.dot_product_attention asks for float32 logits from float16 operands (F16_F16_F32), which
    # XLA:CPU rejects under jit; float16 and unequal value head dims take the explicit form.
    explicit = n.type.dtype is DType.float16 or env.type_of(n.inputs[2]).shape[3] != env.type_of(n.inputs[0]).shape[3]
    is_causal = offset == 0 and not explicit
    if offset is not None and not is_causal:
        allowed = f"(jnp.arange({t})[None, :] <= jnp.arange({s})[:, None] + {offset})"
        if mask is None:
            mask, mask_is_bool = allowed, True
        elif mask_is_bool:
            mask = f"jnp.logical_and({mask}, {allowed})"
        else:
            mask = f"jnp.where({allowed}, {mask}, {py_float(float('-inf'))})"
    scale = sdpa_scale(n, env)
    if explicit:
        return f"jrt.explicit_sdpa({q}, {k}, {v}, {mask}, scale={scale}, mask_is_bool={mask_is_bool})"
    kw = f"mask={mask}" if mask_is_bool else f"bias={mask}"
    extra = (f", {kw}" if mask is not None else "") + (", is_causal=True" if is_causal else "")
    bthd = "jnp.swapaxes({}, 1, 2)"
    args = ", ".join(bthd.format(x) for x in (q, k, v))
    return f"jnp.swapaxes(jax.nn.dot_product_attention({args}, scale={scale}{extra}), 1, 2)"


EMITTERS = {
    **{op: (lambda fn: lambda n, a, env: f"{fn}({a[0]}, {a[1]})")(fn) for op, fn in _BINARY.items()},
    "constant": _constant,
    "neg": lambda n, a, env: f"jnp.negative({a[0]})",
    "exp": lambda n, a, env: f"jnp.exp({a[0]})",
    "relu": lambda n, a, env: f"jnp.maximum({a[0]}, jnp.asarray(0, dtype={_DTYPES[n.type.dtype]}))",
    "where": lambda n, a, env: f"jnp.where({a[0]}, {a[1]}, {a[2]})",
    "cast": lambda n, a, env: f"{a[0]}.astype({_DTYPES[n.type.dtype]})",
    "reshape": lambda n, a, env: f"jnp.reshape({a[0]}, {py_literal(n.attrs['shape'])})",
    "transpose": lambda n, a, env: f"jnp.transpose({a[0]}, {py_literal(n.attrs['perm'])})",
    "slice": lambda n, a, env: slice_expr(n, a[0]),
    "concat": lambda n, a, env: f"jnp.concatenate([{', '.join(a)}], axis={n.attrs['axis']})",
    "take": lambda n, a, env: f"jnp.take({a[0]}, {a[1]}, axis={n.attrs['axis']}, mode='clip')",
    "sum": _reduce("jnp.sum"),
    "max": _reduce("jnp.max"),
    "matmul": lambda n, a, env: f"jnp.matmul({a[0]}, {a[1]})",
    "softmax": lambda n, a, env: (
        f"jax.nn.softmax({a[0]}.astype(jnp.float32), axis={n.attrs['axis']}).astype({_DTYPES[n.type.dtype]})"
        if n.attrs["precise"] and n.type.dtype is not DType.float32
        else f"jax.nn.softmax({a[0]}, axis={n.attrs['axis']})"
    ),
    "sdpa": _sdpa,
    **{op: (lambda fn: lambda n, a, env: f"{fn}({a[0]}, {a[1]})")(fn) for op, fn in _LOGIC.items()},
    "rsqrt": lambda n, a, env: f"jax.lax.rsqrt({a[0]})",
    **qsa_emitters(),
}


# Ops of imported models (attnpass.ir.from_mlx / from_jax).
EMITTERS.update(
    {
        "broadcast_to": lambda n, a, env: f"jnp.broadcast_to({a[0]}, {py_literal(n.attrs['shape'])})",
        "sin": lambda n, a, env: f"jnp.sin({a[0]})",
        "cos": lambda n, a, env: f"jnp.cos({a[0]})",
        "sigmoid": lambda n, a, env: f"jax.nn.sigmoid({a[0]})",
        "floor_divide": lambda n, a, env: f"jnp.floor_divide({a[0]}, {a[1]})",
        "argpartition": lambda n, a, env: (
            f"jnp.argpartition({a[0]}, {n.attrs['kth']}, axis={n.attrs['axis']}).astype(jnp.int32)"
        ),
        "put_along_axis": lambda n, a, env: (
            f"jnp.put_along_axis({a[0]}, {a[1]}, {a[2]}, axis={n.attrs['axis']}, inplace=False)"
        ),
    }
)

TARGET = Target(
    "jax",
    ("import jax", "import jax.numpy as jnp", "from attnpass.lowering import jax_runtime as jrt", qsa_prelude("jax")),
    EMITTERS,
    frozenset({"jax", "jnp", "jrt", QSA}),
)
