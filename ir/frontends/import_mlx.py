"""Import an MLX function as a graph, through ``mx.export_function``'s callback.

MLX hands the callback one record per primitive (``name``, ``arguments``,
``inputs``/``outputs`` as ``(id, shape, dtype)``) plus the captured
constants with their values. Each primitive maps to IR ops with its exact
parameters (:data:`PRIMITIVES`); anything else raises
:class:`~attnpass.ir.importing.ModelImportError` naming the primitive, its
position, its arguments and its operand types. ``mx.compile``'d helpers cannot
be exported, so the import runs with compilation disabled (the same
primitives, unfused).

Integers: the IR has int32 only. ``int64``/``uint32`` values are accepted
where MLX makes them from int32 values or as indices (``AsType`` from int32,
``ArgPartition``) and are imported as int32; index arithmetic in this range
is exact.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from attnpass.ir.core.types import DType, SourceLoc, TensorType

from .importing import (
    INLINE_LIMIT,
    GraphBuilder,
    ImportedGraph,
    ModelImportError,
    dtype_of,
    graph_name,
    parameter_names,
)

_WIDE_INTS = ("int64", "uint32")
_REDUCE = {2: "sum", 5: "max"}  # mlx::core::Reduce::ReduceType: And, Or, Sum, Prod, Min, Max
_BITWISE = {0: "logical_and", 1: "logical_or"}  # BitwiseBinary::Op: And, Or, Xor, ...
_BINARY = {
    "Add": "add",
    "Subtract": "sub",
    "Multiply": "mul",
    "Divide": "div",
    "Maximum": "maximum",
    "FloorDivide": "floor_divide",
    "Equal": "equal",
    "Less": "less",
    "GreaterEqual": "greater_equal",
    "LogicalAnd": "logical_and",
    "LogicalOr": "logical_or",
}
_SWAPPED = {"Greater": "less", "LessEqual": "greater_equal"}  # x > y == y < x; x <= y == y >= x
_UNARY = {"Exp": "exp", "Negative": "neg", "Sin": "sin", "Cos": "cos", "Sigmoid": "sigmoid"}
_ALIASES = ("Full", "Copy", "StopGradient")  # materialise or copy their operand: same values
_RESHAPES = ("Reshape", "Flatten", "Unflatten", "ExpandDims", "Squeeze")  # the output shape says it all


def _dtype_name(dtype: Any) -> str:
    return str(dtype).rsplit(".", 1)[-1]


class _Record:
    """One primitive record, with the context an error message needs."""

    def __init__(self, index: int, record: dict) -> None:
        self.index = index
        self.name: str = record["name"]
        self.args: list = list(record.get("arguments", ()))
        self.inputs: list = list(record["inputs"])
        self.outputs: list = list(record["outputs"])

    def where(self) -> str:
        ins = ", ".join(f"{_dtype_name(d)}{list(s)}" for _i, s, d in self.inputs) or "none"
        return f"primitive #{self.index} {self.name} (arguments {self.args!r}; operands {ins})"

    def out_type(self, k: int = 0) -> TensorType:
        _id, shape, dtype = self.outputs[k]
        name = _dtype_name(dtype)
        return TensorType(tuple(shape), DType.int32 if name in _WIDE_INTS else dtype_of(name, self.where()))


def _emit(b: GraphBuilder, r: _Record) -> list[str]:
    """IR values for the outputs of one primitive."""
    x = [b.read(i[0]) for i in r.inputs]
    out = r.out_type()
    name = r.name
    if name in _BINARY:
        return [b.op(_BINARY[name], x)]
    if name in _SWAPPED:
        return [b.op(_SWAPPED[name], [x[1], x[0]])]
    if name in _UNARY:
        return [b.op(_UNARY[name], x)]
    if name in _ALIASES:
        return [x[0]]
    if name in _RESHAPES:
        return [b.reshape(x[0], out.shape)]
    if name == "Square":
        return [b.op("mul", [x[0], x[0]])]
    if name == "Sqrt":
        if r.args != [True]:
            raise ModelImportError(f"{r.where()}: only the reciprocal square root (Sqrt[True]) is supported")
        return [b.op("rsqrt", x)]
    if name == "BitwiseBinary":
        if r.args[0] not in _BITWISE or b.type(x[0]).dtype is not DType.bool:
            raise ModelImportError(f"{r.where()}: only bool and/or are supported")
        return [b.op(_BITWISE[r.args[0]], x)]
    if name == "Select":
        return [b.op("where", x)]
    if name == "AsType":
        source = _dtype_name(r.inputs[0][2])
        if _dtype_name(r.args[0]) in _WIDE_INTS and source != "int32" and source not in _WIDE_INTS:
            raise ModelImportError(f"{r.where()}: a cast to {_dtype_name(r.args[0])} is imported only from int32")
        return [b.cast(x[0], out.dtype)]
    if name == "Broadcast":
        return [b.broadcast(x[0], r.args[0])]
    if name == "Transpose":
        return [b.op("transpose", x, {"perm": tuple(r.args[0])})]
    if name == "Slice":
        start, stop, step = (tuple(a) for a in r.args)
        if any(s < 1 for s in step):
            raise ModelImportError(f"{r.where()}: negative or zero slice strides are not supported")
        return [b.op("slice", x, {"start": start, "stop": stop, "step": step})]
    if name == "SliceUpdate":
        _reduce, start, stop, step = r.args
        if any(s != 1 for s in step) or _reduce != 4:
            raise ModelImportError(f"{r.where()}: only plain assignment with unit strides is supported")
        return [b.update_box(x[0], x[1], tuple(start), tuple(stop))]
    if name == "Concatenate":
        return [b.op("concat", x, {"axis": r.args[0]})]
    if name == "Split":
        indices, axis = r.args
        bounds = [0, *indices, b.type(x[0]).shape[axis]]
        return [b.slice_axis(x[0], axis, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    if name == "Pad":
        axes, low, high = r.args
        y = x[0]
        for axis, lo, hi in zip(axes, low, high):
            if lo < 0 or hi < 0:
                raise ModelImportError(f"{r.where()}: negative padding is not supported")
            y = b.pad_axis(y, axis, lo, hi, x[1])
        return [y]
    if name == "Reduce":
        kind, axes = r.args
        if kind not in _REDUCE:
            raise ModelImportError(f"{r.where()}: reduce type {kind} is not supported (sum and max are)")
        return [b.op(_REDUCE[kind], x, {"axes": tuple(axes), "keepdims": True})]
    if name == "Softmax":
        return [b.op("softmax", x, {"axis": -1, "precise": bool(r.args[0])})]
    if name == "Matmul":
        return [b.op("matmul", x)]
    if name == "Arange":
        start, stop, step = r.args
        values = np.arange(start, stop, step).astype(out.dtype.numpy)
        return [b.constant(values, out.dtype, "arange", inline=True)]
    if name == "Gather":
        axes, slice_sizes = r.args
        return [b.gather(x[0], x[1:], tuple(axes), tuple(slice_sizes))]
    if name == "ArgPartition":
        kth, axis = r.args
        return [b.op("argpartition", x, {"kth": kth, "axis": axis})]
    if name == "ScatterAxis":
        kind, axis = r.args
        if kind != 1:
            raise ModelImportError(f"{r.where()}: only plain put_along_axis (ScatterAxis None) is supported")
        return [b.op("put_along_axis", [x[0], b.cast(x[1], DType.int32), x[2]], {"axis": axis})]
    hint = " (evaluate the parameters first: mx.eval(model.parameters()))" if name == "RandomBits" else ""
    raise ModelImportError(f"unsupported MLX primitive {name}: {r.where()}{hint}")


def from_mlx(fn: Callable, *example_args: Any, name: str | None = None, inline_limit: int = INLINE_LIMIT) -> ImportedGraph:
    """Import the MLX function ``fn`` traced on ``example_args`` (MLX arrays) as a verified graph.

    Arguments become streamed inputs named after ``fn``'s parameters; captured
    arrays become constants (at most ``inline_limit`` elements, or splats) or
    resident inputs whose values are in ``params``. Node locations read
    ``mlx:<fn>:<primitive index>``.
    """
    import mlx.core as mx

    records: list[dict] = []
    try:
        mx.export_function(records.append, fn, *example_args)
    except ValueError as exc:
        if "primitive Compiled" not in str(exc):
            raise
        # A fused mx.compile'd helper cannot be exported: retry with compilation off. Reaching
        # here means compilation was on, so turning it back on restores the caller's state.
        records.clear()
        mx.disable_compile()
        try:
            mx.export_function(records.append, fn, *example_args)
        finally:
            mx.enable_compile()
    b = GraphBuilder(graph_name(fn, name), inline_limit)
    by_type = {r["type"]: r for r in records if r["type"] != "primitive"}
    inputs = by_type["inputs"]["inputs"]
    for (key, shape, dtype), pname in zip(inputs, parameter_names(fn, len(inputs))):
        b.input(key, pname, TensorType(tuple(shape), dtype_of(_dtype_name(dtype), f"input {pname}")))
    for key, array in by_type.get("constants", {}).get("constants", ()):
        dtype_name = _dtype_name(array.dtype)
        if dtype_name == "bfloat16":
            values = np.array(array.astype(mx.float32))
        else:
            values = np.array(array)
        dtype = DType.int32 if dtype_name in _WIDE_INTS else dtype_of(dtype_name, f"captured array {key}")
        b.bind(key, b.constant(values, dtype))
    primitives = [r for r in records if r["type"] == "primitive"]
    for index, record in enumerate(primitives):
        r = _Record(index, record)
        b.loc = SourceLoc(f"mlx:{b.graph.name}", index, r.name)
        try:
            values = _emit(b, r)
        except ModelImportError:
            raise
        except Exception as exc:  # a shape rule or a malformed record: say which primitive
            raise ModelImportError(f"cannot import {r.where()}: {exc}") from None
        for (key, shape, _dtype), value in zip(r.outputs, values):
            if b.type(value).shape != tuple(shape):
                raise ModelImportError(f"{r.where()}: imported as {b.type(value)}, MLX says shape {list(shape)}")
            b.bind(key, value)
    b.graph.set_outputs([b.read(key) for key, _s, _d in by_type["outputs"]["outputs"]])
    return ImportedGraph(b.graph.verify(), b.params)


__all__ = ["from_mlx"]
