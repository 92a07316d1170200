"""Emitters of the numpy reference target: ``ref`` calls (float64 arithmetic, rounded per node)."""

from __future__ import annotations

from attnpass.ir import Node
from attnpass.lowering.codegen import py_float, py_literal
from attnpass.lowering.common import iota_expr, sdpa_scale, slice_expr
from attnpass.lowering.qsa_emitters import QSA_EMITTERS
from attnpass.lowering.target import EmitEnv, Emitter

_BINARY = {"add": "np.add", "sub": "np.subtract", "mul": "np.multiply", "div": "np.divide", "maximum": "np.maximum"}
_LOGIC = {
    "logical_and": "np.logical_and",
    "logical_or": "np.logical_or",
    "equal": "np.equal",
    "less": "np.less",
    "greater_equal": "np.greater_equal",
}
_UNARY = {"neg": "np.negative({x})", "exp": "np.exp({x})", "relu": "np.maximum({x}, 0)"}


def _dt(node: Node) -> str:
    return repr(node.type.dtype.value)


def _binary(fn: str):
    return lambda n, a, env: f"ref.rounded({fn}(ref.wide({a[0]}), ref.wide({a[1]})), {_dt(n)})"


def _unary(template: str):
    return lambda n, a, env: f"ref.rounded({template.format(x=f'ref.wide({a[0]})')}, {_dt(n)})"


def _reduce(fn: str):
    def emit(n: Node, a: list[str], env: EmitEnv) -> str:
        axes, keep = py_literal(n.attrs["axes"]), n.attrs["keepdims"]
        return f"ref.rounded({fn}(ref.wide({a[0]}), axis={axes}, keepdims={keep}), {_dt(n)})"

    return emit


def _sdpa(n: Node, a: list[str], env: EmitEnv) -> str:
    operands = n.bind(a)
    mask, sinks = (operands[x] or "None" for x in ("mask", "sinks"))
    return (
        f"ref.sdpa({a[0]}, {a[1]}, {a[2]}, {mask}, {sinks}, scale={sdpa_scale(n, env)}, "
        f"causal={n.attrs['causal']!r}, dtype={_dt(n)}, softcap={n.attrs['logit_softcap']!r}"
        + (f", window={tuple(n.attrs['window'])!r})" if n.attrs["window"] is not None else ")")
    )


def _sdpa_lse(n: Node, a: list[str], env: EmitEnv) -> str:
    mask = n.bind(a)["mask"] or "None"
    return (
        f"ref.sdpa_lse({a[0]}, {a[1]}, {mask}, scale={sdpa_scale(n, env)}, causal={n.attrs['causal']!r}, "
        f"softcap={n.attrs['logit_softcap']!r})"
    )


EMITTERS: dict[str, Emitter] = {
    **{op: _binary(fn) for op, fn in _BINARY.items()},
    **{op: _unary(t) for op, t in _UNARY.items()},
    "constant": lambda n, a, env: f"ref.constant({py_literal(n.attrs['value'])}, {py_literal(n.type.shape)}, {_dt(n)})",
    "where": lambda n, a, env: f"np.where({a[0]}, {a[1]}, {a[2]})",
    "cast": lambda n, a, env: f"ref.rounded({a[0]}, {_dt(n)})",
    "reshape": lambda n, a, env: f"np.reshape({a[0]}, {py_literal(n.attrs['shape'])})",
    "transpose": lambda n, a, env: f"np.transpose({a[0]}, {py_literal(n.attrs['perm'])})",
    "slice": lambda n, a, env: slice_expr(n, a[0]),
    "concat": lambda n, a, env: f"np.concatenate([{', '.join(a)}], axis={n.attrs['axis']})",
    "take": lambda n, a, env: f"np.take({a[0]}, {a[1]}, axis={n.attrs['axis']})",
    "sum": _reduce("np.sum"),
    "max": _reduce("np.max"),
    "matmul": lambda n, a, env: f"ref.rounded(np.matmul(ref.wide({a[0]}), ref.wide({a[1]})), {_dt(n)})",
    "softmax": lambda n, a, env: f"ref.softmax({a[0]}, {n.attrs['axis']}, {_dt(n)})",
    "sdpa": _sdpa,
    "sdpa_lse": _sdpa_lse,
    "iota": lambda n, a, env: iota_expr("np", n),
    "dynamic_update_slice": lambda n, a, env: f"ref.dynamic_update_slice({a[0]}, {a[1]}, {a[2]})",
    **{op: (lambda fn: lambda n, a, env: f"{fn}({a[0]}, {a[1]})")(fn) for op, fn in _LOGIC.items()},
    "rsqrt": lambda n, a, env: f"ref.rounded(1.0 / np.sqrt(ref.wide({a[0]})), {_dt(n)})",
    **QSA_EMITTERS,
}


# Ops of imported models (attnpass.ir.from_mlx / from_jax).
EMITTERS.update(
    {
        "broadcast_to": lambda n, a, env: f"np.broadcast_to({a[0]}, {py_literal(n.attrs['shape'])})",
        "sin": _unary("np.sin({x})"),
        "cos": _unary("np.cos({x})"),
        "sigmoid": _unary("1.0 / (1.0 + np.exp(-{x}))"),
        "floor_divide": _binary("np.floor_divide"),
        "argpartition": lambda n, a, env: (
            f"np.argpartition({a[0]}, {n.attrs['kth']}, axis={n.attrs['axis']}).astype(np.int32)"
        ),
        "put_along_axis": lambda n, a, env: f"ref.put_along_axis({a[0]}, {a[1]}, {a[2]}, {n.attrs['axis']})",
        "tanh": _unary("np.tanh({x})"),
        "erf": _unary("ref.erf({x})"),
        "log": _unary("np.log({x})"),
        "log1p": _unary("np.log1p({x})"),
        "expm1": _unary("np.expm1({x})"),
        "sqrt": _unary("np.sqrt({x})"),
        "abs": _unary("np.abs({x})"),
        "sign": _unary("np.sign({x})"),
        "logical_not": lambda n, a, env: f"np.logical_not({a[0]})",
        "minimum": _binary("np.minimum"),
        "power": _binary("np.power"),
        "logaddexp": _binary("np.logaddexp"),
        "take_along_axis": lambda n, a, env: f"np.take_along_axis({a[0]}, {a[1]}, axis={n.attrs['axis']})",
        "addmm": lambda n, a, env: (
            f"ref.rounded({py_float(n.attrs['beta'])} * ref.wide({a[0]}) + {py_float(n.attrs['alpha'])} * "
            f"np.matmul(ref.wide({a[1]}), ref.wide({a[2]})), {_dt(n)})"
        ),
    }
)


def _conv1d(n: Node, a: list[str], env: EmitEnv) -> str:
    at = n.attrs
    return (
        f"ref.conv1d({a[0]}, {a[1]}, stride={at['stride']}, padding={py_literal(at['padding'])}, "
        f"dilation={at['dilation']}, groups={at['groups']}, dtype={_dt(n)})"
    )


def _arg_reduce(fn: str):
    return lambda n, a, env: (
        f"{fn}(ref.wide({a[0]}), axis={n.attrs['axis']}, keepdims={n.attrs['keepdims']}).astype(np.int32)"
    )


# Rounding to integers, argmax/argmin and conv1d (MLX Floor, Ceil, Round, ArgReduce, Convolution).
EMITTERS.update(
    {
        "floor": _unary("np.floor({x})"),
        "ceil": _unary("np.ceil({x})"),
        "round": _unary("np.round({x})"),
        "argmax": _arg_reduce("np.argmax"),
        "argmin": _arg_reduce("np.argmin"),
        "conv1d": _conv1d,
    }
)


def _scan(n: Node, a: list[str], env: EmitEnv) -> str:
    at = n.attrs
    return (
        f"ref.scan({a[0]}, kind={at['kind']!r}, axis={at['axis']}, reverse={at['reverse']}, "
        f"inclusive={at['inclusive']}, dtype={_dt(n)})"
    )


EMITTERS["scan"] = _scan
EMITTERS["argtopk"] = lambda n, a, env: f"ref.argtopk({a[0]}, {n.attrs['k']}, {n.attrs['axis']})"
EMITTERS["remainder"] = lambda n, a, env: f"ref.remainder({a[0]}, {a[1]}, {_dt(n)})"
EMITTERS["dequantize"] = lambda n, a, env: (
    f"ref.dequantize({', '.join(a)}, group_size={n.attrs['group_size']}, bits={n.attrs['bits']}, dtype={_dt(n)})"
)
EMITTERS["quantized_matmul"] = lambda n, a, env: (
    f"ref.quantized_matmul({', '.join(a)}, transpose={n.attrs['transpose']}, group_size={n.attrs['group_size']}, "
    f"bits={n.attrs['bits']})"
)
EMITTERS["quantize"] = lambda n, a, env: (
    f"ref.quantize({a[0]}, group_size={n.attrs['group_size']}, bits={n.attrs['bits']}, output={n.attrs['output']!r})"
)
EMITTERS["quantized_sdpa"] = lambda n, a, env: (
    f"ref.quantized_sdpa({', '.join(a)}, scale={py_float(n.attrs['scale'])}, group_size={n.attrs['group_size']}, "
    f"bits={n.attrs['bits']}, precision={n.attrs['precision']!r})"
)
