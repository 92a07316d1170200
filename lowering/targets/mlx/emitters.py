"""Emitters of the MLX target: ``mlx.core`` calls; sdpa becomes ``mx.fast.scaled_dot_product_attention``."""

from __future__ import annotations

from typing import Literal

from attnpass.ir import Node
from attnpass.lowering.codegen import py_float, py_literal
from attnpass.lowering.common import (
    array_api_emitters,
    causal_offset,
    dtype_expr,
    explicit_sdpa_call,
    sdpa_lengths,
    sdpa_scale,
    update_start,
    with_causal,
    zero_dead_rows,
)
from attnpass.lowering.qsa_emitters import QSA_EMITTERS
from attnpass.lowering.target import EmitEnv, Emitter


def _matmul(n: Node, a: list[str], env: EmitEnv) -> str:
    """``mx.matmul``; the smaller operand, when a ``transpose`` made it, copied row-major first.

    MLX 0.32's CPU matmul reads a transposed view about 2x slower than a row-major array (the
    GQA-folded attention's ``k @ q^T``: 20 ms vs 10 ms at 2,051 cells, same bits); copying the
    small operand costs far less. The copy is a reshape to 1-D and back (``mx.contiguous`` cannot
    be exported by ``mx.export_function``).
    """
    if n.type.dtype.is_float:
        a = list(a)
        sizes = [env.type_of(i).size for i in n.inputs]
        small = 0 if sizes[0] <= sizes[1] else 1
        if env.graph.node(n.inputs[small]).op == "transpose":
            a[small] = row_major(a[small], env.type_of(n.inputs[small]).shape)
        return f"mx.matmul({a[0]}, {a[1]})"
    # mx.matmul takes floating types only; an exact int32 product: broadcast multiply, sum over K.
    return f"mx.sum(mx.expand_dims({a[0]}, -1) * mx.expand_dims({a[1]}, -3), axis=-2)"


def row_major(x: str, shape: tuple[int, ...]) -> str:
    """Code for a row-major copy of the MLX array ``x`` (a reshape to 1-D copies a non-contiguous view)."""
    return f"mx.reshape(mx.reshape({x}, (-1,)), {py_literal(shape)})"


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


def mask_kind(n: Node, env: EmitEnv) -> Literal["causal", "array"] | None:
    """What the MLX lowering passes as ``mask``: MLX's own bottom-right ``"causal"``, an array, or nothing."""
    offset = causal_offset(n, env)
    has_mask = n.mask is not None
    if has_mask or n.attrs["window"] is not None or offset is None:
        return "array" if has_mask or n.attrs["window"] is not None else None
    s, t = sdpa_lengths(n, env)
    return "causal" if offset == t - s and s <= t else "array"


def _sdpa(n: Node, a: list[str], env: EmitEnv) -> str:
    """MLX's fused call (with ``sinks=``); with logit soft-capping, which it lacks, the explicit form."""
    if n.attrs["logit_softcap"] is not None:
        return explicit_sdpa_call(n, a, env, "mx", "attn")
    q, k, v = zero_dead_rows(n, env, "mx", a[0]), a[1], a[2]
    operands = n.bind(a)
    mask, sinks = operands["mask"], operands["sinks"]
    if mask_kind(n, env) == "causal":
        mask = '"causal"'
    else:
        mask, _ = with_causal(n, env, "mx", mask, causal_offset(n, env))
    extra = (f", mask={mask}" if mask is not None else "") + (f", sinks={sinks}" if sinks is not None else "")
    return f"mx.fast.scaled_dot_product_attention({q}, {k}, {v}, scale={sdpa_scale(n, env)}{extra})"


EMITTERS: dict[str, Emitter] = {
    **array_api_emitters("mx"),
    "take": _take,
    "matmul": _matmul,
    "softmax": lambda n, a, env: f"mx.softmax({a[0]}, axis={n.attrs['axis']}, precise={n.attrs['precise']})",
    "sdpa": _sdpa,
    "rsqrt": lambda n, a, env: f"mx.rsqrt({a[0]})",
    "sigmoid": lambda n, a, env: f"mx.sigmoid({a[0]})",
    "put_along_axis": lambda n, a, env: f"mx.put_along_axis({a[0]}, {a[1]}, {a[2]}, axis={n.attrs['axis']})",
    "dynamic_update_slice": lambda n, a, env: (
        f"mx.slice_update({a[0]}, {a[1]}, {update_start(n, a[2], env, 'mx')}, "
        f"axes={py_literal(tuple(range(n.type.rank)))})"
    ),
    **QSA_EMITTERS,
}


# Ops of imported models (attnpass.ir.from_mlx / from_jax) that MLX spells its own way.
EMITTERS.update(
    {
        "erf": lambda n, a, env: f"mx.erf({a[0]})",
        "addmm": lambda n, a, env: (
            f"mx.addmm({a[0]}, {a[1]}, {a[2]}, alpha={py_float(n.attrs['alpha'])}, beta={py_float(n.attrs['beta'])})"
        ),
        "take_along_axis": lambda n, a, env: f"mx.take_along_axis({a[0]}, {a[1]}, axis={n.attrs['axis']})",
    }
)


def _conv1d(n: Node, a: list[str], env: EmitEnv) -> str:
    """``mx.conv_general`` (what ``mx.conv1d`` calls), with the (low, high) padding as MLX records it."""
    at = n.attrs
    low, high = at["padding"]
    return (
        f"mx.conv_general({a[0]}, {a[1]}, stride={at['stride']}, padding=([{low}], [{high}]), "
        f"kernel_dilation={at['dilation']}, groups={at['groups']})"
    )


EMITTERS["conv1d"] = _conv1d


def _scan(n: Node, a: list[str], env: EmitEnv) -> str:
    """``mx.cumsum`` / ``cumprod`` / ``cummax`` / ``cummin`` / ``logcumsumexp``, which take reverse and inclusive
    as the op does."""
    at = n.attrs
    fn = "logcumsumexp" if at["kind"] == "logsumexp" else f"cum{at['kind']}"
    return f"mx.{fn}({a[0]}, axis={at['axis']}, reverse={at['reverse']}, inclusive={at['inclusive']})"


EMITTERS["scan"] = _scan
EMITTERS["argtopk"] = lambda n, a, env: f"{env.runtime('argtopk')}({a[0]}, {n.attrs['k']}, {n.attrs['axis']})"


def _quant_args(n: Node, a: list[str], first: int) -> str:
    """The operands from ``first`` on, the packed words viewed as MLX's uint32, and the group size and bits."""
    words = f"mx.view({a[first]}, mx.uint32)"
    operands = ", ".join([*a[:first], words, *a[first + 1 :]])
    return f"{operands}, group_size={n.attrs['group_size']}, bits={n.attrs['bits']}"


EMITTERS["dequantize"] = lambda n, a, env: (
    f"mx.dequantize({_quant_args(n, a, 0)}, dtype={dtype_expr('mx', n.attrs['dtype'])})"
)
EMITTERS["quantized_matmul"] = lambda n, a, env: (
    f"mx.quantized_matmul({_quant_args(n, a, 1)}, transpose={n.attrs['transpose']})"
)


def _quantize(n: Node, a: list[str], env: EmitEnv) -> str:
    """One output of ``mx.quantize``; the words viewed as int32 (their bits)."""
    part = ("wq", "scales", "biases").index(n.attrs["output"])
    call = f"mx.quantize({a[0]}, group_size={n.attrs['group_size']}, bits={n.attrs['bits']})[{part}]"
    return f"mx.view({call}, mx.int32)" if part == 0 else call


EMITTERS["quantize"] = _quantize
EMITTERS["quantized_sdpa"] = lambda n, a, env: (
    f"{env.runtime('qsdpa')}({', '.join(a)}, scale={py_float(n.attrs['scale'])}, group_size={n.attrs['group_size']}, "
    f"bits={n.attrs['bits']}, precision={n.attrs['precision']!r})"
)
