"""Emitters of the JAX target: ``jax.numpy`` calls; sdpa becomes ``jax.nn.dot_product_attention``.

``jax.nn.dot_product_attention`` wants ``[B, T, N, H]`` and equal q/v head
dims; the emitter transposes around it, and writes the explicit
softmax(q k^T * scale + mask) v form when the value head dim differs or the
dtype is float16 (which ``jax.jit`` of it cannot compile on CPU).
"""

from __future__ import annotations

from attnpass.ir import DType, Node
from attnpass.ir.dialects.evaluate import scan_identity
from attnpass.lowering.codegen import py_float, py_literal
from attnpass.lowering.common import (
    array_api_emitters,
    causal_offset,
    dtype_expr,
    explicit_sdpa_call,
    sdpa_scale,
    update_start,
    with_causal,
    zero_dead_rows,
)
from attnpass.lowering.qsa_emitters import QSA_EMITTERS
from attnpass.lowering.target import EmitEnv, Emitter


def _sdpa(n: Node, a: list[str], env: EmitEnv) -> str:
    if n.sinks is not None or n.attrs["logit_softcap"] is not None:  # jax.nn.dot_product_attention has neither
        return explicit_sdpa_call(n, a, env, "jnp", "attn")
    q, k, v = zero_dead_rows(n, env, "jnp", a[0]), a[1], a[2]
    offset = causal_offset(n, env)
    # jax.nn.dot_product_attention asks for float32 logits from float16 operands (F16_F16_F32), which
    # XLA:CPU rejects under jit, and from bfloat16 ones (BF16_BF16_F32) where batch, heads, query and key rows
    # are all 1 (its elemental emitter); those, and unequal value head dims, take the explicit form.
    (b, hq, rows, d), keys = env.type_of(n.q).shape, env.type_of(n.k).shape[2]
    one_cell = n.type.dtype is DType.bfloat16 and (b, hq, rows, keys) == (1, 1, 1, 1)
    explicit = n.type.dtype is DType.float16 or one_cell or env.type_of(n.v).shape[3] != d
    is_causal = offset == 0 and not explicit  # JAX's is_causal is top-left aligned
    mask, mask_is_bool = with_causal(n, env, "jnp", n.bind(a)["mask"], None if is_causal else offset)
    scale = sdpa_scale(n, env)
    if explicit:
        return f"{env.runtime('jrt')}.explicit_sdpa({q}, {k}, {v}, {mask}, scale={scale}, mask_is_bool={mask_is_bool})"
    kw = f"mask={mask}" if mask_is_bool else f"bias={mask}"
    extra = (f", {kw}" if mask is not None else "") + (", is_causal=True" if is_causal else "")
    bthd = "jnp.swapaxes({}, 1, 2)"
    args = ", ".join(bthd.format(x) for x in (q, k, v))
    return f"jnp.swapaxes(jax.nn.dot_product_attention({args}, scale={scale}{extra}), 1, 2)"


EMITTERS: dict[str, Emitter] = {
    **array_api_emitters("jnp"),
    "take": lambda n, a, env: f"jnp.take({a[0]}, {a[1]}, axis={n.attrs['axis']}, mode='clip')",
    "matmul": lambda n, a, env: f"jnp.matmul({a[0]}, {a[1]})",
    "softmax": lambda n, a, env: (
        f"jax.nn.softmax({a[0]}.astype(jnp.float32), axis={n.attrs['axis']}).astype({dtype_expr('jnp', n.type.dtype)})"
        if n.attrs["precise"] and n.type.dtype is not DType.float32
        else f"jax.nn.softmax({a[0]}, axis={n.attrs['axis']})"
    ),
    "sdpa": _sdpa,
    "iota": lambda n, a, env: (
        f"jax.lax.broadcasted_iota(jnp.int32, {py_literal(n.type.shape)}, {n.attrs['axis'] % n.type.rank})"
    ),
    "rsqrt": lambda n, a, env: f"jax.lax.rsqrt({a[0]})",
    "sigmoid": lambda n, a, env: f"jax.nn.sigmoid({a[0]})",
    "put_along_axis": lambda n, a, env: (
        f"jnp.put_along_axis({a[0]}, {a[1]}, {a[2]}, axis={n.attrs['axis']}, inplace=False)"
    ),
    "dynamic_update_slice": lambda n, a, env: (
        f"jax.lax.dynamic_update_slice({a[0]}, {a[1]}, {update_start(n, a[2], env, 'jnp')})"
    ),
    **QSA_EMITTERS,
}


def _addmm(n: Node, a: list[str], env: EmitEnv) -> str:
    """beta * c + alpha * (a @ b), accumulated in float32 and rounded once (as MLX's addmm)."""
    c, x, w = a
    alpha, beta = py_float(n.attrs["alpha"]), py_float(n.attrs["beta"])
    wide = f"{alpha} * jnp.matmul({x}, {w}, preferred_element_type=jnp.float32) + {beta} * {c}.astype(jnp.float32)"
    return f"({wide}).astype({dtype_expr('jnp', n.type.dtype)})"


# Ops of imported models (attnpass.ir.from_mlx / from_jax) that JAX spells its own way.
EMITTERS.update(
    {
        "erf": lambda n, a, env: f"jax.lax.erf({a[0]})",
        "addmm": _addmm,
        "take_along_axis": lambda n, a, env: (
            f"jnp.take_along_axis({a[0]}, {a[1]}, axis={n.attrs['axis']}, mode='clip')"
        ),
    }
)


def _conv1d(n: Node, a: list[str], env: EmitEnv) -> str:
    """``jax.lax.conv_general_dilated`` in MLX's layout: x NWC, w OWI (output channels, taps, input channels)."""
    at = n.attrs
    return (
        f"jax.lax.conv_general_dilated({a[0]}, {a[1]}, ({at['stride']},), [{py_literal(at['padding'])}], "
        f"rhs_dilation=({at['dilation']},), dimension_numbers=('NWC', 'OWI', 'NWC'), "
        f"feature_group_count={at['groups']})"
    )


EMITTERS["conv1d"] = _conv1d


def _scan(n: Node, a: list[str], env: EmitEnv) -> str:
    """``jax.lax.cum{kind}`` (reverse included); an exclusive scan is the inclusive scan of the operand shifted
    by one along the axis, the identity entering first."""
    at, t = n.attrs, n.type
    axis = at["axis"] % t.rank
    x = a[0]
    if not at["inclusive"]:
        length = t.shape[axis]
        edge = tuple(1 if i == axis else d for i, d in enumerate(t.shape))
        identity = py_literal(scan_identity(at["kind"], t.dtype))
        first = f"jnp.full({py_literal(edge)}, {identity}, {dtype_expr('jnp', t.dtype)})"
        start, stop = (1, length) if at["reverse"] else (0, length - 1)
        kept = f"jax.lax.slice_in_dim({x}, {start}, {stop}, axis={axis})"
        parts = [kept, first] if at["reverse"] else [first, kept]
        x = f"jnp.concatenate([{', '.join(parts)}], axis={axis})"
    return f"jax.lax.cum{at['kind']}({x}, axis={axis}, reverse={at['reverse']})"


EMITTERS["scan"] = _scan


def _argtopk(n: Node, a: list[str], env: EmitEnv) -> str:
    """``jax.lax.top_k``'s indices along the op's axis (moved last and back): the op's order is JAX's own."""
    axis, k = n.attrs["axis"] % n.type.rank, n.attrs["k"]
    if axis == n.type.rank - 1:
        return f"jax.lax.top_k({a[0]}, {k})[1]"
    return f"jnp.moveaxis(jax.lax.top_k(jnp.moveaxis({a[0]}, {axis}, -1), {k})[1], -1, {axis})"


EMITTERS["argtopk"] = _argtopk


def _quant(call: str, keys: tuple[str, ...]):
    """A call of the ``jrt`` quantization helper ``call`` with the op's attributes ``keys``."""

    def emit(n: Node, a: list[str], env: EmitEnv) -> str:
        value = {k: dtype_expr("jnp", n.attrs[k]) if k == "dtype" else repr(n.attrs[k]) for k in keys}
        attrs = ", ".join(f"{k}={v}" for k, v in value.items())
        return f"{env.runtime('jrt')}.{call}({', '.join(a)}, {attrs})"

    return emit


EMITTERS["dequantize"] = _quant("dequantize", ("group_size", "bits", "dtype"))
EMITTERS["quantized_matmul"] = _quant("quantized_matmul", ("transpose", "group_size", "bits"))
EMITTERS["quantize"] = _quant("quantize", ("group_size", "bits", "output"))
EMITTERS["quantized_sdpa"] = _quant("quantized_sdpa", ("scale", "group_size", "bits", "precision"))
