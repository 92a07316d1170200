"""The functions a traced model calls: ``from attnpass.ir import ops``.

Each builds one node of the op set in :mod:`attnpass.ir.dialects` (a few are
composites of several). Python scalars are accepted wherever a broadcastable
tensor fits and take the other operand's dtype.
"""

from __future__ import annotations

from math import prod
from typing import Any, Callable, Sequence

import attnpass.ir.dialects  # noqa: F401  (registers the ops built here)
from attnpass.ir.core.registry import get_op
from attnpass.ir.core.types import DType, ShapeError

from .tracer import Tensor, binary, constant, describe_location, emit, promote, user_location

__all__ = [
    "add", "sub", "mul", "div", "maximum", "floor_divide", "neg", "exp", "relu", "rsqrt", "sin", "cos",
    "sigmoid", "logical_and", "logical_or", "equal", "less", "greater_equal", "cast", "reshape",
    "broadcast_to", "transpose", "slice", "concat", "take", "where", "sum", "max", "matmul", "softmax",
    "sdpa", "sdpa_lse", "constant", "argpartition", "put_along_axis", "qsa_pool", "qsa_block_scores", "qsa_select",
    "qsa_mask", "qsa_cells", "qsa_cell_valid", "qsa_gather", "dynamic_update_slice", "addmm", "take_along_axis",
    "tanh", "erf", "log", "log1p", "expm1", "sqrt", "abs", "sign", "logical_not", "minimum", "power", "logaddexp",
]  # fmt: skip


def _binary_builder(op: str) -> Callable[[Any, Any], Tensor]:
    def build(x: Any, y: Any) -> Tensor:
        return binary(op, x, y)

    build.__name__ = build.__qualname__ = op
    build.__doc__ = get_op(op).doc + " One operand may be a Python scalar."
    return build


def _unary_builder(op: str) -> Callable[[Tensor], Tensor]:
    def build(x: Tensor) -> Tensor:
        return emit(op, [x])

    build.__name__ = build.__qualname__ = op
    build.__doc__ = get_op(op).doc
    return build


add = _binary_builder("add")
sub = _binary_builder("sub")
mul = _binary_builder("mul")
div = _binary_builder("div")
maximum = _binary_builder("maximum")
floor_divide = _binary_builder("floor_divide")
remainder = _binary_builder("remainder")
logical_and = _binary_builder("logical_and")
logical_or = _binary_builder("logical_or")
equal = _binary_builder("equal")
less = _binary_builder("less")
greater_equal = _binary_builder("greater_equal")
neg = _unary_builder("neg")
exp = _unary_builder("exp")
relu = _unary_builder("relu")
rsqrt = _unary_builder("rsqrt")
sin = _unary_builder("sin")
cos = _unary_builder("cos")
sigmoid = _unary_builder("sigmoid")


def cast(x: Tensor, dtype: DType | str) -> Tensor:
    """Convert to ``dtype`` (float to int truncates toward zero)."""
    return emit("cast", [x], {"dtype": DType.parse(dtype)})


def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    """Row-major reshape; one dimension may be -1."""
    shape = tuple(int(d) for d in shape)
    if shape.count(-1) > 1:
        raise ShapeError(f"reshape: at most one -1 in {list(shape)}")
    if -1 in shape:
        known = prod(d for d in shape if d != -1)
        if known == 0 or x.type.size % known:
            where = describe_location(user_location())
            raise ShapeError(f"reshape: cannot infer -1 in {list(shape)} for {x.type}{where}")
        shape = tuple(x.type.size // known if d == -1 else d for d in shape)
    return emit("reshape", [x], {"shape": shape})


def transpose(x: Tensor, perm: Sequence[int] | None = None) -> Tensor:
    """Permute axes (default: reverse them)."""
    perm = tuple(reversed(range(x.ndim))) if perm is None else tuple(int(p) for p in perm)
    return emit("transpose", [x], {"perm": perm})


def slice(x: Tensor, start: Sequence[int], stop: Sequence[int], step: Sequence[int] | None = None) -> Tensor:
    """Static strided slice with explicit per-axis bounds."""
    step = (1,) * x.ndim if step is None else tuple(step)
    return emit("slice", [x], {"start": tuple(start), "stop": tuple(stop), "step": step})


def concat(xs: Sequence[Tensor], axis: int = 0) -> Tensor:
    """Concatenate along ``axis``; the operands agree on every other axis and the dtype."""
    return emit("concat", list(xs), {"axis": int(axis)})


def take(x: Tensor, indices: Tensor, axis: int = 0) -> Tensor:
    """Gather along ``axis`` by int32 ``indices`` (numpy.take semantics; indices in range)."""
    return emit("take", [x, indices], {"axis": int(axis)})


def where(cond: Tensor, x: Any, y: Any) -> Tensor:
    """``cond ? x : y``; one of x, y may be a Python scalar (it takes the other's dtype)."""
    like = x if isinstance(x, Tensor) else y
    if not isinstance(like, Tensor):
        raise ShapeError("where: x or y must be a traced tensor (both are Python scalars)")
    return emit("where", [cond, promote(x, like), promote(y, like)])


def _axes(x: Tensor, axis: int | Sequence[int] | None) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(x.ndim))
    return (int(axis),) if isinstance(axis, int) else tuple(int(a) for a in axis)


def sum(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``axis`` (default: all axes); the result keeps the operand's dtype."""
    return emit("sum", [x], {"axes": _axes(x, axis), "keepdims": keepdims})


def max(x: Tensor, axis: int | Sequence[int] | None = None, keepdims: bool = False) -> Tensor:  # noqa: A001
    """Maximum over ``axis`` (default: all axes)."""
    return emit("max", [x], {"axes": _axes(x, axis), "keepdims": keepdims})


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` over the last two axes, batch axes broadcast; one dtype for both."""
    return emit("matmul", [a, b])


def softmax(x: Tensor, axis: int = -1, precise: bool = False) -> Tensor:
    """Softmax over ``axis``; ``precise=True`` computes in float32 for half inputs."""
    return emit("softmax", [x], {"axis": int(axis), "precise": precise})


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    mask: Tensor | None = None,
    causal: str | None = None,
    sinks: Tensor | None = None,
    logit_softcap: float | None = None,
    window: tuple[int | None, int | None, int | None] | None = None,
) -> Tensor:
    """Scaled dot-product attention, layout ``[B, H, S, D]``, GQA when K/V have fewer heads.

    ``mask``: bool (True = attend) or additive float, broadcastable to ``[B, Hq, S, T]``.
    ``causal``: None, ``"top_left"`` (JAX ``is_causal``) or ``"bottom_right"`` (MLX ``"causal"``).
    ``sinks``: ``[Hq]`` logits joining each row's softmax denominator (MLX's ``sinks=``).
    ``logit_softcap``: c, scaled scores become ``c * tanh(s / c)`` before the mask (gemma2).
    ``window``: ``(left, right, chunk)``, sliding window and chunk bounds (docs/semantics.md §1.4).
    """
    operands = {"q": q, "k": k, "v": v, "mask": mask, "sinks": sinks}
    attrs = {"scale": scale, "causal": causal or "none", "logit_softcap": logit_softcap, "window": window}
    return emit("sdpa", operands, attrs)


def sdpa_lse(q: Tensor, k: Tensor, v: Tensor, **options: Any) -> Tensor:
    """The log-sum-exp output of :func:`sdpa` for the same arguments (``scale``, ``mask``, ``causal``).

    f32 ``[B, Hq, S]``: logsumexp over the keys of the scaled, masked logits (JAX's ``return_residual``).
    """
    return _attention("sdpa_lse", q, k, v, **options)


def _attention(
    op: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float | None = None,
    mask: Tensor | None = None,
    causal: str | None = None,
) -> Tensor:
    return emit(op, {"q": q, "k": k, "v": v, "mask": mask}, {"scale": scale, "causal": causal or "none"})


# ----------------------------------------------------------------------------- QSA (attnpass.ir.dialects.qsa)


def qsa_pool(raw_keys: Tensor, *, ratio: int) -> Tensor:
    """Block keys ``[..., T//ratio, D]``: float32 mean of each complete block of ``ratio`` rows, cast back."""
    return emit("qsa_pool", [raw_keys], {"ratio": ratio})


def qsa_block_scores(idx_q: Tensor, block_keys: Tensor) -> Tensor:
    """f32 ``[B, S, NB]``: sum over heads of relu(idx_q . block_key) / sqrt(Di)."""
    return emit("qsa_block_scores", [idx_q, block_keys])


def qsa_select(block_scores: Tensor, positions: Tensor, *, ratio: int, top_k_blocks: int) -> Tensor:
    """i32 ``[B, S, K]``: the top min(K, n_complete) visible blocks ascending, then -1 (ties: lower id)."""
    return emit("qsa_select", [block_scores, positions], {"ratio": ratio, "top_k_blocks": top_k_blocks})


def qsa_mask(selection: Tensor, positions: Tensor, *, ratio: int, kv_len: int) -> Tensor:
    """bool ``[B, 1, S, kv_len]``: (selected blocks' cells | tail) & causal."""
    return emit("qsa_mask", [selection, positions], {"ratio": ratio, "kv_len": kv_len})


def qsa_cells(selection: Tensor, positions: Tensor, *, ratio: int, width: int, kv_len: int) -> Tensor:
    """i32 ``[B, S, width]``: selected cells, then ratio-1 tail slots, then padding (unused slots: cell 0)."""
    return emit("qsa_cells", [selection, positions], {"ratio": ratio, "width": width, "kv_len": kv_len})


def qsa_cell_valid(selection: Tensor, positions: Tensor, *, ratio: int, width: int, kv_len: int) -> Tensor:
    """bool ``[B, S, width]``: which slots of :func:`qsa_cells` hold a real cell."""
    return emit("qsa_cell_valid", [selection, positions], {"ratio": ratio, "width": width, "kv_len": kv_len})


def qsa_gather(x: Tensor, cells: Tensor) -> Tensor:
    """``[B*S, H, W, D]``: row ``b*S + s`` is ``x[b, :, cells[b, s]]`` (x ``[B, H, T, D]``, cells i32 ``[B, S, W]``)."""
    return emit("qsa_gather", [x, cells])


# ----------------------------------------------------------------------------- ops imported models need


def broadcast_to(x: Tensor, shape: Sequence[int]) -> Tensor:
    """numpy.broadcast_to: an explicit broadcast (no arithmetic)."""
    return emit("broadcast_to", [x], {"shape": tuple(int(d) for d in shape)})


def argpartition(x: Tensor, kth: int, axis: int = -1) -> Tensor:
    """int32 partition indices (order inside each side is target-defined)."""
    return emit("argpartition", [x], {"kth": int(kth), "axis": int(axis)})


def put_along_axis(x: Tensor, indices: Tensor, values: Tensor, axis: int) -> Tensor:
    """numpy.put_along_axis on a copy of ``x``."""
    return emit("put_along_axis", [x, indices, values], {"axis": int(axis)})


def dynamic_update_slice(buffer: Tensor, update: Tensor, start: Tensor) -> Tensor:
    """A copy of ``buffer`` with ``update`` written at the int32 offsets ``start`` (clamped so it fits)."""
    return emit("dynamic_update_slice", [buffer, update, start])


def addmm(c: Tensor, a: Tensor, b: Tensor, alpha: float = 1.0, beta: float = 1.0) -> Tensor:
    """beta * c + alpha * (a @ b), rounded once where the target fuses it (MLX's addmm)."""
    return emit("addmm", [c, a, b], {"alpha": float(alpha), "beta": float(beta)})


def take_along_axis(x: Tensor, indices: Tensor, axis: int) -> Tensor:
    """numpy.take_along_axis with int32 indices in range."""
    return emit("take_along_axis", [x, indices], {"axis": int(axis)})


# Ops of imported models, traceable too.
tanh = _unary_builder("tanh")
erf = _unary_builder("erf")
log = _unary_builder("log")
log1p = _unary_builder("log1p")
expm1 = _unary_builder("expm1")
sqrt = _unary_builder("sqrt")
abs = _unary_builder("abs")  # noqa: A001
sign = _unary_builder("sign")
logical_not = _unary_builder("logical_not")
minimum = _binary_builder("minimum")
power = _binary_builder("power")
logaddexp = _binary_builder("logaddexp")

# Rounding, arg reductions and conv1d (MLX Floor, Ceil, Round, ArgReduce, Convolution).
floor = _unary_builder("floor")
ceil = _unary_builder("ceil")
round = _unary_builder("round")  # noqa: A001


def argmax(x: Tensor, axis: int, keepdims: bool = False) -> Tensor:
    """int32 index of the maximum along ``axis``: the first on ties, the first NaN if any."""
    return emit("argmax", [x], {"axis": int(axis), "keepdims": keepdims})


def argmin(x: Tensor, axis: int, keepdims: bool = False) -> Tensor:
    """int32 index of the minimum along ``axis``: the first on ties, the first NaN if any."""
    return emit("argmin", [x], {"axis": int(axis), "keepdims": keepdims})


def argtopk(x: Tensor, k: int, axis: int = -1) -> Tensor:
    """int32 indices of the ``k`` largest along ``axis``, largest first, ties to the lower index
    (``jax.lax.top_k``'s indices; floats in IEEE total order)."""
    return emit("argtopk", [x], {"k": int(k), "axis": int(axis)})


def conv1d(
    x: Tensor, w: Tensor, *, stride: int = 1, padding: int | Sequence[int] = 0, dilation: int = 1, groups: int = 1
) -> Tensor:
    """``mx.conv1d``: x ``[N, L, C_in]``, w ``[C_out, K, C_in / groups]``; ``padding`` one int or (low, high)."""
    pad = (int(padding), int(padding)) if isinstance(padding, int) else tuple(int(p) for p in padding)
    attrs = {"stride": int(stride), "padding": pad, "dilation": int(dilation), "groups": int(groups)}
    return emit("conv1d", [x, w], attrs)


__all__ += ["floor", "ceil", "round", "argmax", "argmin", "argtopk", "conv1d"]


def scan(x: Tensor, kind: str, axis: int, *, reverse: bool = False, inclusive: bool = True) -> Tensor:
    """Cumulative ``kind`` ("sum", "prod", "max", "min") along ``axis``, as ``mx.cumsum`` and its kin."""
    return emit("scan", [x], {"kind": kind, "axis": int(axis), "reverse": reverse, "inclusive": inclusive})


__all__ += ["remainder", "scan"]


def dequantize(
    wq: Tensor, scales: Tensor, biases: Tensor, *, group_size: int = 64, bits: int = 4, dtype: DType | str | None = None
) -> Tensor:
    """``mx.dequantize`` (affine): packed int32 words (MLX's uint32 bits), scales and biases -> the float matrix in
    ``dtype`` (default: the scales' dtype)."""
    out = scales.type.dtype if dtype is None else DType.parse(dtype)
    return emit("dequantize", [wq, scales, biases], {"group_size": int(group_size), "bits": int(bits), "dtype": out})


def quantized_matmul(
    x: Tensor,
    wq: Tensor,
    scales: Tensor,
    biases: Tensor,
    *,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
) -> Tensor:
    """``mx.quantized_matmul`` (affine): ``x @ w^T`` (``transpose``) or ``x @ w``, w given packed as for
    :func:`dequantize`."""
    attrs = {"transpose": transpose, "group_size": int(group_size), "bits": int(bits)}
    return emit("quantized_matmul", [x, wq, scales, biases], attrs)


def quantize(w: Tensor, *, group_size: int = 64, bits: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """``mx.quantize`` (affine): ``(wq, scales, biases)``, the words int32 (MLX's uint32 bits)."""
    attrs = {"group_size": int(group_size), "bits": int(bits)}
    return tuple(emit("quantize", [w], {**attrs, "output": part}) for part in ("wq", "scales", "biases"))  # type: ignore[return-value]


def quantized_sdpa(
    q: Tensor,
    keys: Sequence[Tensor],
    values: Sequence[Tensor],
    *,
    scale: float,
    group_size: int = 64,
    bits: int = 4,
    mask: Tensor | None = None,
) -> Tensor:
    """mlx-lm's ``quantized_scaled_dot_product_attention``: ``q [B, Hq, S, D]`` over K and V each given as
    ``(words, scales, biases)`` ``[B, Hkv, T, .]`` (words int32, MLX's uint32 bits); ``mask`` bool (True =
    attend) or additive in q's dtype."""
    (kq, ks, kb), (vq, vs, vb) = keys, values
    operands = {"q": q, "kq": kq, "ks": ks, "kb": kb, "vq": vq, "vs": vs, "vb": vb, "mask": mask}
    return emit("quantized_sdpa", operands, {"scale": float(scale), "group_size": int(group_size), "bits": int(bits)})


__all__ += ["dequantize", "quantize", "quantized_matmul", "quantized_sdpa"]
