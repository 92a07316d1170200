"""Tracing Python functions into graphs.

``trace(fn, *specs)`` calls ``fn`` with one symbolic :class:`Tensor` per
parameter. Every ``attnpass.ir.ops`` call, Python operator and basic index on
a Tensor adds a node that remembers the user's source line; a shape error
names the op, the shapes and that line.
"""

from __future__ import annotations

import contextvars
import inspect
import keyword
import linecache
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from attnpass.ir.core.arguments import argument_error, require_choice
from attnpass.ir.core.graph import ROLES, Graph
from attnpass.ir.core.types import AttnpassError, DType, ShapeError, SourceLoc, TensorType

_LIBRARY_DIRS = tuple(
    str(Path(__file__).resolve().parents[2] / d) + os.sep for d in ("ir", "passes", "lowering", "backends")
)
_current: contextvars.ContextVar["_Trace | None"] = contextvars.ContextVar("attnpass_trace", default=None)


@dataclass(frozen=True)
class TensorSpec:
    """A graph input's static type and role ('streamed': host-filled each call; 'resident': on device)."""

    shape: tuple[int, ...]
    dtype: DType | str = "float32"
    role: str = "streamed"

    def __post_init__(self) -> None:
        """Every field checked here, not first at :func:`trace`: an ArgumentError names the field."""
        require_choice("TensorSpec", "role", self.role, ROLES)
        try:
            DType.parse(self.dtype)
        except AttnpassError:
            names = ", ".join(d.value if d.short == d.value else f"{d.value} ({d.short})" for d in DType)
            raise argument_error("TensorSpec", "dtype", self.dtype, f"a DType or one of {names}") from None
        try:
            TensorType(tuple(self.shape), DType.float32)
        except (AttnpassError, TypeError):
            raise argument_error(
                "TensorSpec", "shape", self.shape, "a tuple of non-negative ints, each at most 2**31 - 1"
            ) from None

    @property
    def type(self) -> TensorType:
        return TensorType(tuple(self.shape), DType.parse(self.dtype))


def user_location() -> SourceLoc | None:
    """The innermost stack frame outside this library."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_LIBRARY_DIRS):
            return SourceLoc(filename, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return None


def describe_location(loc: SourceLoc | None) -> str:
    if loc is None:
        return ""
    text = f"\n  at {loc}"
    line = linecache.getline(loc.file, loc.line).strip()
    return text + (f"\n    {line}" if line else "")


class _Trace:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.finished = False  # set when trace() returns; its tensors may no longer add nodes


class Tensor:
    """A symbolic value while tracing. Supports + - * / @, unary -, and basic indexing."""

    __array_priority__ = 1000  # numpy scalars defer to our reflected operators

    def __init__(self, trace: _Trace, name: str) -> None:
        self._trace = trace
        self.name = name

    @property
    def type(self) -> TensorType:
        return self._trace.graph.node(self.name).type

    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    @property
    def ndim(self) -> int:
        return self.type.rank

    def __repr__(self) -> str:
        return f"Tensor({self.name}: {self.type})"

    def __bool__(self) -> bool:
        raise AttnpassError(
            f"{self!r}: a traced tensor has no value; data-dependent Python control flow cannot be traced"
        )

    def __add__(self, other):
        return binary("add", self, other)  # noqa: E704

    def __radd__(self, other):
        return binary("add", other, self)  # noqa: E704

    def __sub__(self, other):
        return binary("sub", self, other)  # noqa: E704

    def __rsub__(self, other):
        return binary("sub", other, self)  # noqa: E704

    def __mul__(self, other):
        return binary("mul", self, other)  # noqa: E704

    def __rmul__(self, other):
        return binary("mul", other, self)  # noqa: E704

    def __truediv__(self, other):
        return binary("div", self, other)  # noqa: E704

    def __rtruediv__(self, other):
        return binary("div", other, self)  # noqa: E704

    def __matmul__(self, other):
        return emit("matmul", [self, other])  # noqa: E704

    def __neg__(self):
        return emit("neg", [self])  # noqa: E704

    def reshape(self, *shape: int | Sequence[int]) -> "Tensor":
        from . import ops

        return ops.reshape(self, shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    def transpose(self, *perm: int | Sequence[int]) -> "Tensor":
        from . import ops

        if len(perm) == 1 and not isinstance(perm[0], int):
            perm = tuple(perm[0])  # x.transpose((1, 0)) as in numpy
        return ops.transpose(self, perm or None)

    def astype(self, dtype: DType | str) -> "Tensor":
        from . import ops

        return ops.cast(self, dtype)

    def __getitem__(self, key: Any) -> "Tensor":
        return basic_index(self, key)


def _trace_of(operands: Sequence[Any], op: str) -> _Trace:
    traces = {id(t._trace): t._trace for t in operands if isinstance(t, Tensor)}
    if len(traces) > 1:
        graphs = ", ".join(f"{t!r} of {t._trace.graph.name}" for t in operands if isinstance(t, Tensor))
        raise AttnpassError(f"{op}: operands come from different traces ({graphs}); trace one function at a time")
    if traces:
        trace = next(iter(traces.values()))
        if trace.finished:
            raise AttnpassError(
                f"a tensor from the finished trace of {trace.graph.name} was used after trace() returned; "
                "call attnpass.ir.ops functions only inside the traced function"
            )
        return trace
    current = _current.get()
    if current is None:
        raise AttnpassError("attnpass.ir.ops functions build graphs: call them inside attnpass.ir.trace(fn, ...)")
    return current


def emit(op: str, operands: Sequence[Any] | Mapping[str, Any], attrs: dict[str, Any] | None = None) -> Tensor:
    """Add ``op`` to the active trace; shape errors name the op, the shapes and the user's line. ``operands``: by
    position, or operand name -> tensor (None: an absent optional operand)."""
    named = dict(operands) if isinstance(operands, Mapping) else None
    given = [o for o in (named.values() if named is not None else operands) if named is None or o is not None]
    for o in given:
        if not isinstance(o, Tensor):
            raise ShapeError(f"{op}: expected traced tensors as operands, got {type(o).__name__} {o!r}")
    trace = _trace_of(given, op)
    loc = user_location()
    inputs = [o.name for o in given] if named is None else {k: None if o is None else o.name for k, o in named.items()}
    try:
        name = trace.graph.add_node(op, inputs, attrs or {}, loc=loc)
    except ShapeError as exc:
        raise ShapeError(f"{exc}{describe_location(loc)}") from None
    return Tensor(trace, name)


def constant(value: Any, dtype: DType | str | None = None, *, like: Tensor | None = None) -> Tensor:
    """A constant node from a Python scalar or array (dtype defaults to the array's, or float32)."""
    arr = np.asarray(value)
    if dtype is None:
        dtype = DType.float32 if arr.dtype.kind == "f" else DType.from_numpy(arr.dtype)
    dt = DType.parse(dtype)
    flat = arr.reshape(-1).tolist() if arr.size else []
    if arr.size > 1 and len(set(map(repr, flat))) == 1:
        flat = flat[:1]
    if dt.is_float:
        flat = [float(v) for v in flat]
    elif dt is DType.bool:
        flat = [bool(v) for v in flat]
    else:
        flat = [int(v) for v in flat]
    trace = _trace_of([like] if like is not None else [], "constant")
    name = trace.graph.add_node(
        "constant", [], {"value": tuple(flat), "shape": arr.shape, "dtype": dt}, loc=user_location()
    )
    return Tensor(trace, name)


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (bool, int, float, np.number, np.bool_))


def promote(x: Any, like: Tensor) -> Tensor:
    """Python scalars become constants of ``like``'s dtype (weak typing); tensors pass through."""
    if isinstance(x, Tensor):
        return x
    if _is_scalar(x):
        if like.dtype is DType.int32 and isinstance(x, float) and not float(x).is_integer():
            raise ShapeError(f"cannot combine the float {x!r} with the int32 tensor {like!r}; cast first")
        return constant(x, like.dtype, like=like)
    raise ShapeError(f"expected a traced tensor or a Python scalar, got {type(x).__name__}")


def binary(op: str, x: Any, y: Any) -> Tensor:
    if not isinstance(x, Tensor) and not isinstance(y, Tensor):
        raise ShapeError(f"{op}: at least one operand must be a traced tensor")
    like = x if isinstance(x, Tensor) else y
    return emit(op, [promote(x, like), promote(y, like)])


def basic_index(x: Tensor, key: Any) -> Tensor:
    """numpy basic indexing: ints, slices with positive steps, None and Ellipsis."""
    from . import ops

    key = key if isinstance(key, tuple) else (key,)
    if any(isinstance(k, Tensor) or isinstance(k, (list, np.ndarray)) for k in key):
        raise ShapeError(f"indexing {x!r} with arrays is not basic indexing; use ops.take(x, indices, axis)")
    n_ellipsis = sum(1 for k in key if k is Ellipsis)
    if n_ellipsis > 1:
        raise ShapeError(f"indexing {x!r}: at most one Ellipsis")
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    if used > x.ndim:
        raise ShapeError(f"indexing {x!r}: {used} indices for rank {x.ndim}")
    if n_ellipsis:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (x.ndim - used) + key[i + 1 :]
    else:
        key = key + (slice(None),) * (x.ndim - used)
    start, stop, step, out_shape = [], [], [], []
    axis = 0
    for k in key:
        if k is None:
            out_shape.append(1)
            continue
        n = x.shape[axis]
        if isinstance(k, slice):
            if k.step is not None and not isinstance(k.step, (int, np.integer)):
                raise ShapeError(f"indexing {x!r}: axis {axis}: slice step {k.step!r} is not an int")
            if k.step == 0:
                raise ShapeError(f"indexing {x!r}: axis {axis}: slice step 0 is not allowed")
            lo, hi, st = k.indices(n)
            if st < 1:
                raise ShapeError(f"indexing {x!r}: axis {axis}: negative or zero step {st} is not supported")
            hi = max(hi, lo)
            start.append(lo), stop.append(hi), step.append(st)
            out_shape.append(math.ceil((hi - lo) / st))
        elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            i = int(k) + n if k < 0 else int(k)
            if not 0 <= i < n:
                raise ShapeError(f"indexing {x!r}: index {int(k)} out of range for axis {axis} of size {n}")
            start.append(i), stop.append(i + 1), step.append(1)
        else:
            raise ShapeError(f"indexing {x!r}: unsupported index {k!r} (use ints, slices, None, ...)")
        axis += 1
    y = x
    if (tuple(start), tuple(stop), tuple(step)) != ((0,) * x.ndim, x.shape, (1,) * x.ndim):
        y = emit("slice", [x], {"start": tuple(start), "stop": tuple(stop), "step": tuple(step)})
    if tuple(out_shape) != y.shape:
        y = ops.reshape(y, tuple(out_shape))
    return y


def graph_name(fn: Callable, name: str | None = None) -> str:
    """``name``, else a valid graph name derived from ``fn.__name__``."""
    if name:
        return name
    raw = getattr(fn, "__name__", None) or type(fn).__name__  # a callable object (a model): its class
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in raw).strip("_") or "graph"
    if not name.isascii():
        return "graph"
    return name if not (name[0].isdigit() or keyword.iskeyword(name)) else f"g_{name}"  # <lambda> -> g_lambda


def trace(fn: Callable, *specs: TensorSpec | TensorType, name: str | None = None) -> Graph:
    """Trace ``fn`` into a verified Graph; one spec per positional parameter of ``fn``.

    Input names are ``fn``'s parameter names. ``fn`` returns a Tensor or a
    tuple/list of Tensors (the graph outputs, in order).
    """
    if not callable(fn):
        raise argument_error("trace", "fn", fn, "the function to trace", "call trace(fn, *specs)")
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if len(params) != len(specs):
        raise AttnpassError(
            f"trace: {graph_name(fn)} takes {len(params)} tensor parameter(s) "
            f"({', '.join(p.name for p in params)}) but {len(specs)} spec(s) were given"
        )
    graph = Graph(graph_name(fn, name))
    state = _Trace(graph)
    args = []
    for p, spec in zip(params, specs):
        if isinstance(spec, TensorType):
            spec = TensorSpec(spec.shape, spec.dtype)
        if not isinstance(spec, TensorSpec):
            raise argument_error("trace", f"the spec of parameter {p.name}", spec, "a TensorSpec or a TensorType")
        graph.add_input(p.name, spec.type, spec.role)
        args.append(Tensor(state, p.name))
    token = _current.set(state)
    try:
        result = fn(*args)
    finally:
        _current.reset(token)
        state.finished = True
    outs = list(result) if isinstance(result, (tuple, list)) else [result]
    for o in outs:
        if not isinstance(o, Tensor) or o._trace is not state:
            raise AttnpassError(f"trace: {graph.name} must return traced tensors, got {type(o).__name__}")
    graph.set_outputs([o.name for o in outs])
    return graph.verify()
