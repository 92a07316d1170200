"""Shared machinery of the model importers (:mod:`.import_mlx`, :mod:`.import_jax`).

An importer walks a backend's own program (MLX export records, a jaxpr) and
rebuilds it as a :class:`Graph` through a :class:`GraphBuilder`. The function's
arguments become streamed graph inputs; arrays the function closes over
(weights) become ``constant`` nodes when small and *resident* graph inputs
otherwise, named after where the function reaches them (:func:`captured_paths`),
whose values travel in :attr:`ImportedGraph.params` and, on disk, in a
safetensors file beside the graph JSON (:mod:`.weights`).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from attnpass.ir.core.builder import Builder
from attnpass.ir.core.graph import Graph
from attnpass.ir.core.types import AttnpassError, DType, TensorType

from .tracer import graph_name
from .weights import load_weights, require_weights_file, save_weights, weight_inputs, weights_file

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

    def save(self, path: str | Path) -> tuple[Path, Path | None]:
        """Write the graph JSON to ``path`` and the params beside it (``g.json`` -> ``g.safetensors``).

        Returns both paths (the second None when the graph has no weight inputs). ``graph.to_json()``
        alone writes the graph only; its weight inputs keep their paths, and loading it without the
        weights file fails with a message that says so.
        """
        path = Path(path)
        path.write_text(self.graph.to_json(indent=1) + "\n")
        if not weight_inputs(self.graph):
            return path, None
        return path, save_weights(self.graph, self.params, weights_file(path))

    @classmethod
    def load(cls, path: str | Path, weights: str | Path | None = None) -> "ImportedGraph":
        """Read a graph saved by :meth:`save` and its params (from ``weights``, else the file beside it).

        Raises ArgumentError when ``path`` is no file, GraphFormatError (naming ``path``) when it holds no graph.
        """
        import os

        from attnpass.ir.core.arguments import argument_error
        from attnpass.ir.core.types import GraphFormatError

        valid = "a graph JSON file (ImportedGraph.save writes one)"
        if not isinstance(path, (str, os.PathLike)):
            raise argument_error("ImportedGraph.load", "path", path, valid)
        if not Path(path).is_file():
            missing = "it does not exist" if not Path(path).exists() else "it is not a file"
            raise argument_error("ImportedGraph.load", "path", os.fspath(path), valid, missing)
        try:
            graph = Graph.from_json(Path(path).read_text())
        except GraphFormatError as exc:
            raise GraphFormatError(f"{path}: {exc}") from None
        file = require_weights_file(graph, path, weights)
        return cls(graph, load_weights(graph, file) if file is not None else {})


def roots(fn: Callable) -> list[tuple[str | None, Any]]:
    """What ``fn`` reads captured arrays through: itself or its ``__self__`` (unnamed), its closure, its globals;
    for a wrapper (``jax.jit(f)``, a ``functools.wraps`` decorator) then those of the function it wraps."""
    inner = inspect.unwrap(fn)
    return _own_roots(fn) + (_own_roots(inner) if inner is not fn else [])


def _own_roots(fn: Callable) -> list[tuple[str | None, Any]]:
    func = fn.__func__ if inspect.ismethod(fn) else fn
    owner = fn.__self__ if inspect.ismethod(fn) else fn
    roots: list[tuple[str | None, Any]] = [] if inspect.isfunction(owner) else [(None, owner)]
    if inspect.isfunction(func):
        code = func.__code__
        roots += [(n, c.cell_contents) for n, c in zip(code.co_freevars, func.__closure__ or ()) if _has_contents(c)]
        roots += [(n, func.__globals__[n]) for n in code.co_names if n in func.__globals__]
    return [(n, v) for n, v in roots if not inspect.ismodule(v) and not inspect.isclass(v) and not _is_code(v)]


def _has_contents(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _is_code(value: Any) -> bool:
    """Functions and builtins: code, not state that may hold arrays."""
    return inspect.isfunction(value) or inspect.isbuiltin(value) or inspect.ismethod(value)


def captured_paths(
    fn: Callable, leaves: Callable[[Any], Iterable[tuple[str, Any]]], is_module: Callable[[Any], bool]
) -> list[tuple[str, Any]]:
    """``(path, array)`` for every array ``fn`` can reach, in the order found; the first path of an array wins.

    ``leaves(root)`` lists a root's arrays with their paths inside it (module paths, pytree paths).
    A path is prefixed with the variable that holds the root (``cache.0.keys``), except for the
    function's own object and, when the function reads exactly one module, that module's paths:
    weights keep the names a checkpoint gives them (``model.layers.0.self_attn.q_proj.weight``).
    """
    found_roots = roots(fn)
    modules = [name for name, value in found_roots if name is not None and is_module(value)]
    bare = {None} | ({modules[0]} if len(modules) == 1 else set())
    found: list[tuple[str, Any]] = []
    for name, root in found_roots:
        for path, array in leaves(root):
            found.append((join_path(None if name in bare else name, path), array))
    return found


_WALK_DEPTH, _WALK_LIMIT = 12, 100_000  # how deep and how many objects walk visits from one variable


def walk(root: Any, is_array: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """``(path, array)`` for the arrays under ``root``: dict keys (an MLX ``nn.Module`` is a dict), list
    indices and object attributes, joined by dots (``model.layers.0.self_attn.q_proj.weight``, ``0.keys``)."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any, int]] = [("", root, 0)]
    while stack:
        path, obj, depth = stack.pop()
        if is_array(obj):
            found.append((path, obj))
            continue
        if depth >= _WALK_DEPTH or id(obj) in seen or len(seen) >= _WALK_LIMIT:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, (list, tuple)):
            items = list(enumerate(obj))
        elif hasattr(obj, "__dict__") and not (inspect.isroutine(obj) or inspect.isclass(obj) or inspect.ismodule(obj)):
            items = list(vars(obj).items())
        else:
            continue
        stack += [(f"{path}.{key}" if path else str(key), value, depth + 1) for key, value in reversed(items)]
    return found


def join_path(prefix: str | None, path: str) -> str:
    """``model`` + ``layers.0.w`` -> ``model.layers.0.w``; pytree key strings (``['w']``, ``.w``) attach as they are."""
    if not prefix:
        return path.lstrip(".") or "param"
    return prefix + path if path[:1] in ("[", ".") else ".".join(p for p in (prefix, path) if p)


_NAME_LIMIT = 200  # a sanitized name's longest form: room for fresh_name's suffix within MAX_NAME


def sanitize(path: str) -> str:
    """An input name for a parameter path: ``layers.0.q_proj.weight`` -> ``layers_0_q_proj_weight``.

    Only ASCII letters, digits and ``_`` survive (a path is a user string: it never reaches generated
    source unescaped); a name that would start with a digit gets ``p_``; a long one keeps its tail.
    """
    name = re.sub(r"[^0-9A-Za-z_]+", "_", path).strip("_") or "param"
    name = name if name[0].isalpha() or name[0] == "_" else f"p_{name}"
    return name if len(name) <= _NAME_LIMIT else "p_" + name[-_NAME_LIMIT + 2 :].lstrip("_")


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

    def input(self, key: Any, name: str, type_: TensorType, path: str | None = None) -> str:
        """A streamed graph input for an argument (``path``: its place in a pytree argument)."""
        self.values[key] = self.graph.add_input(self.graph.fresh_name(name), type_, path=path)
        return self.values[key]

    def read(self, key: Any) -> str:
        return self.values[key]

    def bind(self, key: Any, value: str) -> None:
        self.values[key] = value

    def constant(
        self, array: np.ndarray, dtype: DType, hint: str = "const", *, inline: bool = False, path: str | None = None
    ) -> str:
        """An array: a constant node when ``inline``, small or splatted, else a resident input.

        The input is named after ``path`` (where the function found the array, e.g. its module path),
        which it keeps as its ``path`` attribute; its values go to :attr:`params`.
        """
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
        name = self.graph.fresh_name(sanitize(path) if path else "param")
        type_ = TensorType(array.shape, dtype)
        self.graph.add_input(name, type_, "resident", self.loc, path=path or name)
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


__all__ = [
    "GraphBuilder",
    "ImportedGraph",
    "INLINE_LIMIT",
    "ModelImportError",
    "dtype_of",
    "graph_name",
    "parameter_names",
]
