"""Import an MLX function as a graph, through ``mx.export_function``'s callback.

MLX hands the callback one record per primitive (``name``, ``arguments``,
``inputs``/``outputs`` as ``(id, shape, dtype)``) plus the captured
constants with their values. Each primitive maps to IR ops with its exact
parameters (:func:`_emit`); anything else raises
:class:`~attnpass.ir.importing.ModelImportError` naming the primitive, its
arguments, its operand types and the user's source line that made it.
Slices and gathers are normalised to the IR's canonical forms
(:mod:`.mlx_slices`); a function that reads an array's value on the host
(``.item()``, ``int(x)``) is refused at that line. The records carry no
lines: :mod:`.mlx_source` records them while the export traces the function,
and every node's location is that line, as a JAX import's is.
``mx.compile``'d helpers cannot be exported, so the import runs with
compilation disabled: each compiled helper's Python body, at each call's own
shapes, its primitives unfused. That is the function as written, and what MLX
computes uncompiled. Compiled, one kind of helper computes otherwise: an
``mx.compile(shapeless=True)`` helper replays its first trace at later shapes,
keeping what that trace resolved from its shapes (MLX resolves
``mx.argpartition``'s negative ``kth`` to ``kth + n`` of the first call:
mlx-vlm's hy_v4 indexer, ``kth=-index_topk``, traced on a prompt, then keeps
``index_topk`` of a longer step's keys that are not its top ones). That value
depends on which call traced the helper first; no graph of the function can
reproduce it, and the graph stays the function as written.

Captured constants are matched, by the buffer they share, with the arrays the
function reaches through its module, closure and globals, and named after
that path (:func:`~attnpass.ir.frontends.importing.captured_paths`).

Integers: the IR has int32 only. ``int64``/``uint32`` values are accepted
where MLX makes them from int32 values or as indices (``AsType`` from int32,
``ArgPartition``) and are imported as int32; index arithmetic in this range
is exact. uint32 arguments and captured arrays keep their bits as int32: the
packed words of a quantized matrix (``QuantizedMatmul``,
:mod:`attnpass.ir.dialects.quant`); a caller passes such an argument as
``words.view(mx.int32)`` (or numpy's ``.view(np.int32)``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from attnpass.ir.core.types import DType, SourceLoc, TensorType, native_dtype_name

from .importing import (
    INLINE_LIMIT,
    GraphBuilder,
    ImportedGraph,
    ModelImportError,
    captured_paths,
    dtype_of,
    graph_name,
    parameter_names,
    roots,
    walk,
)
from .example_args import mlx_static_scalars, require_call, require_callable, traced_error
from .mlx_slices import point_scatter, slice_update, strided_slice, wrapped_indices
from .mlx_source import LineRecorder, locate, raised_at

_WIDE_INTS = ("int64", "uint32")
_REDUCE = {2: "sum", 5: "max"}  # mlx::core::Reduce::ReduceType: And, Or, Sum, Prod, Min, Max
_BITWISE = {0: "logical_and", 1: "logical_or"}  # BitwiseBinary::Op: And, Or, Xor, LeftShift, RightShift
_SHIFTS = (3, 4)
_BINARY = {
    "Add": "add",
    "Subtract": "sub",
    "Multiply": "mul",
    "Divide": "div",
    "Maximum": "maximum",
    "FloorDivide": "floor_divide",
    "Remainder": "remainder",
    "Equal": "equal",
    "Less": "less",
    "GreaterEqual": "greater_equal",
    "LogicalAnd": "logical_and",
    "LogicalOr": "logical_or",
    "Minimum": "minimum",
    "Power": "power",
    "LogAddExp": "logaddexp",
}
_SWAPPED = {"Greater": "less", "LessEqual": "greater_equal"}  # x > y == y < x; x <= y == y >= x
_UNARY = {
    "Exp": "exp", "Negative": "neg", "Sin": "sin", "Cos": "cos", "Sigmoid": "sigmoid", "Tanh": "tanh", "Erf": "erf",
    "Log1p": "log1p", "Expm1": "expm1", "Abs": "abs", "Sign": "sign", "LogicalNot": "logical_not",
}  # fmt: skip
_ROUNDING = {"Floor": "floor", "Ceil": "ceil", "Round": "round"}  # the identity on integers
_ARG_REDUCE = {0: "argmin", 1: "argmax"}  # mlx::core::ArgReduce::ReduceType
# mlx::core::Scan::ReduceType; a Scan's state is (kind, axis, reverse, inclusive)
_SCAN = {0: "max", 1: "min", 2: "sum", 3: "prod"}
_NATURAL_LOG = 2  # mlx::core::Log::Base: two, ten, e
_ALIASES = ("Full", "Copy", "StopGradient")  # materialise or copy their operand: same values
_RESHAPES = ("Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze")  # the output shape says it all


class _Record:
    """One primitive record, with the context an error message needs."""

    def __init__(self, record: dict) -> None:
        self.name: str = record["name"]
        self.args: list = list(record.get("arguments", ()))
        self.inputs: list = list(record["inputs"])
        self.outputs: list = list(record["outputs"])

    def where(self) -> str:
        ins = ", ".join(f"{native_dtype_name(d)}{list(s)}" for _i, s, d in self.inputs) or "none"
        return f"{self.name} (arguments {self.args!r}; operands {ins})"

    def out_type(self, k: int = 0) -> TensorType:
        _id, shape, dtype = self.outputs[k]
        name = native_dtype_name(dtype)
        return TensorType(tuple(shape), DType.int32 if name in _WIDE_INTS else dtype_of(name, self.where()))


def _gather_mm(b: GraphBuilder, a: str, w: str, lhs: str, rhs: str) -> str:
    """``mx.gather_mm``: ``a[lhs] @ w[rhs]`` over the flattened batch axes (MoE experts) as takes and a matmul."""
    index_shape = tuple(np.broadcast_shapes(b.type(lhs).shape, b.type(rhs).shape))
    picked = []
    for operand, indices in ((a, lhs), (w, rhs)):
        shape = b.type(operand).shape
        flat = b.reshape(operand, (int(np.prod(shape[:-2], dtype=np.int64)), *shape[-2:]))
        idx = b.broadcast(b.cast(indices, DType.int32), index_shape)
        picked.append(b.op("take", [flat, idx], {"axis": 0}))
    return b.op("matmul", picked)


def _conv1d(b: GraphBuilder, r: _Record, x: str, w: str) -> str:
    """MLX ``Convolution`` (stride, padding low, padding high, kernel dilation, input dilation, groups, flip),
    1-D and unflipped: ``conv1d``."""
    stride, low, high, dilation, input_dilation, groups, flip = r.args
    if len(stride) != 1:
        raise ModelImportError(f"{r.where()}: only 1-D convolutions (conv1d) are supported, not {len(stride)}-D")
    if input_dilation != [1] or flip:
        raise ModelImportError(
            f"{r.where()}: input dilation and flipped kernels (conv_transpose, conv_general(flip=True)) are not "
            "supported: only mx.conv1d / conv_general with input_dilation=1, flip=False"
        )
    attrs = {"stride": stride[0], "padding": (low[0], high[0]), "dilation": dilation[0], "groups": groups}
    return b.op("conv1d", [x, w], attrs)


_AFFINE = 0  # mlx::core::QuantizationMode: affine, mxfp4, ...


def _quantized_matmul(b: GraphBuilder, r: _Record, x: list[str]) -> str:
    """MLX ``QuantizedMatmul`` (group size, bits, mode, transpose), affine (scales and biases): ``quantized_matmul``."""
    group_size, bits, mode, transpose = r.args
    if mode != _AFFINE or len(x) != 4:
        raise ModelImportError(
            f"{r.where()}: only affine quantization (mode 0, with scales and biases) is supported, not mode {mode}"
        )
    return b.op("quantized_matmul", x, {"transpose": bool(transpose), "group_size": group_size, "bits": bits})


def _quantize(b: GraphBuilder, r: _Record, w: str) -> list[str]:
    """MLX ``Quantize`` (group size, bits, mode, dequantize) in affine mode: one ``quantize`` per output."""
    group_size, bits, mode, dequantize = r.args
    if mode != _AFFINE or dequantize:
        what = f"mode {mode}" if mode != _AFFINE else "a quantize-dequantize round trip (dequantize=True)"
        raise ModelImportError(f"{r.where()}: only affine quantization (mode 0, three outputs) is imported, not {what}")
    attrs = {"group_size": group_size, "bits": bits}
    return [b.op("quantize", [w], {**attrs, "output": part}) for part in ("wq", "scales", "biases")]


Rule = Callable[[GraphBuilder, _Record, list[str]], list[str]]
IMPORTERS: dict[str, Rule] = {}  # MLX primitive name -> its rule: (builder, record, operand values) -> output values


def importer(*names: str) -> Callable[[Rule], Rule]:
    """Register the decorated rule as the import of the MLX primitives ``names``."""

    def register(rule: Rule) -> Rule:
        for name in names:
            IMPORTERS[name] = rule
        return rule

    return register


def _op(op: str, swapped: bool = False) -> Rule:
    """The rule of a primitive that is one IR op on its operands (``swapped``: the two operands exchanged)."""
    return lambda b, r, x: [b.op(op, x[::-1] if swapped else x)]


IMPORTERS.update({name: _op(op) for name, op in {**_BINARY, **_UNARY}.items()})
IMPORTERS.update({name: _op(op, swapped=True) for name, op in _SWAPPED.items()})
IMPORTERS.update({name: lambda b, r, x: [x[0]] for name in _ALIASES})
IMPORTERS.update({name: lambda b, r, x: [b.reshape(x[0], r.out_type().shape)] for name in _RESHAPES})


@importer(*_ROUNDING)
def _rounding(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [b.op(_ROUNDING[r.name], x) if b.type(x[0]).dtype.is_float else x[0]]


@importer("ArgReduce")
def _arg_reduce(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    kind, axis = r.args
    return [b.op(_ARG_REDUCE[kind], x, {"axis": axis, "keepdims": True})]


@importer("Convolution")
def _convolution(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [_conv1d(b, r, *x)]


@importer("Scan")
def _scan(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    kind, axis, reverse, inclusive = r.args
    out = r.out_type()
    operand = x[0] if b.type(x[0]).dtype is out.dtype else b.cast(x[0], out.dtype)  # cumsum of bools: int32
    attrs = {"kind": _SCAN[kind], "axis": axis, "reverse": reverse, "inclusive": inclusive}
    return [b.op("scan", [operand], attrs)]


@importer("Square")
def _square(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [b.op("mul", [x[0], x[0]])]


@importer("Sqrt")
def _sqrt(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [b.op("rsqrt" if r.args[0] else "sqrt", x)]


@importer("NotEqual")
def _not_equal(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [b.op("logical_not", [b.op("equal", x)])]


@importer("Log")
def _log(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    if r.args[0] != _NATURAL_LOG:
        raise ModelImportError(f"{r.where()}: only the natural logarithm is supported (not log2/log10)")
    return [b.op("log", x)]


@importer("AddMM")
def _addmm(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    alpha, beta = r.args
    return [b.op("addmm", [x[2], x[0], x[1]], {"alpha": alpha, "beta": beta})]


@importer("GatherAxis")
def _gather_axis(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    axis = r.args[0]
    indices = wrapped_indices(b, x[1], b.type(x[0]).shape[axis])
    return [b.op("take_along_axis", [x[0], indices], {"axis": axis})]


@importer("GatherMM")
def _gather_mm_rule(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [_gather_mm(b, *x)]


@importer("BitwiseBinary")
def _bitwise(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    if r.args[0] in _SHIFTS and native_dtype_name(r.inputs[0][2]) == "uint32":
        raise ModelImportError(
            f"{r.where()}: shifts of packed uint32 words are not imported. mx.dequantize records no primitive of "
            "its own: MLX exports it as these shifts, a cast, a multiply and an add. Use mx.quantized_matmul on "
            "the packed weights (imported as quantized_matmul), or dequantize them before the import"
        )
    if r.args[0] not in _BITWISE or b.type(x[0]).dtype is not DType.bool:
        raise ModelImportError(f"{r.where()}: only bool and/or are supported")
    return [b.op(_BITWISE[r.args[0]], x)]


@importer("Select")
def _select(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [b.op("where", x)]


@importer("AsType")
def _as_type(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    source = native_dtype_name(r.inputs[0][2])
    if native_dtype_name(r.args[0]) in _WIDE_INTS and source != "int32" and source not in _WIDE_INTS:
        raise ModelImportError(f"{r.where()}: a cast to {native_dtype_name(r.args[0])} is imported only from int32")
    return [b.cast(x[0], r.out_type().dtype)]


@importer("Broadcast")
def _broadcast(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [b.broadcast(x[0], r.args[0])]


@importer("Transpose")
def _transpose(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [b.op("transpose", x, {"perm": tuple(r.args[0])})]


@importer("Slice")
def _slice(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    start, _stop, step = r.args  # MLX's stop is as written (-1, beyond the size): the result's size says it
    return [strided_slice(b, x[0], start, step, r.out_type().shape, r.where())]


@importer("SliceUpdate")
def _slice_update(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    kind, start, _stop, step = r.args
    if kind != 4:
        raise ModelImportError(f"{r.where()}: only plain assignment (SliceUpdate None) is supported")
    return [slice_update(b, x[0], x[1], start, step, r.where())]


@importer("Concatenate")
def _concatenate(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [b.op("concat", x, {"axis": r.args[0]})]


@importer("Split")
def _split(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    indices, axis = r.args
    bounds = [0, *indices, b.type(x[0]).shape[axis]]
    return [b.slice_axis(x[0], axis, lo, hi) for lo, hi in zip(bounds, bounds[1:])]


@importer("Pad")
def _pad(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    axes, low, high = r.args
    y = x[0]
    for axis, lo, hi in zip(axes, low, high):
        if lo < 0 or hi < 0:
            raise ModelImportError(f"{r.where()}: negative padding is not supported")
        y = b.pad_axis(y, axis, lo, hi, x[1])
    return [y]


@importer("Reduce")
def _reduce(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    kind, axes = r.args
    if kind not in _REDUCE:
        raise ModelImportError(f"{r.where()}: reduce type {kind} is not supported (sum and max are)")
    return [b.op(_REDUCE[kind], x, {"axes": tuple(axes), "keepdims": True})]


@importer("Softmax")
def _softmax(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [b.op("softmax", x, {"axis": -1, "precise": bool(r.args[0])})]


@importer("Matmul")
def _matmul(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [b.op("matmul", x)]


@importer("QuantizedMatmul")
def _quantized_matmul_rule(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return [_quantized_matmul(b, r, x)]


@importer("Quantize")
def _quantize_rule(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    return _quantize(b, r, x[0])


@importer("Arange")
def _arange(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    start, stop, step = r.args
    dtype = r.out_type().dtype
    return [b.constant(np.arange(start, stop, step).astype(dtype.numpy), dtype, "arange", inline=True)]


@importer("Gather")
def _gather(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    axes, slice_sizes = r.args
    shape = b.type(x[0]).shape
    indices = [wrapped_indices(b, i, shape[a]) for i, a in zip(x[1:], axes)]
    return [b.gather(x[0], indices, tuple(axes), tuple(slice_sizes))]


@importer("ArgPartition")
def _arg_partition(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    kth, axis = r.args
    return [b.op("argpartition", x, {"kth": kth, "axis": axis})]


@importer("Partition")
def _partition(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    """``mx.partition``, ``mx.topk``: the values at argpartition's indices."""
    kth, axis = r.args
    order = b.op("argpartition", x, {"kth": kth, "axis": axis})
    return [b.op("take_along_axis", [x[0], order], {"axis": axis})]


@importer("ScatterAxis")
def _scatter_axis(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    kind, axis = r.args
    if kind != 1:
        raise ModelImportError(f"{r.where()}: only plain put_along_axis (ScatterAxis None) is supported")
    return [b.op("put_along_axis", [x[0], b.cast(x[1], DType.int32), x[2]], {"axis": axis})]


@importer("Scatter")
def _scatter(b: GraphBuilder, r: _Record, x: list[str]) -> list[str]:
    """``x[i, j, k] = v``."""
    kind, axes = r.args
    if kind != 4:
        raise ModelImportError(f"{r.where()}: only plain assignment (Scatter None) is supported")
    return [point_scatter(b, x[0], x[1:-1], x[-1], axes, r.where())]


def _emit(b: GraphBuilder, r: _Record, fn: Callable) -> list[str]:
    """IR values for the outputs of one primitive of ``fn``: its rule in :data:`IMPORTERS`."""
    rule = IMPORTERS.get(r.name)
    if rule is None:
        hint = _random_bits_hint(fn) if r.name == "RandomBits" else ""
        raise ModelImportError(
            f"unsupported MLX primitive {r.where()}{hint}; the MLX importer supports {', '.join(sorted(IMPORTERS))}"
        )
    return rule(b, r, [b.read(i[0]) for i in r.inputs])


def _random_bits_hint(fn: Callable) -> str:
    """Why ``fn`` draws random bits: a dropout layer in training mode (MLX modules start in it), else parameters
    not evaluated yet (their initialisers are random)."""
    import mlx.nn as nn

    dropouts = (nn.Dropout, nn.Dropout2d, nn.Dropout3d)
    for _name, root in roots(fn):
        if _is_module(root) and any(isinstance(m, dropouts) and m.training for m in root.modules()):
            return " (a module is in training mode and its dropout draws random bits: call model.eval() first)"
    return " (evaluate the parameters first: mx.eval(model.parameters()))"


def _buffer_key(array: Any) -> tuple | None:
    """Where an evaluated MLX array's data lives (address, shape, dtype): shared by every view of one buffer."""
    try:
        address = np.frombuffer(memoryview(array), np.uint8).__array_interface__["data"][0]
    except Exception:  # empty, strided, or not evaluable (a tracer left by an earlier export): not matched
        return None
    return address, tuple(array.shape), native_dtype_name(array.dtype)


def _captured_names(reachable: list[tuple[str, Any]], constants: list[tuple[str, Any]]) -> dict[tuple, str]:
    """Buffer key -> path of the reachable arrays that may be captured constants (same shape and dtype).

    ``reachable`` holds handles taken before the export (:func:`_handles`); only the candidates are
    evaluated for their address, and constants are evaluated already.
    """
    wanted = {(tuple(a.shape), native_dtype_name(a.dtype)) for _key, a in constants}
    names: dict[tuple, str] = {}
    for path, array in reachable:
        if (tuple(array.shape), native_dtype_name(array.dtype)) in wanted:
            key = _buffer_key(array)
            if key is not None:
                names.setdefault(key, path)
    return names


def _handles(reachable: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A second handle on each array's buffer, for :func:`_captured_names` after the export.

    The export may overwrite an array object in place: ``cache.keys[..., i:j, :] = k`` in a KV cache's
    ``update_and_fetch`` makes ``cache.keys`` the traced update, while the export's constant is the buffer
    it held before. ``astype`` to the same dtype is a new object on that buffer (nothing is evaluated).
    """
    return [(path, array.astype(array.dtype)) for path, array in reachable]


def _is_module(value: Any) -> bool:
    import mlx.nn as nn

    return isinstance(value, nn.Module)


def _export_records(fn: Callable, example_args: tuple) -> list[dict]:
    import mlx.core as mx

    records: list[dict] = []
    mx.export_function(records.append, fn, *example_args)
    return records


_NO_STATE = "[export_function] Unable to get state for primitive "


def _export_traced(fn: Callable, example_args: tuple, recorder: LineRecorder) -> list[dict]:
    """The records of ``fn`` with the recorder's extra outputs, or without them (no lines) when they cannot
    be exported: an array made from an example argument itself rather than from its tracer, or one made by
    a primitive MLX cannot export (``mx.contiguous`` of a cache's state, which the outputs may not need)."""
    try:
        return _export_records(recorder.wrap(fn, example_args), example_args)
    except ValueError as exc:
        if ("uncaptured inputs" not in str(exc) and _NO_STATE not in str(exc)) or not recorder.found:
            raise
    recorder.forget()
    return _export_records(fn, example_args)


def _unexportable_error(fn: Callable, exc: Exception) -> ModelImportError:
    """MLX's export has no state for a primitive the function's outputs need: name it and what to do."""
    primitive = str(exc).split(_NO_STATE, 1)[1].strip()
    hint = _COMPILED_HINT if primitive.startswith("Compiled") else _NO_STATE_HINTS.get(primitive, _NO_STATE_HINT)
    return ModelImportError(
        f"{graph_name(fn, None)} computes its outputs with MLX primitive {primitive}, which mx.export_function "
        f"cannot export (it records no state for it): {hint}"
    )


_COMPILED_HINT = (
    "it was computed by an mx.compile'd function before the import (the import runs with compilation off), and "
    "the function captures it unevaluated; evaluate what the function captures (mx.eval) before the import"
)


_NO_STATE_HINT = (
    "replace the call that makes it (mx.contiguous, a custom Metal kernel, a compiled or fast-path function) "
    "by plain mlx.core ops, or leave its result out of the function's outputs"
)
_NO_STATE_HINTS = {
    "Contiguous": "mx.contiguous(x) copies x's values; call it as mx.contiguous (the import then reads it as x) "
    "or drop the call",
}


def _export(fn: Callable, example_args: tuple, recorder: LineRecorder) -> tuple[list[dict], bool]:
    """The export records of ``fn`` (traced by ``recorder``), and whether compilation was on (it is off meanwhile).

    ``mx.compile``'d code cannot be exported, so the export runs with compilation off from the start: a retry
    after a failed export would see the state the first attempt wrote (a cache's offset, its keys updated in
    place). ``mx.contiguous`` is the identity while the export runs: it copies its operand's values, and MLX
    cannot export its primitive (qwen3_next's cache update ``cache[0] = mx.contiguous(conv_input[:, -n:, :])``).
    """
    import mlx.core as mx

    compile_on = _compile_enabled()
    contiguous = mx.contiguous
    mx.disable_compile()
    mx.contiguous = _same_values
    try:
        return _export_traced(fn, example_args, recorder), compile_on
    finally:
        mx.contiguous = contiguous
        if compile_on:
            mx.enable_compile()


def _compile_enabled() -> bool:
    """Whether ``mx.compile`` is on (MLX has no getter): a compiled function then traces its Python body once
    for two calls of one signature; off, the body runs on every call."""
    import mlx.core as mx

    traced: list[int] = []
    probe = mx.compile(lambda x: traced.append(1) or x)
    x = mx.zeros((1,))
    probe(x), probe(x)
    return len(traced) == 1


def _same_values(a: Any, allow_col_major: bool = False) -> Any:
    return a


_HOST_READ = "[eval] Attempting to eval an array during function transformations"


def _host_read_error(fn: Callable, exc: Exception) -> ModelImportError:
    """What MLX's refusal to evaluate during the export means: ``fn`` reads an array's value on the host."""
    loc = raised_at(exc)
    at = f"at {loc}" if loc else "(its source line was not found)"
    return ModelImportError(
        f"{getattr(fn, '__qualname__', type(fn).__name__)} reads an array's value on the host {at} (.item(), int(), "
        "float(), np.array(), .tolist(), print, or an `if` on an array): the import traces the function without "
        "values, so it cannot. Keep "
        "the value an array (mx.where instead of `if`, array indices instead of Python ints), or make it a static "
        "argument: a Python number the function closes over (functools.partial) rather than an array it computes"
    )


def _custom_kernel_error(record: dict, at: str) -> ModelImportError:
    """A live ``CustomKernel`` primitive: an ``mx.fast.metal_kernel``, Metal source the IR cannot read and only MLX's
    Metal back-end runs."""
    kernel = _Record(record).args[0] if _Record(record).args else "?"
    return ModelImportError(
        f"MLX primitive CustomKernel {kernel} (an mx.fast.metal_kernel) is Metal source: the IR cannot import it, and "
        f"it runs only on MLX's Metal back-end (Apple silicon), so it needs Metal. Replace the kernel by the mlx.core "
        f"ops it computes\n  {at}"
    )


def _live(primitives: list[dict], outputs: list) -> tuple[list[int], set]:
    """The indices of the primitives ``outputs`` depend on, and the keys of every value they read
    (the recorder's extra outputs add primitives the function's outputs may not need)."""
    needed = {key for key, _s, _d in outputs}
    live = []
    for index in reversed(range(len(primitives))):
        if any(key in needed for key, _s, _d in primitives[index]["outputs"]):
            live.append(index)
            needed.update(key for key, _s, _d in primitives[index]["inputs"])
    return live[::-1], needed


def from_mlx(
    fn: Callable, *example_args: Any, name: str | None = None, inline_limit: int = INLINE_LIMIT, **keywords: Any
) -> ImportedGraph:
    """Import the MLX function ``fn`` traced on ``example_args`` (MLX arrays) as a verified graph.

    Arguments become streamed inputs named after ``fn``'s parameters; a Python bool, int or float argument is
    static, as ``mx.compile`` treats it (its value is in the graph, which has no input for it:
    :mod:`~attnpass.ir.frontends.example_args`); captured
    arrays become constants (at most ``inline_limit`` elements, or splats) or
    resident inputs whose values are in ``params``, named after where ``fn``
    reaches them (a module path such as ``model.layers.0.self_attn.q_proj.weight``,
    or ``cache.0.keys``; see :func:`~attnpass.ir.frontends.importing.captured_paths`).
    Node locations are the user's source lines that made each primitive (found while the export
    traces ``fn``, :class:`~attnpass.ir.frontends.mlx_source.LineRecorder`), else
    ``mlx:<fn>:<primitive index>``; an error names that line too. Example arguments ``fn`` cannot take and
    ``keywords`` (any but ``name`` and ``inline_limit``) are an ArgumentError naming ``fn``'s parameters; an
    error ``fn`` raises while it is traced (a matmul of mismatched shapes) a ModelImportError naming ``fn``,
    its line and MLX's message.
    """
    import mlx.core as mx

    require_callable("from_mlx", fn, example_args)
    require_call("from_mlx", fn, example_args, keywords)
    given = example_args
    traced, example_args, arg_names = mlx_static_scalars(fn, example_args)
    reachable = _handles(captured_paths(fn, lambda root: walk(root, lambda a: isinstance(a, mx.array)), _is_module))
    recorder = LineRecorder()
    try:
        records, compile_off = _export(traced, example_args, recorder)
    except Exception as exc:  # whatever fn raises is named, with its line and MLX's message
        if _NO_STATE in str(exc):
            raise _unexportable_error(fn, exc) from None
        if _HOST_READ in str(exc):
            raise _host_read_error(fn, exc) from None
        raise traced_error("from_mlx", fn, given, exc, raised_at(exc)) from exc
    lines = recorder.lines(records)
    b = GraphBuilder(graph_name(fn, name), inline_limit)
    by_type = {r["type"]: r for r in records if r["type"] != "primitive"}
    inputs = by_type["inputs"]["inputs"]
    for (key, shape, dtype), pname in zip(inputs, arg_names):
        name = native_dtype_name(dtype)  # uint32 arguments: packed words, an int32 input of their bits (pass .view)
        dt = DType.int32 if name == "uint32" else dtype_of(name, f"input {pname}")
        b.input(key, pname, TensorType(tuple(shape), dt))
    outputs = by_type["outputs"]["outputs"][: recorder.count]
    primitives = [r for r in records if r["type"] == "primitive"]
    live, needed = _live(primitives, outputs)
    kernel = next((i for i in live if primitives[i]["name"] == "CustomKernel"), None)
    if kernel is not None:  # before the constants: its operands may be packed weights of no IR dtype
        loc = lines.get(kernel) or locate(traced, example_args, primitives[kernel], compile_off=compile_off)
        raise _custom_kernel_error(primitives[kernel], f"at {loc}" if loc else f"at primitive #{kernel} of the export")
    constants = [(key, array) for key, array in by_type.get("constants", {}).get("constants", ()) if key in needed]
    names = _captured_names(reachable, constants)
    for key, array in constants:
        array_dtype = native_dtype_name(array.dtype)
        values = np.array(array.astype(mx.float32) if array_dtype == "bfloat16" else array)
        values = values.view(np.int32) if array_dtype == "uint32" else values  # packed words: their bits
        dtype = DType.int32 if array_dtype in _WIDE_INTS else dtype_of(array_dtype, f"captured array {key}")
        b.bind(key, b.constant(values, dtype, path=names.get(_buffer_key(array))))
    for index in live:
        record = primitives[index]
        r = _Record(record)
        b.loc = lines.get(index) or SourceLoc(f"mlx:{b.graph.name}", index, r.name)
        try:
            values = _emit(b, r, fn)
            for (key, shape, _dtype), value in zip(r.outputs, values):
                if b.type(value).shape != tuple(shape):
                    raise ModelImportError(f"{r.where()}: imported as {b.type(value)}, MLX says shape {list(shape)}")
                b.bind(key, value)
        except Exception as exc:  # say where: the user's line that made the primitive
            message = str(exc) if isinstance(exc, ModelImportError) else f"cannot import {r.where()}: {exc}"
            loc = lines.get(index) or locate(traced, example_args, record, compile_off=compile_off)
            at = f"at {loc}" if loc else f"at primitive #{index} of the export (its source line was not found)"
            raise ModelImportError(f"{message}\n  {at}") from None
    b.graph.set_outputs([b.read(key) for key, _s, _d in outputs])
    return ImportedGraph(b.graph.verify(), b.params)


__all__ = ["from_mlx"]
