"""Shared machinery of the model importers (:mod:`.import_mlx`, :mod:`.import_jax`).

An importer walks a backend's own program (MLX export records, a jaxpr) and
rebuilds it as a :class:`Graph` through a :class:`GraphBuilder`. The function's
arguments become streamed graph inputs; arrays the function closes over
(weights) become ``constant`` nodes when small and *resident* graph inputs
otherwise, whose values travel in :attr:`ImportedGraph.params`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from attnpass.ir.core.builder import Builder
from attnpass.ir.core.graph import Graph
from attnpass.ir.core.types import AttnpassError, DType, TensorType

from .tracer import graph_name

INLINE_LIMIT = 64  # captured arrays with at most this many elements become constant nodes


class ModelImportError(AttnpassError):
    """A backend program holds something the IR cannot express; the message says what and where."""


@dataclass(frozen=True)
class ImportedGraph:
    """An imported function: the verified graph and the values of its captured-array inputs.

    Call a lowered program with the function's own arguments first, then the
    params by name: ``lower(imp.graph, "mlx")(*args, **imp.params)``.
    """

    graph: Graph
    params: Mapping[str, np.ndarray] = field(default_factory=dict)


def parameter_names(fn: Callable, count: int) -> list[str]:
    """The first ``count`` positional parameter names of ``fn`` (``arg{i}`` where unknown)."""
    try:
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        params = []
    if params and inspect.signature(fn).parameters[params[-1]].kind is inspect.Parameter.VAR_POSITIONAL:
        params = params[:-1]
    names = params[:count] + [f"arg{i}" for i in range(len(params[:count]), count)]
    return [n if n.isidentifier() else f"arg{i}" for i, n in enumerate(names)]


class GraphBuilder(Builder):
    """Builds the graph of one import: backend value ids -> IR value names, at the current source location."""

    def __init__(self, name: str, inline_limit: int = INLINE_LIMIT) -> None:
        super().__init__(Graph(name))
        self.values: dict[Any, str] = {}
        self.params: dict[str, np.ndarray] = {}
        self.inline_limit = inline_limit

    def input(self, key: Any, name: str, type_: TensorType) -> str:
        self.values[key] = self.graph.add_input(self.graph.fresh_name(name), type_)
        return self.values[key]

    def read(self, key: Any) -> str:
        return self.values[key]

    def bind(self, key: Any, value: str) -> None:
        self.values[key] = value

    def constant(self, array: np.ndarray, dtype: DType, hint: str = "const", *, inline: bool = False) -> str:
        """An array: a constant node when ``inline``, small or splatted, else a resident input."""
        array = np.asarray(array)
        flat = array.reshape(-1)
        splat = flat.size > 0 and bool(np.all(flat == flat[0])) and not (dtype.is_float and np.isnan(flat).any())
        if inline or flat.size <= self.inline_limit or splat:
            values = flat[:1] if splat else flat
            if dtype.is_float:
                py = tuple(float(v) for v in values.astype(np.float64))
            elif dtype is DType.bool:
                py = tuple(bool(v) for v in values)
            else:
                py = tuple(int(v) for v in values)
            attrs = {"value": py, "shape": array.shape, "dtype": dtype}
            return self.op("constant", [], attrs, hint)
        name = self.graph.add_input(self.graph.fresh_name("param"), TensorType(array.shape, dtype), "resident", self.loc)
        self.params[name] = array.astype(dtype.numpy)
        return name

    def pad_axis(self, x: str, axis: int, low: int, high: int, fill: str) -> str:
        """Concatenate ``low``/``high`` copies of the scalar ``fill`` around ``x`` along ``axis``."""
        shape = list(self.type(x).shape)
        parts = []
        for count, where in ((low, 0), (high, 1)):
            if count:
                side = shape[:axis] + [count] + shape[axis + 1 :]
                parts.append((where, self.broadcast(self.reshape(fill, [1] * len(shape)), side)))
        if not parts:
            return x
        pieces = [p for w, p in parts if w == 0] + [x] + [p for w, p in parts if w == 1]
        return self.op("concat", pieces, {"axis": axis})

    def update_box(self, x: str, update: str, start: Sequence[int], stop: Sequence[int]) -> str:
        """``x`` with the box ``start:stop`` (unit strides) replaced by ``update``: slices and concats."""
        shape = self.type(x).shape
        for axis, (lo, hi, n) in enumerate(zip(start, stop, shape)):
            if (lo, hi) == (0, n):
                continue
            inner_start = (*start[:axis], 0, *start[axis + 1 :])
            inner_stop = (*stop[:axis], hi - lo, *stop[axis + 1 :])
            middle = self.update_box(self.slice_axis(x, axis, lo, hi), update, inner_start, inner_stop)
            pieces = [self.slice_axis(x, axis, 0, lo)] if lo else []
            pieces += [middle] + ([self.slice_axis(x, axis, hi, n)] if hi < n else [])
            return self.concat(pieces, axis)
        return update

    def gather(self, x: str, indices: Sequence[str], axes: Sequence[int], slice_sizes: Sequence[int]) -> str:
        """XLA/MLX-style gather of whole points: ``x[idx_0, idx_1, ...]`` on ``axes``, other axes sliced.

        Result shape ``broadcast(indices) + slice_sizes``; every indexed axis must have slice size 1.
        Several index arrays are folded into one flat index (int32 arithmetic) and one ``take``.
        """
        xt = self.type(x)
        for a in axes:
            if slice_sizes[a] != 1:
                raise ModelImportError(f"gather: slice size {slice_sizes[a]} on indexed axis {a} (only 1 is supported)")
        for a, (size, n) in enumerate(zip(slice_sizes, xt.shape)):
            if a not in axes:
                x = self.slice_axis(x, a, 0, size)
        idx_shape = tuple(np.broadcast_shapes(*(self.type(i).shape for i in indices)))
        rest = [a for a in range(xt.rank) if a not in axes]
        order = list(axes) + rest
        x = self.transpose(x, order)
        lead = [xt.shape[a] for a in axes]
        x = self.reshape(x, [math.prod(lead)] + [slice_sizes[a] for a in rest])
        flat = None
        for k, idx in enumerate(indices):
            idx = self.broadcast(self.cast(idx, DType.int32), idx_shape)
            stride = math.prod(lead[k + 1 :])
            term = idx if stride == 1 else self.op("mul", [idx, self.scalar(stride, DType.int32)])
            flat = term if flat is None else self.op("add", [flat, term])
        out = self.op("take", [x, flat], {"axis": 0})
        return self.reshape(out, idx_shape + tuple(slice_sizes))


def dtype_of(name: str, where: str) -> DType:
    """The IR dtype of a backend dtype name; raises ModelImportError naming the place."""
    try:
        return DType.parse(name)
    except AttnpassError:
        valid = ", ".join(d.value for d in DType)
        raise ModelImportError(f"{where}: dtype {name} is not in the IR (valid: {valid})") from None


__all__ = ["GraphBuilder", "ImportedGraph", "INLINE_LIMIT", "ModelImportError", "dtype_of", "graph_name", "parameter_names"]
