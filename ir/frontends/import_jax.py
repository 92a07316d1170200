"""Import a JAX function as a graph, through its jaxpr (``jax.make_jaxpr``).

Nested calls (``jit``/``pjit``, ``closed_call``, ``custom_jvp_call``,
``custom_vjp_call``) are inlined: their bodies are imported in place, the
custom derivative rules are dropped (the IR is forward-only). Each equation
maps to IR ops with its exact parameters (:func:`_emit`); anything else raises
:class:`~attnpass.ir.importing.ModelImportError` naming the primitive, its
equation, operand types and user source line. ``dot_general`` becomes
transposes, reshapes and one batched ``matmul`` (operands cast first to its
``preferred_element_type``); ``broadcast_in_dim`` a reshape plus an explicit
``broadcast_to``; ``select_n`` with a bool predicate a ``where``.
"""

from __future__ import annotations

import math
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

_BINARY = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "max": "maximum",
    "eq": "equal",
    "lt": "less",
    "ge": "greater_equal",
    "and": "logical_and",
    "or": "logical_or",
}
_SWAPPED = {"gt": "less", "le": "greater_equal"}  # x > y == y < x; x <= y == y >= x
_UNARY = {"neg": "neg", "exp": "exp", "sin": "sin", "cos": "cos", "logistic": "sigmoid", "rsqrt": "rsqrt"}
_ALIASES = ("stop_gradient", "copy", "copy_p", "optimization_barrier")
_REDUCE = {"reduce_max": "max", "reduce_sum": "sum"}
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}  # fmt: skip


def _location(eqn: Any, fallback: SourceLoc) -> SourceLoc:
    """The user's source line of ``eqn`` when JAX recorded one (its private helper), else ``fallback``."""
    try:
        from jax._src import source_info_util

        frame = source_info_util.user_frame(eqn.source_info.traceback)
    except Exception:  # private API: any change in JAX only costs the location
        frame = None
    if frame is None:
        return fallback
    return SourceLoc(frame.file_name, frame.start_line, frame.function_name)


class _Importer:
    def __init__(self, builder: GraphBuilder) -> None:
        self.b = builder
        self.count = 0

    def read(self, atom: Any) -> str:
        if hasattr(atom, "val") and not hasattr(atom, "count"):  # a Literal
            aval = atom.aval
            return self.b.constant(np.asarray(atom.val), dtype_of(str(aval.dtype), f"literal {atom}"), "lit")
        return self.b.read(atom)

    def jaxpr(self, closed: Any, args: list[str]) -> list[str]:
        """Import the body of a ClosedJaxpr with ``args`` bound to its inputs; returns its outputs."""
        jaxpr = getattr(closed, "jaxpr", closed)
        for var, const in zip(jaxpr.constvars, getattr(closed, "consts", ())):
            array = np.asarray(const)
            self.b.bind(var, self.b.constant(array, dtype_of(str(array.dtype), f"captured array {var}")))
        for var, value in zip(jaxpr.invars, args):
            self.b.bind(var, value)
        for eqn in jaxpr.eqns:
            self.equation(eqn)
        return [self.read(v) for v in jaxpr.outvars]

    def equation(self, eqn: Any) -> None:
        index, self.count = self.count, self.count + 1
        name = eqn.primitive.name
        self.b.loc = _location(eqn, SourceLoc(f"jax:{self.b.graph.name}", index, name))
        args = [self.read(v) for v in eqn.invars]
        try:
            if name in _CALLS:
                key = _CALLS[name] if _CALLS[name] in eqn.params else "call_jaxpr"
                outs = self.jaxpr(eqn.params[key], args)
            else:
                outs = self._emit(name, eqn.params, args, eqn)
        except ModelImportError as exc:
            raise ModelImportError(f"{exc}\n  in {self._where(index, eqn)}") from None
        except Exception as exc:  # a shape rule or unexpected parameters: say which equation
            raise ModelImportError(f"cannot import {self._where(index, eqn)}: {exc}") from None
        for var, value in zip(eqn.outvars, outs):
            shape = tuple(var.aval.shape)
            if self.b.type(value).shape != shape:
                raise ModelImportError(f"{self._where(index, eqn)}: imported as {self.b.type(value)}, JAX says {var.aval}")
            self.b.bind(var, value)

    def _where(self, index: int, eqn: Any) -> str:
        operands = ", ".join(str(getattr(v, "aval", v)) for v in eqn.invars) or "none"
        return f"equation #{index} {eqn.primitive.name} (operands {operands}) at {self.b.loc}"

    def _emit(self, name: str, params: dict, x: list[str], eqn: Any) -> list[str]:
        b = self.b
        out_aval = eqn.outvars[0].aval
        if name in _BINARY:
            return [b.op(_BINARY[name], x)]
        if name in _SWAPPED:
            return [b.op(_SWAPPED[name], [x[1], x[0]])]
        if name == "div":
            if not b.type(x[0]).dtype.is_float:
                raise ModelImportError("integer div (rounds toward zero) is not in the IR")
            return [b.op("div", x)]
        if name in _UNARY:
            return [b.op(_UNARY[name], x)]
        if name in _ALIASES:
            return list(x)
        if name == "square":
            return [b.op("mul", [x[0], x[0]])]
        if name == "integer_pow":
            return [self._integer_pow(x[0], params["y"])]
        if name == "convert_element_type":
            return [b.cast(x[0], dtype_of(str(params["new_dtype"]), "convert_element_type"))]
        if name == "select_n":
            if len(x) != 3 or b.type(x[0]).dtype is not DType.bool:
                raise ModelImportError("select_n is imported with a bool predicate and two cases only")
            return [b.op("where", [x[0], x[2], x[1]])]  # select_n(p, a, b) = p ? b : a
        if name == "broadcast_in_dim":
            shape, dims = tuple(params["shape"]), tuple(int(d) for d in params["broadcast_dimensions"])
            inner = [1] * len(shape)
            for d, size in zip(dims, b.type(x[0]).shape):
                inner[d] = size
            return [b.broadcast(b.reshape(x[0], inner), shape)]
        if name == "reshape":
            if params.get("dimensions") is not None:
                raise ModelImportError(f"reshape with dimensions={params['dimensions']} is not supported")
            return [b.reshape(x[0], params["new_sizes"])]
        if name in ("squeeze", "expand_dims"):
            return [b.reshape(x[0], out_aval.shape)]
        if name == "transpose":
            return [b.op("transpose", x, {"perm": tuple(int(p) for p in params["permutation"])})]
        if name in _REDUCE:
            return [b.op(_REDUCE[name], x, {"axes": tuple(int(a) for a in params["axes"]), "keepdims": False})]
        if name == "dot_general":
            return [self._dot_general(x[0], x[1], params)]
        if name == "concatenate":
            return [b.op("concat", x, {"axis": int(params["dimension"])})]
        if name == "slice":
            shape = b.type(x[0]).shape
            strides = params.get("strides") or (1,) * len(shape)
            attrs = {"start": tuple(params["start_indices"]), "stop": tuple(params["limit_indices"]), "step": tuple(strides)}
            return [b.op("slice", x, attrs)]
        if name == "split":
            axis, bounds = int(params["axis"]), np.cumsum([0, *params["sizes"]]).tolist()
            return [b.slice_axis(x[0], axis, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        if name == "iota":
            dtype = dtype_of(str(params["dtype"]), "iota")
            shape, dim = tuple(params["shape"]), int(params["dimension"])
            ramp = np.arange(shape[dim]).reshape([-1 if a == dim else 1 for a in range(len(shape))])
            return [b.constant(np.broadcast_to(ramp, shape).astype(dtype.numpy), dtype, "iota", inline=True)]
        raise ModelImportError(f"unsupported JAX primitive {name}")

    def _integer_pow(self, x: str, y: int) -> str:
        if y < 1:
            raise ModelImportError(f"integer_pow with y={y} (only y >= 1 is supported)")
        out = x
        for _ in range(y - 1):
            out = self.b.op("mul", [out, x])
        return out

    def _dot_general(self, lhs: str, rhs: str, params: dict) -> str:
        """``dot_general`` as transpose + reshape to ``[batch, M, K] @ [batch, K, N]`` + reshape back."""
        b = self.b
        (lc, rc), (lb, rb) = ([tuple(int(d) for d in ds) for ds in pair] for pair in params["dimension_numbers"])
        preferred = params.get("preferred_element_type")
        if preferred is not None:
            dtype = dtype_of(str(np.dtype(preferred)), "dot_general preferred_element_type")
            lhs, rhs = b.cast(lhs, dtype), b.cast(rhs, dtype)
        ls, rs = b.type(lhs).shape, b.type(rhs).shape
        lf = tuple(d for d in range(len(ls)) if d not in lc and d not in lb)
        rf = tuple(d for d in range(len(rs)) if d not in rc and d not in rb)
        batch = [ls[d] for d in lb]

        def arrange(x: str, shape: tuple[int, ...], order: tuple[int, ...], rows: tuple[int, ...], cols: tuple[int, ...]) -> str:
            if order != tuple(range(len(shape))):
                x = b.op("transpose", [x], {"perm": order})
            return b.reshape(x, batch + [math.prod(shape[d] for d in rows), math.prod(shape[d] for d in cols)])

        a = arrange(lhs, ls, lb + lf + lc, lf, lc)
        c = arrange(rhs, rs, rb + rc + rf, rc, rf)
        out = b.op("matmul", [a, c])
        return b.reshape(out, batch + [ls[d] for d in lf] + [rs[d] for d in rf])


def from_jax(fn: Callable, *example_args: Any, name: str | None = None, inline_limit: int = INLINE_LIMIT) -> ImportedGraph:
    """Import the JAX function ``fn`` traced on ``example_args`` (arrays or ``jax.ShapeDtypeStruct``).

    Arguments become streamed inputs named after ``fn``'s parameters; captured
    arrays become constants (at most ``inline_limit`` elements, or splats) or
    resident inputs whose values are in ``params``. Node locations are the
    user's source lines where JAX recorded them.
    """
    import jax

    closed = jax.make_jaxpr(fn)(*example_args)
    b = GraphBuilder(graph_name(fn, name), inline_limit)
    invars = closed.jaxpr.invars
    args = []
    for var, pname in zip(invars, parameter_names(fn, len(invars))):
        aval = var.aval
        args.append(b.input(var, pname, TensorType(tuple(aval.shape), dtype_of(str(aval.dtype), f"input {pname}"))))
    outs = _Importer(b).jaxpr(closed, args)
    b.graph.set_outputs(outs)
    return ImportedGraph(b.graph.verify(), b.params)


__all__ = ["from_jax"]
