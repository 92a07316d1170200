"""Emitter pieces shared by the targets: indexing, sdpa defaults, causal masks, numpy-named calls."""

from __future__ import annotations

import numpy as np

from attnpass.ir import DType, Node, format_slice
from attnpass.ir.dialects.attention import effective_scale, key_ranges
from attnpass.ir.dialects.evaluate import rounded

from .codegen import py_float, py_literal
from .target import EmitEnv, Emitter


def slice_expr(node: Node, x: str) -> str:
    """``x[a:b:c, ...]`` for a static slice node (plain Python indexing on every target)."""
    return f"{x}[{format_slice(node)}]" if node.attrs["start"] else x


def sdpa_scale(node: Node, env: EmitEnv) -> str:
    return py_float(effective_scale(node.attrs["scale"], env.type_of(node.q).shape[-1]))


def sdpa_lengths(node: Node, env: EmitEnv) -> tuple[int, int]:
    return env.type_of(node.q).shape[2], env.type_of(node.k).shape[2]


def causal_offset(node: Node, env: EmitEnv) -> int | None:
    """None when not causal; else the diagonal offset (top_left 0, bottom_right T - S)."""
    causal = node.attrs["causal"]
    if causal == "none":
        return None
    s, t = sdpa_lengths(node, env)
    return t - s if causal == "bottom_right" else 0


def dtype_name(dtype: DType) -> str:
    """``bfloat16``, ``bool_``: the dtype's attribute name in a numpy-named array library."""
    return "bool_" if dtype is DType.bool else dtype.value


def dtype_expr(xp: str, dtype: DType) -> str:
    """``mx.bfloat16``, ``jnp.bool_``: the dtype in a numpy-named array library imported as ``xp``."""
    return f"{xp}.{dtype_name(dtype)}"


def explicit_sdpa_call(node: Node, a: list[str], env: EmitEnv, xp: str, alias: str) -> str:
    """A call of the target's runtime ``explicit_sdpa`` (imported as ``alias``): the causal part folded into
    the mask; for sinks, logit soft-capping, or whatever else the fused call cannot take."""
    operands = node.bind(a)
    mask, sinks = operands["mask"], operands["sinks"]
    q = zero_dead_rows(node, env, xp, a[0])
    mask, is_bool = with_causal(node, env, xp, mask, causal_offset(node, env))
    return (
        f"{env.runtime(alias)}({q}, {a[1]}, {a[2]}, {mask}, {sinks}, scale={sdpa_scale(node, env)}, "
        f"mask_is_bool={is_bool}, softcap={node.attrs['logit_softcap']!r})"
    )


def with_causal(node: Node, env: EmitEnv, xp: str, mask: str | None, offset: int | None) -> tuple[str | None, bool]:
    """Fold the sdpa's causality (``offset``: its causal offset; None: left to the fused call) and its ``window``
    bounds into the mask expression: ``(mask, mask_is_bool)``.

    The structured part is explicit (a call of the one visibility,
    :func:`attnpass.ir.dialects.attention.visible`, docs/semantics.md §1.4), so
    its alignment never depends on the backend's convention. An additive mask
    keeps its values where allowed and becomes -inf elsewhere.
    """
    is_bool = mask is not None and env.type_of(node.mask).dtype is DType.bool
    allowed = _visible(node, env, xp, offset)
    if allowed is None:
        return mask, is_bool
    if mask is None:
        return allowed, True
    if is_bool:
        return f"{xp}.logical_and({mask}, {allowed})", True
    fill = f"{xp}.array({py_float(float('-inf'))}, dtype={dtype_expr(xp, node.type.dtype)})"
    if dead_rows(node, env):  # see zero_dead_rows: 0, not -inf, on the rows the structure leaves no key
        fill = f"{xp}.where({_live(xp, node, env)}, {fill}, {xp}.array(0, dtype={dtype_expr(xp, node.type.dtype)}))"
    return f"{xp}.where({allowed}, {mask}, {fill})", False


def _visible(node: Node, env: EmitEnv, xp: str, offset: int | None) -> str | None:
    """bool ``[S, T]`` code (None: no structure): a call of :func:`attnpass.ir.dialects.attention.visible`, the
    one implementation of causality and the window, on ``xp``. ``offset`` None: no causal part (the fused call
    applies it, JAX's top-left ``is_causal``: offset 0, so the window's positions are the rows)."""
    window = node.attrs.get("window")
    if offset is None and window is None:
        return None
    causal = "none" if offset is None else node.attrs["causal"]
    s, t = sdpa_lengths(node, env)
    return f"{env.runtime('visible')}({s}, {t}, {causal!r}, {py_literal(window)}, {xp})"


def _live_range(node: Node, env: EmitEnv) -> tuple[int, int]:
    """``[first, last)``: the query rows causality and the window leave at least one key (an interval)."""
    s, t = sdpa_lengths(node, env)
    lo, hi = key_ranges(s, t, node.attrs["causal"], node.attrs.get("window"))
    live = np.flatnonzero(hi > lo)
    return (int(live[0]), int(live[-1]) + 1) if live.size else (0, 0)


def dead_rows(node: Node, env: EmitEnv) -> int:
    """How many query rows causality and the window leave without any key and that must be the mean of V: none
    with sinks (such a row weighs only its sink, from the -inf mask alone)."""
    if node.sinks is not None or (node.attrs["causal"] == "none" and node.attrs.get("window") is None):
        return 0
    first, last = _live_range(node, env)
    return sdpa_lengths(node, env)[0] - (last - first)


def _live(xp: str, node: Node, env: EmitEnv) -> str:
    first, last = _live_range(node, env)
    rows = f"{xp}.arange({sdpa_lengths(node, env)[0]})"
    return f"(({rows} >= {first}) & ({rows} < {last}))[:, None]"


def zero_dead_rows(node: Node, env: EmitEnv, xp: str, q: str) -> str:
    """``q`` with the rows the structure leaves without a key zeroed, when the mask is additive.

    A row with no key is the mean of V (the peers' finite fill). Bool masks get
    it from the backends' own fill; an additive mask is arithmetic, so those
    rows get all-zero scores instead (zero query, 0 in the mask of
    :func:`with_causal`): equal weights, the same mean.
    """
    additive = node.mask is not None and env.type_of(node.mask).dtype is not DType.bool
    if not (additive and dead_rows(node, env)):
        return q
    return f"{xp}.where({_live(xp, node, env)}, {q}, {xp}.array(0, dtype={dtype_expr(xp, node.type.dtype)}))"


def update_start(node: Node, start: str, env: EmitEnv, xp: str) -> str:
    """The clamped start of a ``dynamic_update_slice``: ``xp.clip(start, 0, dim - update_dim)``."""
    buffer, update = env.type_of(node.buffer).shape, env.type_of(node.update).shape
    limit = py_literal(tuple(n - u for n, u in zip(buffer, update)))
    return f"{xp}.clip({start}, 0, {xp}.array({limit}, dtype={xp}.int32))"


def iota_expr(xp: str, node: Node) -> str:
    """``arange`` along the iota's axis, reshaped and broadcast to its shape, in the library imported as ``xp``."""
    shape = node.type.shape
    axis = node.attrs["axis"] % len(shape)
    along = tuple(n if i == axis else 1 for i, n in enumerate(shape))
    arange = f"{xp}.arange({shape[axis]}, dtype={xp}.int32)"
    return f"{xp}.broadcast_to({xp}.reshape({arange}, {py_literal(along)}), {py_literal(shape)})"


def constant_values(node: Node) -> tuple:
    """A constant's values, floats rounded by the reference's rule (exact in the dtype: no backend rounds again)."""
    values = node.attrs["value"]
    if node.type.dtype.is_float:
        values = tuple(float(v) for v in rounded(np.asarray(values, np.float64), node.type.dtype))
    return values


_CALL2 = {
    "add": "add", "sub": "subtract", "mul": "multiply", "div": "divide", "maximum": "maximum",
    "logical_and": "logical_and", "logical_or": "logical_or", "equal": "equal", "less": "less",
    "greater_equal": "greater_equal", "floor_divide": "floor_divide", "remainder": "remainder",
    "minimum": "minimum", "power": "power", "logaddexp": "logaddexp",
}  # fmt: skip
_CALL1 = {
    "neg": "negative", "exp": "exp", "sin": "sin", "cos": "cos",
    "tanh": "tanh", "log": "log", "log1p": "log1p", "expm1": "expm1", "sqrt": "sqrt", "abs": "abs", "sign": "sign",
    "logical_not": "logical_not",
    "floor": "floor", "ceil": "ceil", "round": "round",
}  # fmt: skip


def array_api_emitters(xp: str) -> dict[str, Emitter]:
    """Emitters shared by array libraries with numpy's names (``mx``, ``jnp``): alias ``xp``."""

    def dtype(n: Node) -> str:
        return dtype_expr(xp, n.type.dtype)

    def constant(n: Node, a: list[str], env: EmitEnv) -> str:
        values, shape = constant_values(n), py_literal(n.type.shape)
        if not values:  # no elements: a zero-size axis
            return f"{xp}.zeros({shape}, dtype={dtype(n)})"
        if len(values) > 1:
            return f"{xp}.array({py_literal(values)}, dtype={dtype(n)}).reshape({shape})"
        if not n.type.shape:
            return f"{xp}.array({py_literal(values[0])}, dtype={dtype(n)})"
        return f"{xp}.full({shape}, {py_literal(values[0])}, dtype={dtype(n)})"

    def reduce(fn: str) -> Emitter:
        def emit(n: Node, a: list[str], env: EmitEnv) -> str:
            axes = n.attrs["axes"]
            return f"{xp}.{fn}({a[0]}, axis={py_literal(axes)}, keepdims={n.attrs['keepdims']})" if axes else a[0]

        return emit

    def arg_reduce(fn: str) -> Emitter:
        return lambda n, a, env: (
            f"{xp}.{fn}({a[0]}, axis={n.attrs['axis']}, keepdims={n.attrs['keepdims']}).astype({xp}.int32)"
        )

    def sdpa_lse(n: Node, a: list[str], env: EmitEnv) -> str:
        mask = n.bind(a)["mask"]
        is_bool = mask is not None and env.type_of(n.mask).dtype is DType.bool
        return (
            f"{env.runtime('lse')}({a[0]}, {a[1]}, {mask}, scale={sdpa_scale(n, env)}, mask_is_bool={is_bool}, "
            f"causal={n.attrs['causal']!r}, softcap={n.attrs['logit_softcap']!r})"
        )

    table: dict[str, Emitter] = {
        **{op: (lambda fn: lambda n, a, env: f"{xp}.{fn}({a[0]}, {a[1]})")(fn) for op, fn in _CALL2.items()},
        **{op: (lambda fn: lambda n, a, env: f"{xp}.{fn}({a[0]})")(fn) for op, fn in _CALL1.items()},
        "constant": constant,
        "relu": lambda n, a, env: f"{xp}.maximum({a[0]}, {xp}.array(0, dtype={dtype(n)}))",
        "where": lambda n, a, env: f"{xp}.where({a[0]}, {a[1]}, {a[2]})",
        "cast": lambda n, a, env: f"{a[0]}.astype({dtype(n)})",
        "reshape": lambda n, a, env: f"{xp}.reshape({a[0]}, {py_literal(n.attrs['shape'])})",
        "broadcast_to": lambda n, a, env: f"{xp}.broadcast_to({a[0]}, {py_literal(n.attrs['shape'])})",
        "transpose": lambda n, a, env: f"{xp}.transpose({a[0]}, {py_literal(n.attrs['perm'])})",
        "slice": lambda n, a, env: slice_expr(n, a[0]),
        "concat": lambda n, a, env: f"{xp}.concatenate([{', '.join(a)}], axis={n.attrs['axis']})",
        "sum": reduce("sum"),
        "max": reduce("max"),
        "sdpa_lse": sdpa_lse,
        "iota": lambda n, a, env: iota_expr(xp, n),
        "argpartition": lambda n, a, env: (
            f"{xp}.argpartition({a[0]}, {n.attrs['kth']}, axis={n.attrs['axis']}).astype({xp}.int32)"
        ),
        **{op: arg_reduce(op) for op in ("argmax", "argmin")},
    }
    return table
