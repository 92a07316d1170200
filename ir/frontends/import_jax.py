"""Import a JAX function as a graph, through its jaxpr (``jax.make_jaxpr``).

Nested calls (``jit``/``pjit``, ``closed_call``, ``custom_jvp_call``,
``custom_vjp_call``) are inlined: their bodies are imported in place, the
custom derivative rules are dropped (the IR is forward-only). Each equation
maps to IR ops with its exact parameters (:func:`_emit`); anything else raises
:class:`~attnpass.ir.importing.ModelImportError` naming the primitive, its
equation, operand types and user source line. ``dot_general`` becomes
transposes, reshapes and one batched ``matmul`` (operands cast first to its
``preferred_element_type``); ``broadcast_in_dim`` a reshape plus an explicit
``broadcast_to``; ``select_n`` with a bool predicate a ``where``; the cache idioms
(``dynamic_update_slice``, ``dynamic_slice``, ``scatter`` as ``cache.at[:, i].set(k)``
writes) a ``dynamic_update_slice``, ``take``s or a ``put_along_axis``.

Equations whose results never reach the function's outputs (a length counter
nobody reads, the unused half of a split) are left out before any rule sees
them, so an unsupported primitive there costs nothing; so are the dead outputs
of an inlined call and captured arrays only dead code reads. Equations with
effects are always imported. Constants are not folded here (``canonicalize``
folds them). The single-device identities ``sharding_constraint``
(``with_sharding_constraint``), ``name`` (``checkpoint_name``), ``device_put``
and ``optimization_barrier`` forward their operands (no node); a
``sharding_constraint`` whose ``NamedSharding`` the IR's sharding vocabulary
can say (one mesh axis or none per dimension, no unconstrained dimension, one
mesh for the graph, a value not annotated yet) is kept as the value's sharding
annotation and its mesh's axes of size > 1 as the graph's mesh
(:mod:`attnpass.ir.core.sharding`); size-1 axes shard nothing and are left
out, so a trace on one device keeps no hint; any other is dropped.
A PRNG key argument (``jax.random.key``) is declined by name: the IR has no key type.
"""

from __future__ import annotations

import math
import os
import sysconfig
from typing import Any, Callable

import numpy as np

from attnpass.ir.core.sharding import normalize_mesh, sharding_problem
from attnpass.ir.core.types import DType, GraphFormatError, SourceLoc, TensorType

from .example_args import require_call, require_callable, require_jax_leaves, traced_error
from .importing import (
    INLINE_LIMIT,
    GraphBuilder,
    ImportedGraph,
    ModelImportError,
    captured_paths,
    dtype_of,
    graph_name,
    join_path,
    parameter_names,
    sanitize,
    walk,
)

_BINARY = {
    "add": "add",
    "sub": "sub",
    "mul": "mul",
    "max": "maximum",
    "lt": "less",
    "ge": "greater_equal",
    "min": "minimum",
}
_SWAPPED = {"gt": "less", "le": "greater_equal"}  # x > y == y < x; x <= y == y >= x
_UNARY = {
    "neg": "neg", "exp": "exp", "sin": "sin", "cos": "cos", "logistic": "sigmoid", "rsqrt": "rsqrt", "sqrt": "sqrt",
    "tanh": "tanh", "erf": "erf", "log": "log", "log1p": "log1p", "expm1": "expm1", "abs": "abs", "sign": "sign",
}  # fmt: skip
_ALIASES = ("stop_gradient", "copy", "copy_p", "optimization_barrier", "name", "device_put", "pvary")
_REDUCE = {"reduce_max": "max", "reduce_sum": "sum"}
_SCANS = {"cumsum": "sum", "cumprod": "prod", "cummax": "max", "cummin": "min", "cumlogsumexp": "logsumexp"}
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}  # fmt: skip


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


def _is_literal(atom: Any) -> bool:
    return hasattr(atom, "val") and not hasattr(atom, "count")


def _is_drop(var: Any) -> bool:
    return type(var).__name__ == "DropVar"


def _liveness(jaxpr: Any, wanted: list[bool]) -> tuple[list[bool], set]:
    """Which equations of ``jaxpr`` to import, and the variables read: backwards from the ``wanted`` outputs,
    an equation is kept when a kept one (or a wanted output) reads one of its results, or when it has effects."""
    live = {v for v, w in zip(jaxpr.outvars, wanted) if w and not _is_literal(v)}
    keep = [False] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if eqn.effects or any(not _is_drop(v) and v in live for v in eqn.outvars):
            keep[i] = True
            live.update(v for v in eqn.invars if not _is_literal(v))
    return keep, live


def _without_dead_code(closed: Any) -> Any:
    """``closed`` after JAX's own dead-code elimination (every input kept): it looks into calls, so an input of a
    ``checkpoint`` or ``jit`` that only the call's dead outputs need (an RNG stream nnx threads through MaxText's
    layers) is dropped from the call, where :func:`_liveness`, which keeps every input of a call it keeps, cannot."""
    from jax.extend.core import ClosedJaxpr
    from jax.interpreters import partial_eval as pe

    # lists (one flag per output, one per input), not True: jax 0.9 iterates both (0.10 takes bools too)
    outputs, inputs = [True] * len(closed.jaxpr.outvars), [True] * len(closed.jaxpr.invars)
    jaxpr, _used = pe.dce_jaxpr(closed.jaxpr, outputs, instantiate=inputs)
    return closed if jaxpr is closed.jaxpr else ClosedJaxpr(jaxpr, closed.consts)


def _key_type(dtype: Any) -> bool:
    """Whether ``dtype`` is a typed PRNG key's (``jax.random.key``: ``key<fry>``)."""
    import jax

    return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))


def _decline_key(what: str, aval: Any) -> ModelImportError:
    return ModelImportError(
        f"{what} is a PRNG key array ({aval}): the IR has no key type; draw the random "
        "values outside the function and pass them in as an array, or bind the key with functools.partial where "
        "only dead code reads it (deterministic dropout)"
    )


def _array_of(const: Any, what: str) -> np.ndarray:
    """A captured array as numpy; a captured PRNG key is declined by name."""
    aval = getattr(const, "aval", None)
    if aval is not None and _key_type(aval.dtype):
        raise _decline_key(what, aval)
    return np.asarray(const)


class _Importer:
    def __init__(self, builder: GraphBuilder, paths: dict[int, str]) -> None:
        self.b = builder
        self.paths = paths  # _array_key of a captured array -> where fn reaches it
        self.count = 0
        self.enclosing: SourceLoc | None = None  # the call being inlined: its location stands in for lost ones
        self.used: list[bool] = []  # which outputs of the equation being imported are read

    def read(self, atom: Any) -> str:
        if _is_literal(atom):
            aval = atom.aval
            return self.b.constant(np.asarray(atom.val), dtype_of(str(aval.dtype), f"literal {atom}"), "lit")
        return self.b.read(atom)

    def jaxpr(self, closed: Any, args: list[str], wanted: list[bool] | None = None) -> list[str | None]:
        """Import the body of a ClosedJaxpr with ``args`` bound to its inputs; returns its outputs (None for an
        output ``wanted`` marks unread: what only it needs is not imported)."""
        jaxpr = getattr(closed, "jaxpr", closed)
        wanted = [True] * len(jaxpr.outvars) if wanted is None else wanted
        keep, live = _liveness(jaxpr, wanted)
        for var, const in zip(jaxpr.constvars, getattr(closed, "consts", ())):
            if var not in live:
                continue  # a captured array only dead code reads
            array = _array_of(const, f"captured array {var}")
            dtype = dtype_of(str(array.dtype), f"captured array {var}")
            self.b.bind(var, self.b.constant(array, dtype, path=self.paths.get(_array_key(const))))
        for var, value in zip(jaxpr.invars, args):
            if value is not None:
                self.b.bind(var, value)
        for eqn, kept in zip(jaxpr.eqns, keep):
            if kept:
                self.equation(eqn, [not _is_drop(v) and v in live for v in eqn.outvars])
            else:
                self.count += 1
        return [self.read(v) if w else None for v, w in zip(jaxpr.outvars, wanted)]

    def equation(self, eqn: Any, used: list[bool] | None = None) -> None:
        """Import ``eqn``; ``used`` marks which of its outputs later equations read (a call's dead outputs are
        not imported)."""
        index, self.count = self.count, self.count + 1
        self.used = [True] * len(eqn.outvars) if used is None else used
        name = eqn.primitive.name
        self.b.loc = _location(eqn, self.enclosing or SourceLoc(f"jax:{self.b.graph.name}", index, name))
        args = [self.read(v) for v in eqn.invars]
        try:
            rule = IMPORTERS.get(name)
            if rule is None:
                raise ModelImportError(
                    f"unsupported JAX primitive {name}; the JAX importer supports {', '.join(sorted(IMPORTERS))}"
                )
            outs = rule(self, eqn.params, args, eqn)
        except ModelImportError as exc:
            raise ModelImportError(f"{exc}\n  in {self._where(index, eqn)}") from None
        except Exception as exc:  # a shape rule or unexpected parameters: say which equation
            raise ModelImportError(f"cannot import {self._where(index, eqn)}: {exc}") from None
        for var, value in zip(eqn.outvars, outs):
            if value is None:
                continue  # an output nothing reads, left out
            shape = tuple(var.aval.shape)
            if self.b.type(value).shape != shape:
                raise ModelImportError(
                    f"{self._where(index, eqn)}: imported as {self.b.type(value)}, JAX says {var.aval}"
                )
            self.b.bind(var, value)

    def _where(self, index: int, eqn: Any) -> str:
        operands = ", ".join(str(getattr(v, "aval", v)) for v in eqn.invars) or "none"
        return f"equation #{index} {eqn.primitive.name} (operands {operands}) at {self.b.loc}"

    def inline(self, closed: Any, args: list[str]) -> list[str | None]:
        """The body of a nested call imported in place (only what its read outputs need); its equations without a
        location get the call's."""
        outer, self.enclosing, loc = self.enclosing, self.b.loc, self.b.loc
        try:
            return self.jaxpr(closed, args, self.used)
        finally:
            self.enclosing, self.b.loc = outer, loc

    def start_vector(self, starts: list[str]) -> str:
        """The scalar start indices of a dynamic slice as one ``i32[rank]`` vector."""
        b = self.b
        return b.concat([b.reshape(b.cast(s, DType.int32), [1]) for s in starts], 0)

    def dynamic_update_slice(self, buffer: str, update: str, start: str) -> str:
        """``lax.dynamic_update_slice``: the IR op (each start clamped so the update fits, as in JAX)."""
        if not self.b.type(buffer).rank:
            return update
        return self.b.op("dynamic_update_slice", [buffer, update, start])

    def dynamic_slice(self, x: str, starts: list[str], sizes: tuple[int, ...]) -> str:
        """``lax.dynamic_slice``: per axis shorter than ``x``, a ``take`` of
        ``clip(start, 0, dim - size) + arange(size)`` (JAX clamps the start so the slice fits)."""
        b = self.b
        for axis, (start, size, dim) in enumerate(zip(starts, sizes, b.type(x).shape)):
            if size == dim:
                continue
            low = b.op("maximum", [b.cast(start, DType.int32), b.scalar(0, DType.int32)])
            first = b.op("minimum", [low, b.scalar(dim - size, DType.int32)])
            ramp = b.constant(np.arange(size, dtype=np.int32), DType.int32, "iota", inline=True)
            x = b.op("take", [x, b.op("add", [b.reshape(first, [1]), ramp])], {"axis": axis})
        return x

    def scatter(self, operand: str, indices: str, updates: str, params: dict) -> str:
        """``lax.scatter`` (``x.at[...].set``): one window a ``dynamic_update_slice`` at the index; several
        windows along one axis (``cache.at[:, positions].set(rows)``) or along adjacent axes by points
        (``cache.at[batch, slots].set(rows)``) one ``put_along_axis``.

        Mode ``CLIP`` clamps an index (the ops' own rule for one window); the others (``FILL_OR_DROP``, the
        default of ``.at[]``, and ``PROMISE_IN_BOUNDS``, which XLA executes the same way) drop a window that
        does not fit at its index. Windows written to the same place: which one wins is target-defined, as in JAX.
        """
        b, dn = self.b, params["dimension_numbers"]
        index_shape = b.type(indices).shape
        clip = "CLIP" in str(params.get("mode"))
        if dn.operand_batching_dims:
            return self._scatter_batched(operand, indices, updates, dn, clip)
        if math.prod(index_shape[:-1]) == 1:
            return self._scatter_window(operand, indices, updates, dn, clip)
        return self._scatter_rows(operand, indices, updates, dn, clip)

    def scatter_add(self, operand: str, indices: str, updates: str, params: dict) -> str:
        """``lax.scatter_add`` (``x.at[i].add(u)``) of one window: the window read at the index, ``u`` added, written
        back as ``scatter`` writes it (dropped where it does not fit, or the index clamped). Several windows may
        overlap and add up: declined."""
        dn, index_shape = params["dimension_numbers"], self.b.type(indices).shape
        if dn.operand_batching_dims:
            return self._scatter_batched(operand, indices, updates, dn, "CLIP" in str(params.get("mode")), add=True)
        if math.prod(index_shape[:-1]) != 1:
            raise ModelImportError(
                f"scatter-add of indices {list(index_shape)} ({dn}): only one window is supported (x.at[i].add(u))"
            )
        return self._scatter_window(operand, indices, updates, dn, "CLIP" in str(params.get("mode")), add=True)

    def _scatter_batched(
        self, operand: str, indices: str, updates: str, dn: Any, clip: bool, *, add: bool = False
    ) -> str:
        """A scatter with operand batching dims (a vmapped ``dynamic_update_slice``: EasyDeL's cache write, one
        window per sequence at its own slot): one window per batch element, each written into its own slice of
        the operand as :meth:`_scatter_window` writes one (dropped where it does not fit, or clamped with ``CLIP``),
        the slices concatenated back; unrolled over the batch. Several windows per batch element: declined."""
        b = self.b
        index_shape = b.type(indices).shape
        batching, index_batching = list(dn.operand_batching_dims), list(dn.scatter_indices_batching_dims)
        if math.prod(n for d, n in enumerate(index_shape[:-1]) if d not in index_batching) != 1:
            raise ModelImportError(
                f"scatter of indices {list(index_shape)} with operand batching dims {tuple(batching)} ({dn}): only "
                "one window per batch element is supported (vmap of dynamic_update_slice)"
            )
        update_scatter_dims = [d for d in range(b.type(updates).rank) if d not in set(dn.update_window_dims)]
        axis, index_axis = int(batching[0]), int(index_batching[0])
        update_axis = update_scatter_dims[index_axis]
        rest = dn._replace(
            operand_batching_dims=tuple(batching[1:]),
            scatter_indices_batching_dims=tuple(index_batching[1:]),
            inserted_window_dims=tuple(sorted([*dn.inserted_window_dims, axis])),
        )
        pieces = []
        for j in range(b.type(operand).shape[axis]):
            part, point, update = (b.slice_axis(x, a, j, j + 1) for x, a in
                                   ((operand, axis), (indices, index_axis), (updates, update_axis)))  # fmt: skip
            if rest.operand_batching_dims:
                pieces.append(self._scatter_batched(part, point, update, rest, clip, add=add))
            else:
                pieces.append(self._scatter_window(part, point, update, rest, clip, add=add))
        return pieces[0] if len(pieces) == 1 else b.concat(pieces, axis)

    def _scatter_window(
        self, operand: str, indices: str, updates: str, dn: Any, clip: bool, *, add: bool = False
    ) -> str:
        b = self.b
        shape, index_shape = b.type(operand).shape, b.type(indices).shape
        inserted = {int(d) for d in dn.inserted_window_dims}
        window_sizes = iter(b.type(updates).shape[int(d)] for d in dn.update_window_dims)
        window = [1 if axis in inserted else next(window_sizes) for axis in range(len(shape))]
        update = b.reshape(updates, window)
        point = b.reshape(b.cast(indices, DType.int32), [index_shape[-1]])
        scattered = [int(axis) for axis in dn.scatter_dims_to_operand_dims]
        coordinates = {axis: b.slice_axis(point, 0, j, j + 1) for j, axis in enumerate(scattered)}
        zero = b.reshape(b.scalar(0, DType.int32), [1])
        start = b.concat([coordinates.get(axis, zero) for axis in range(len(shape))], 0) if shape else None
        if add:  # what is there (read with the start clamped as the write clamps it), plus the update
            starts = [b.slice_axis(start, 0, a, a + 1) for a in range(len(shape))]
            update = b.op("add", [self.dynamic_slice(operand, starts, tuple(window)), update])
        written = self.dynamic_update_slice(operand, update, start)
        if clip or not coordinates:
            return written
        fits = None
        for axis, coordinate in coordinates.items():
            limit = b.reshape(b.scalar(shape[axis] - window[axis], DType.int32), [1])
            above, below = b.op("greater_equal", [coordinate, zero]), b.op("greater_equal", [limit, coordinate])
            inside = b.op("logical_and", [above, below])
            fits = inside if fits is None else b.op("logical_and", [fits, inside])
        return b.op("where", [b.reshape(fits, [1] * len(shape)), written, operand])

    def _scatter_rows(self, operand: str, indices: str, updates: str, dn: Any, clip: bool) -> str:
        """Several windows, each one whole row along the scattered axes (one axis, or adjacent axes indexed by
        points: ``cache.at[batch, slots].set(rows)``): ``put_along_axis`` on those axes flattened into one, each
        point's flat index ``i0 * n1 + i1 ...``, with one spare row past the end that takes the dropped windows (a
        coordinate out of its axis) and is cut off again; ``CLIP`` clamps each coordinate to its axis."""
        b = self.b
        shape, index_shape, update_shape = b.type(operand).shape, b.type(indices).shape, b.type(updates).shape
        scattered = [int(axis) for axis in dn.scatter_dims_to_operand_dims]
        inserted = [int(d) for d in dn.inserted_window_dims]
        window_dims = [int(d) for d in dn.update_window_dims]
        rest = [axis for axis in range(len(shape)) if axis not in inserted]
        if (
            not scattered
            or inserted != scattered
            or scattered != list(range(scattered[0], scattered[0] + len(scattered)))
            or [update_shape[d] for d in window_dims] != [shape[a] for a in rest]
        ):
            raise ModelImportError(
                f"scatter of indices {list(index_shape)} ({dn}): several windows are supported only as whole rows "
                "along the scattered axes (cache.at[:, positions].set(rows), cache.at[batch, slots].set(rows))"
            )
        axis, k, int32 = scattered[0], len(scattered), DType.int32
        sizes = [shape[a] for a in scattered]
        merged = [*shape[:axis], math.prod(sizes), *shape[axis + k :]]
        count, n = math.prod(index_shape[:-1]), merged[axis]
        batch_dims = [d for d in range(len(update_shape)) if d not in window_dims]
        before = [d for d, a in zip(window_dims, rest) if a < axis]
        rows = b.transpose(updates, before + batch_dims + [d for d in window_dims if d not in before])
        rows = b.reshape(rows, [count if a == axis else merged[a] for a in range(len(merged))])
        points = b.reshape(b.cast(indices, int32), [count, k])
        flat, inside = None, None
        for j, size in enumerate(sizes):
            coordinate = b.reshape(b.slice_axis(points, 1, j, j + 1), [count])
            if clip:
                coordinate = b.op("minimum", [b.op("maximum", [coordinate, b.scalar(0, int32)]),
                                              b.scalar(size - 1, int32)])  # fmt: skip
            else:
                fits = b.op("logical_and", [b.op("greater_equal", [coordinate, b.scalar(0, int32)]),
                                            b.op("less", [coordinate, b.scalar(size, int32)])])  # fmt: skip
                inside = fits if inside is None else b.op("logical_and", [inside, fits])
            flat = coordinate if flat is None else b.op("add", [b.op("mul", [flat, b.scalar(size, int32)]), coordinate])
        operand = b.reshape(operand, merged) if k > 1 else operand
        if clip:
            at = flat
        else:
            at = b.op("where", [inside, flat, b.scalar(n, int32)])
            spare = [1 if a == axis else merged[a] for a in range(len(merged))]
            operand = b.concat([operand, b.broadcast(b.scalar(0, b.type(operand).dtype), spare)], axis)
        at = b.broadcast(b.reshape(at, [count if a == axis else 1 for a in range(len(merged))]), b.type(rows).shape)
        out = b.op("put_along_axis", [operand, at, rows], {"axis": axis})
        out = out if clip else b.slice_axis(out, axis, 0, n)
        return b.reshape(out, list(shape)) if k > 1 else out

    def integer_pow(self, x: str, y: int) -> str:
        """``x ** y`` by JAX's own square-and-multiply (the same products in the same order); y < 0 is 1 / x**-y."""
        b, dtype = self.b, self.b.type(x).dtype
        if y == 0:
            return b.broadcast(b.scalar(1, dtype), b.type(x).shape)
        acc, base, n = None, x, abs(y)
        while n:
            if n & 1:
                acc = base if acc is None else b.op("mul", [acc, base])
            n >>= 1
            if n:
                base = b.op("mul", [base, base])
        if y > 0:
            return acc
        if not dtype.is_float:
            raise ModelImportError(f"integer_pow with y={y} of an integer tensor is not in the IR")
        return b.op("div", [b.scalar(1.0, dtype), acc])

    def select_n(self, which: str, cases: list[str]) -> str:
        """``select_n(p, *cases)``: ``cases[p]``; a bool ``p`` picks between two cases."""
        b = self.b
        if b.type(which).dtype is DType.bool:
            if len(cases) != 2:
                raise ModelImportError(f"select_n with a bool predicate and {len(cases)} cases")
            return b.op("where", [which, cases[1], cases[0]])
        out = cases[-1]
        for i in range(len(cases) - 2, -1, -1):
            out = b.op("where", [b.op("equal", [which, b.scalar(i, b.type(which).dtype)]), cases[i], out])
        return out

    def gather(self, x: str, indices: str, params: dict) -> str:
        """``lax.gather`` of whole points (embedding lookups, ``take``, ``take_along_axis``), of one window
        (a ``lax.dynamic_slice`` vmap made a gather: :meth:`window_gather`), or of one window per batch element
        (operand batching dims: :meth:`batched_window_gather`).

        Every indexed or batching operand axis has slice size 1 (collapsed, or kept as a unit axis); the other
        axes are sliced from 0. Indices must be in range: the ``clip``/``fill`` modes differ only outside it.
        """
        b, dn = self.b, params["dimension_numbers"]
        slice_sizes = tuple(int(d) for d in params["slice_sizes"])
        index_shape = b.type(indices).shape
        batch_shape = index_shape[:-1]
        starts = [int(d) for d in dn.start_index_map]
        last = len(index_shape) - 1
        points = [b.reshape(b.slice_axis(indices, last, j, j + 1), batch_shape) for j in range(len(starts))]
        for axis, index_axis in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
            ramp = np.arange(batch_shape[index_axis], dtype=np.int32)
            ramp = ramp.reshape([-1 if a == index_axis else 1 for a in range(len(batch_shape))])
            starts.append(int(axis))
            points.append(b.constant(ramp, DType.int32, "iota", inline=True))
        dropped = set(int(d) for d in dn.collapsed_slice_dims) | set(int(d) for d in dn.operand_batching_dims)
        windowed = any(slice_sizes[axis] != 1 for axis in starts)  # else points (an uncollapsed one: a unit axis)
        if windowed and not batch_shape and not dropped and dn.offset_dims == tuple(range(len(slice_sizes))):
            return self.window_gather(x, dict(zip(starts, points)), slice_sizes, params["mode"])
        if windowed and dn.operand_batching_dims and len(dn.start_indices_batching_dims) == len(batch_shape):
            out = self.batched_window_gather(x, indices, dn, slice_sizes, params["mode"])
            offsets = [size for axis, size in enumerate(slice_sizes) if axis not in dropped]
        elif windowed:
            raise ModelImportError(
                f"gather {dn}: only point gathers (slice size 1 on every indexed axis) and single windows are supported"
            )
        else:
            out = b.gather(x, points, starts, slice_sizes)
            offsets = [size for axis, size in enumerate(slice_sizes) if axis not in dropped]
        out = b.reshape(out, batch_shape + tuple(offsets))
        offset_dims, rank = [int(d) for d in dn.offset_dims], len(batch_shape) + len(offsets)
        batch_positions = iter(range(len(batch_shape)))
        perm = [
            len(batch_shape) + offset_dims.index(p) if p in offset_dims else next(batch_positions) for p in range(rank)
        ]
        return b.transpose(out, perm)

    def batched_window_gather(self, x: str, indices: str, dn: Any, sizes: tuple[int, ...], mode: Any) -> str:
        """One window per batch element (a vmapped ``lax.dynamic_slice``: ejkernel's mask rows at each sequence's
        cache length), each cut from its own slice of ``x`` by :meth:`window_gather`: the windows stacked in the
        batch's order, ``[*batch, *sizes]`` (unrolled over the batch)."""
        b = self.b
        index_shape = b.type(indices).shape
        batch_shape, last = index_shape[:-1], len(index_shape) - 1
        pairs = list(zip((int(d) for d in dn.operand_batching_dims), (int(d) for d in dn.start_indices_batching_dims)))
        windows = []
        for at in np.ndindex(*batch_shape):
            part, point = x, indices
            for axis, index_axis in pairs:
                part = b.slice_axis(part, axis, at[index_axis], at[index_axis] + 1)
            for index_axis, j in enumerate(at):
                point = b.slice_axis(point, index_axis, j, j + 1)
            starts = {int(axis): b.reshape(b.slice_axis(point, last, j, j + 1), [])
                      for j, axis in enumerate(dn.start_index_map)}  # fmt: skip
            windows.append(b.reshape(self.window_gather(part, starts, sizes, mode), [1, *sizes]))
        return windows[0] if len(windows) == 1 else b.concat(windows, 0)

    def window_gather(self, x: str, starts: dict[int, str], sizes: tuple[int, ...], mode: Any) -> str:
        """One window of ``sizes`` at ``starts`` (operand axis -> start; the others from 0), every axis kept:
        ``lax.dynamic_slice`` (what vmap makes of one), whose clamping is mode ``CLIP``'s (``PROMISE_IN_BOUNDS``
        promises the window fits, where the two agree). ``FILL_OR_DROP`` fills a window that does not fit
        instead, which no IR op does: declined by name."""
        if "FILL_OR_DROP" in str(mode):
            raise ModelImportError(
                f"gather of one window with mode {mode}: a window past the end is filled, not clamped as "
                "lax.dynamic_slice clamps it; the IR has only the clamped slice (give mode='clip')"
            )
        zero = self.b.scalar(0, DType.int32)
        return self.dynamic_slice(x, [starts.get(axis, zero) for axis in range(len(sizes))], sizes)

    def dot_general(self, lhs: str, rhs: str, params: dict) -> str:
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

        def arrange(
            x: str, shape: tuple[int, ...], order: tuple[int, ...], rows: tuple[int, ...], cols: tuple[int, ...]
        ) -> str:
            if order != tuple(range(len(shape))):
                x = b.op("transpose", [x], {"perm": order})
            return b.reshape(x, batch + [math.prod(shape[d] for d in rows), math.prod(shape[d] for d in cols)])

        a = arrange(lhs, ls, lb + lf + lc, lf, lc)
        c = arrange(rhs, rs, rb + rc + rf, rc, rf)
        out = b.op("matmul", [a, c])
        return b.reshape(out, batch + [ls[d] for d in lf] + [rs[d] for d in rf])


Rule = Callable[["_Importer", dict, list[str], Any], list[str]]
IMPORTERS: dict[str, Rule] = {}  # JAX primitive name -> its rule: (importer, params, operand values, eqn) -> outputs


def importer(*names: str) -> Callable[[Rule], Rule]:
    """Register the decorated rule as the import of the JAX primitives ``names``."""

    def register(rule: Rule) -> Rule:
        for name in names:
            IMPORTERS[name] = rule
        return rule

    return register


def _promoted(imp: "_Importer", x: list[str], eqn: Any) -> list[str]:
    """The operands of a binary equation cast to the dtype JAX promotes them to, where their dtypes differ."""
    b = imp.b
    if len({b.type(v).dtype for v in x}) == 1:
        return x
    import jax.numpy as jnp

    dtype = dtype_of(str(jnp.result_type(*(v.aval.dtype for v in eqn.invars))), f"{eqn.primitive.name} operands")
    return [b.cast(v, dtype) for v in x]


def _binary(op: str, swapped: bool = False) -> Rule:
    """A binary primitive as one IR op, the operands promoted (``swapped``: exchanged, ``x > y`` is ``y < x``)."""

    def rule(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
        x = _promoted(imp, x, eqn)
        return [imp.b.op(op, x[::-1] if swapped else x)]

    return rule


def _unary(op: str) -> Rule:
    return lambda imp, params, x, eqn: [imp.b.op(op, x)]


def _inline(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """A nested call (jit, closed_call, custom_jvp/vjp, remat/checkpoint): its body imported in place."""
    key = _CALLS[eqn.primitive.name]
    return imp.inline(params[key if key in params else "call_jaxpr"], x)


IMPORTERS.update({name: _binary(op) for name, op in _BINARY.items()})
IMPORTERS.update({name: _binary(op, swapped=True) for name, op in _SWAPPED.items()})
IMPORTERS.update({name: _unary(op) for name, op in _UNARY.items()})
IMPORTERS.update({name: lambda imp, params, x, eqn: list(x) for name in _ALIASES})
IMPORTERS.update({name: _inline for name in _CALLS})


@importer("div")
def _div(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``lax.div``; of integers it rounds toward zero: the floor quotient plus one where the remainder is
    nonzero and the operands' signs differ (``jnp.floor_divide`` then rounds it back down)."""
    b = imp.b
    x = _promoted(imp, x, eqn)
    dtype = b.type(x[0]).dtype
    if dtype.is_float:
        return [b.op("div", x)]
    zero = b.scalar(0, dtype)
    floor = b.op("floor_divide", x)
    inexact = b.op("logical_not", [b.op("equal", [b.op("remainder", x), zero])])
    y_negative = b.op("less", [x[1], zero])
    differ = b.op("where", [b.op("less", [x[0], zero]), b.op("logical_not", [y_negative]), y_negative])
    up = b.op("logical_and", [inexact, differ])
    return [b.op("where", [up, b.op("add", [floor, b.scalar(1, dtype)]), floor])]


@importer("square")
def _square(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.b.op("mul", [x[0], x[0]])]


@importer("integer_pow")
def _integer_pow_rule(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.integer_pow(x[0], params["y"])]


@importer("pow")
def _pow(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``lax.pow``: an exponent of another dtype (an int32 power) is cast to the base's, as JAX lowers it."""
    b = imp.b
    dtype = b.type(x[0]).dtype
    return [b.op("power", [x[0], x[1] if b.type(x[1]).dtype is dtype else b.cast(x[1], dtype)])]


@importer("rem")
def _rem(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``lax.rem`` (C's fmod: the dividend's sign) as the ``remainder`` of the magnitudes, exact, negated
    where the dividend is negative (a float's sign read from ``1 / x``, so that ``-0.0`` keeps its sign)."""
    b = imp.b
    x = _promoted(imp, x, eqn)
    dtype = b.type(x[0]).dtype
    magnitude = b.op("remainder", [b.op("abs", [x[0]]), b.op("abs", [x[1]])])
    signed = b.op("div", [b.scalar(1.0, dtype), x[0]]) if dtype.is_float else x[0]
    negative = b.op("less", [signed, b.scalar(0, dtype)])
    return [b.op("where", [negative, b.op("neg", [magnitude]), magnitude])]


@importer("eq", "ne")
def _equality(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``x == y`` / ``x != y``; of bools (``jnp.remainder``'s sign test) a select: ``where(x, y, not y)``."""
    b, negate = imp.b, eqn.primitive.name == "ne"
    x = _promoted(imp, x, eqn)
    if b.type(x[0]).dtype is DType.bool:
        other = b.op("logical_not", [x[1]])
        return [b.op("where", [x[0], other, x[1]] if negate else [x[0], x[1], other])]
    equal = b.op("equal", x)
    return [b.op("logical_not", [equal]) if negate else equal]


@importer("and", "or")
def _logical(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    name = eqn.primitive.name
    x = _promoted(imp, x, eqn)
    if imp.b.type(x[0]).dtype is not DType.bool:
        raise ModelImportError(
            f"bitwise {name} of integers is not in the IR (only the logical {name} of bools is); jnp.power of an "
            "integer base by an integer array exponent computes with it over the exponent's bits: cast the base to "
            "a float, or give the exponent as a Python int"
        )
    return [imp.b.op(f"logical_{name}", x)]


@importer("not")
def _not(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    if imp.b.type(x[0]).dtype is not DType.bool:
        raise ModelImportError("bitwise not of integers is not in the IR (only bool not is)")
    return [imp.b.op("logical_not", x)]


@importer("clamp")
def _clamp(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    low, value, high = x
    return [imp.b.op("minimum", [imp.b.op("maximum", [value, low]), high])]


@importer("gather")
def _gather(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.gather(x[0], x[1], params)]


@importer("convert_element_type")
def _convert(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.b.cast(x[0], dtype_of(str(params["new_dtype"]), "convert_element_type"))]


@importer("select_n")
def _select_n(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.select_n(x[0], x[1:])]


@importer("broadcast_in_dim")
def _broadcast_in_dim(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    b = imp.b
    shape, dims = tuple(params["shape"]), tuple(int(d) for d in params["broadcast_dimensions"])
    inner = [1] * len(shape)
    for d, size in zip(dims, b.type(x[0]).shape):
        inner[d] = size
    return [b.broadcast(b.reshape(x[0], inner), shape)]


@importer("reshape")
def _reshape(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    if params.get("dimensions") is not None:
        raise ModelImportError(f"reshape with dimensions={params['dimensions']} is not supported")
    return [imp.b.reshape(x[0], params["new_sizes"])]


@importer("squeeze", "expand_dims")
def _squeeze(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.b.reshape(x[0], eqn.outvars[0].aval.shape)]


@importer("transpose")
def _transpose(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.b.op("transpose", x, {"perm": tuple(int(p) for p in params["permutation"])})]


@importer(*_REDUCE)
def _reduce(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    attrs = {"axes": tuple(int(a) for a in params["axes"]), "keepdims": False}
    return [imp.b.op(_REDUCE[eqn.primitive.name], x, attrs)]


@importer("reduce_and", "reduce_or")
def _reduce_logical(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``jnp.all`` / ``jnp.any`` of bools: how many are False (True) over the axes, compared with 0 (exact in int32)."""
    b, every = imp.b, eqn.primitive.name == "reduce_and"
    if b.type(x[0]).dtype is not DType.bool:
        raise ModelImportError(f"{eqn.primitive.name} of integers (bitwise) is not in the IR (only of bools)")
    counted = b.op("logical_not", x) if every else x[0]
    attrs = {"axes": tuple(int(a) for a in params["axes"]), "keepdims": False}
    none = b.op("equal", [b.op("sum", [b.cast(counted, DType.int32)], attrs), b.scalar(0, DType.int32)])
    return [none if every else b.op("logical_not", [none])]


@importer(*_SCANS)
def _scan(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``lax.cumsum`` / ``cumprod`` / ``cummax`` / ``cummin`` / ``cumlogsumexp``: an inclusive ``scan``."""
    attrs = {"kind": _SCANS[eqn.primitive.name], "axis": int(params["axis"]), "reverse": bool(params["reverse"])}
    return [imp.b.op("scan", x, attrs)]


@importer("dot_general")
def _dot_general_rule(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.dot_general(x[0], x[1], params)]


@importer("concatenate")
def _concatenate(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.b.op("concat", x, {"axis": int(params["dimension"])})]


@importer("stack")
def _stack(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``jnp.stack``: each operand given a unit axis at ``axis``, then concatenated along it."""
    b, axis = imp.b, int(params["axis"])
    shape = list(b.type(x[0]).shape)
    return [b.concat([b.reshape(v, shape[:axis] + [1] + shape[axis:]) for v in x], axis)]


@importer("slice")
def _slice(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    strides = params.get("strides") or (1,) * imp.b.type(x[0]).rank
    attrs = {"start": tuple(params["start_indices"]), "stop": tuple(params["limit_indices"]), "step": tuple(strides)}
    return [imp.b.op("slice", x, attrs)]


@importer("split")
def _split(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    axis, bounds = int(params["axis"]), np.cumsum([0, *params["sizes"]]).tolist()
    return [imp.b.slice_axis(x[0], axis, lo, hi) for lo, hi in zip(bounds, bounds[1:])]


@importer("dynamic_update_slice")
def _dynamic_update_slice_rule(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.dynamic_update_slice(x[0], x[1], imp.start_vector(x[2:]))]


@importer("dynamic_slice")
def _dynamic_slice_rule(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.dynamic_slice(x[0], x[1:], tuple(int(d) for d in params["slice_sizes"]))]


@importer("scatter")
def _scatter_rule(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.scatter(x[0], x[1], x[2], params)]


@importer("scatter-add")
def _scatter_add_rule(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.scatter_add(x[0], x[1], x[2], params)]


@importer("shard_map")
def _shard_map(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str | None]:
    """``jax.shard_map`` over a mesh of one device (EasyDeL's ``attn_mechanism="sdpa"`` wraps its attention in one):
    each manual axis has size 1, so the body sees the whole arrays and is the function: imported in place. Over
    more devices the body sees one shard each: declined, naming the mesh."""
    mesh = params["mesh"]
    if mesh.size != 1:
        raise ModelImportError(
            f"shard_map over {mesh}: its body computes one of {mesh.size} shards; only a mesh of one device, where "
            "the body is the whole function, is imported"
        )
    return imp.inline(params["jaxpr"], x)


@importer("cond")
def _cond(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str | None]:
    """``lax.cond`` / ``lax.switch`` (EasyDeL's yarn RoPE nudges its ramp's top with a ``cond`` on constants):
    every branch imported on the operands, each output the one of the branch the index names, chosen by
    ``where`` (an index out of range takes the last branch, as XLA's conditional does; ``lax.switch`` clamps it
    before). Exact: ``where`` keeps the chosen branch's bits; the other branches are computed and discarded, so
    they cost what they compute."""
    if eqn.effects:
        raise ModelImportError(f"cond with effects {set(eqn.effects)}: its branches cannot all be run")
    b, branches, read = imp.b, params["branches"], list(imp.used)  # read before the branches' equations reset it
    index = b.cast(x[0], DType.int32)
    outs = []
    for branch in branches:
        imp.used = read
        outs.append(imp.inline(branch, list(x[1:])))
    results: list[str | None] = []
    for k, used in enumerate(read):
        if not used:
            results.append(None)
            continue
        chosen = outs[-1][k]
        for i in range(len(branches) - 2, -1, -1):
            picked = b.op("equal", [index, b.scalar(i, DType.int32)])
            chosen = b.op("where", [picked, outs[i][k], chosen])
        results.append(chosen)
    return results


@importer("iota")
def _iota(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    dtype = dtype_of(str(params["dtype"]), "iota")
    shape, dim = tuple(params["shape"]), int(params["dimension"])
    ramp = np.arange(shape[dim]).reshape([-1 if a == dim else 1 for a in range(len(shape))])
    return [imp.b.constant(np.broadcast_to(ramp, shape).astype(dtype.numpy), dtype, "iota", inline=True)]


@importer("sharding_constraint")
def _sharding_constraint(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``with_sharding_constraint``: the value forwarded; its ``NamedSharding`` kept as the value's annotation
    where the IR can say it (:func:`_sharding_hint`)."""
    hint = _sharding_hint(params, eqn.invars[0].aval)
    graph = imp.b.graph
    if hint is not None:
        mesh, entries = hint
        node = graph.node(x[0])
        fits = sharding_problem(node.replace(sharding=entries), mesh) is None
        if fits and node.sharding is None and (not graph.mesh_axes or dict(graph.mesh_axes) == mesh):
            if not graph.mesh_axes:
                graph.set_mesh(mesh)
            graph.set_sharding(x[0], entries)
    return list(x)


def _sharding_hint(params: dict, aval: Any) -> tuple[dict[str, int], tuple[str | None, ...]] | None:
    """``(mesh axes, one mesh axis or None per dimension)`` of a ``sharding_constraint``, or None when the IR
    cannot say it (not a ``NamedSharding``, a dimension over several mesh axes as ``P(('data', 'fsdp'))`` or left
    unconstrained, axis names that are not identifiers) or when it shards nothing. An axis of size 1 shards
    nothing and is left out, of the dimensions and of the mesh: a trace on one device keeps no hint and declares
    no mesh that would bind the graph to size-1 axes."""
    from jax.sharding import NamedSharding, PartitionSpec

    sharding = params.get("sharding")
    if not isinstance(sharding, NamedSharding) or params.get("unconstrained_dims"):
        return None
    rank = len(aval.shape)
    spec = tuple(sharding.spec)
    sizes = dict(sharding.mesh.shape)
    if len(spec) > rank:
        return None
    entries: list[str | None] = []
    for entry in spec + (None,) * (rank - len(spec)):
        if isinstance(entry, tuple) and len(entry) <= 1:
            entry = entry[0] if entry else None
        if entry is PartitionSpec.UNCONSTRAINED or entry is not None and not isinstance(entry, str):
            return None
        entries.append(entry if entry is not None and sizes.get(entry, 1) > 1 else None)
    if all(entry is None for entry in entries):
        return None
    try:
        mesh = normalize_mesh([(axis, size) for axis, size in sizes.items() if size > 1])
    except GraphFormatError:  # axis names the IR refuses: no hint
        return None
    return mesh, tuple(entries)


@importer("unstack")
def _unstack(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str | None]:
    """``lax.unstack`` (``k, v = kv`` since JAX 0.11): one slice per index along ``axis``, the axis dropped;
    the unread ones not imported."""
    b, axis = imp.b, int(params["axis"])
    shape = list(b.type(x[0]).shape)
    axis %= len(shape)
    rest = shape[:axis] + shape[axis + 1 :]
    return [
        b.reshape(b.slice_axis(x[0], axis, i, i + 1), rest) if used else None
        for i, used in zip(range(shape[axis]), imp.used)
    ]


@importer("floor", "ceil")
def _floor_ceil(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    return [imp.b.op(eqn.primitive.name, x)]


@importer("round")
def _round(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``lax.round``: ``TO_NEAREST_EVEN`` (``jnp.round``) is the IR's ``round``; ``AWAY_FROM_ZERO`` (lax.round's
    default) differs only on halves, exact ones: where ``x - trunc(x)`` is +-0.5 (exact: a float's fraction is
    representable) the result is ``trunc(x) + sign(x)``, elsewhere ``round(x)`` (signs of zero, infinities and
    NaN as ``round`` keeps them)."""
    b = imp.b
    method = str(params.get("rounding_method", 0))
    even = b.op("round", x)
    if method in ("1", "RoundingMethod.TO_NEAREST_EVEN", "TO_NEAREST_EVEN"):
        return [even]
    if method not in ("0", "RoundingMethod.AWAY_FROM_ZERO", "AWAY_FROM_ZERO"):
        raise ModelImportError(
            f"round with rounding_method={params.get('rounding_method')!r}: the JAX importer supports "
            "AWAY_FROM_ZERO (0) and TO_NEAREST_EVEN (1)"
        )
    dtype = b.type(x[0]).dtype
    zero = b.scalar(0, dtype)
    trunc = b.op("where", [b.op("less", [x[0], zero]), b.op("ceil", x), b.op("floor", x)])
    half = b.op("equal", [b.op("abs", [b.op("sub", [x[0], trunc])]), b.scalar(0.5, dtype)])
    return [b.op("where", [half, b.op("add", [trunc, b.op("sign", x)]), even])]


@importer("pad")
def _pad(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``lax.pad`` per axis, as XLA applies it: ``interior`` copies of the padding value between neighbours
    (a unit axis, a concat with the fill, a reshape, the last gap cut off), then positive ``low``/``high`` copies
    at the ends, then a negative count cropped off its end (which may reach into the other end's padding). Moves
    only: exact."""
    b = imp.b
    value, fill = x
    for axis, (low, high, interior) in enumerate(params["padding_config"]):
        low, high, interior = int(low), int(high), int(interior)
        shape = list(b.type(value).shape)
        n = shape[axis]
        if interior < 0:
            raise ModelImportError(f"pad with interior={interior} on axis {axis}: interior padding must be >= 0")
        if interior and n > 1:
            spread = shape[: axis + 1] + [1] + shape[axis + 1 :]
            gaps = b.broadcast(b.reshape(fill, [1] * len(spread)), spread[: axis + 1] + [interior] + spread[axis + 2 :])
            value = b.concat([b.reshape(value, spread), gaps], axis + 1)
            value = b.reshape(value, shape[:axis] + [n * (1 + interior)] + shape[axis + 1 :])
            value = b.slice_axis(value, axis, 0, n + (n - 1) * interior)
        value = b.pad_axis(value, axis, max(low, 0), max(high, 0), fill)
        size = b.type(value).shape[axis]
        lo, hi = max(-low, 0), size - max(-high, 0)
        if (lo, hi) != (0, size):
            value = b.slice_axis(value, axis, lo, hi)
    return [value]


@importer("top_k")
def _top_k(imp: "_Importer", params: dict, x: list[str], eqn: Any) -> list[str]:
    """``lax.top_k``: the IR's ``argtopk`` (JAX's order: largest first, equal values lower index first, floats
    in IEEE total order) and the values gathered at those indices."""
    b = imp.b
    axis = int(params.get("axis", -1)) % max(b.type(x[0]).rank, 1)
    indices = b.op("argtopk", x, {"k": int(params["k"]), "axis": axis})
    return [b.op("take_along_axis", [x[0], indices], {"axis": axis}), indices]


def _is_array(value: Any) -> bool:
    import jax

    return isinstance(value, (jax.Array, np.ndarray))


def _pytree_leaves(root: Any) -> list[tuple[str, Any]]:
    """``(pytree path, leaf)`` of ``root`` (equinox and flax nnx modules are pytrees); ``[]`` if JAX cannot."""
    import jax

    try:
        flat = jax.tree_util.tree_flatten_with_path(root)[0]
    except Exception:  # an object JAX cannot flatten holds no arrays we can name
        return []
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def _named_variables(root: Any) -> list[tuple[str, Any]]:
    """``(variable path, array)`` of an object whose ``variables`` each carry a ``path`` and an array ``value``
    (a Keras 3 layer or model on the JAX backend: ``llama_backbone/token_embedding/embeddings``); else ``[]``."""
    if not type(root).__module__.startswith("keras"):
        return []
    variables = getattr(root, "variables", None)
    named = [(getattr(v, "path", None), getattr(v, "value", None)) for v in variables or ()]
    return [(path, value) for path, value in named if isinstance(path, str) and _is_array(value)]


def _leaves(root: Any) -> list[tuple[str, Any]]:
    """``(path, array)`` of the JAX and numpy arrays in ``root``: a Keras object's variables by their own paths,
    then by pytree path, and inside a leaf that is not an array (a plain object such as a KV cache class) by
    attribute path (``['layer0'].keys``)."""
    found = _named_variables(root)
    for path, leaf in _pytree_leaves(root):
        if _is_array(leaf):
            found.append((path, leaf))
        else:
            found += [(join_path(path, inner) if path else inner, array) for inner, array in walk(leaf, _is_array)]
    return found


def _is_module(value: Any) -> bool:
    """A model object (a pytree other than a plain container or an array)."""
    return (
        not isinstance(value, (list, tuple, dict))
        and not _is_array(value)
        and any(_is_array(leaf) for _path, leaf in _pytree_leaves(value))
    )


def _array_key(array: Any) -> Any:
    """What identifies a captured array in the jaxpr: a JAX array itself (by id), a numpy array its buffer
    (JAX keeps a view of it as the constant)."""
    if isinstance(array, np.ndarray):
        return array.__array_interface__["data"][0], array.shape, str(array.dtype)
    return id(array)


def _raised_at(exc: BaseException) -> SourceLoc | None:
    """The innermost line of ``exc``'s traceback outside JAX, attnpass's IR and the standard library: the line of
    the user's function that made JAX raise."""
    import jax
    import jaxlib

    ir_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = (*jax.__path__, *jaxlib.__path__, ir_dir, sysconfig.get_paths()["stdlib"])
    library = tuple(os.path.join(os.path.abspath(d), "") for d in dirs)
    loc, tb = None, exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith("<") and not os.path.abspath(code.co_filename).startswith(library):
            loc = SourceLoc(code.co_filename, tb.tb_lineno, code.co_name)
        tb = tb.tb_next
    return loc


def from_jax(
    fn: Callable, *example_args: Any, name: str | None = None, inline_limit: int = INLINE_LIMIT, **keywords: Any
) -> ImportedGraph:
    """Import the JAX function ``fn`` traced on ``example_args`` (arrays, ``jax.ShapeDtypeStruct`` or pytrees of them;
    a Python scalar is traced, as ``jax.jit`` traces it: :mod:`~attnpass.ir.frontends.example_args`).

    Arguments become streamed inputs named after ``fn``'s parameters; the leaves
    of a pytree argument after their pytree path too (``params['wq']`` ->
    ``params_wq``, the path kept as the input's ``path``). Captured arrays
    become constants (at most ``inline_limit`` elements, or splats) or resident
    inputs whose values are in ``params``, named after their pytree path in the
    module or variable ``fn`` reads them through. Node locations are the user's
    source lines where JAX recorded them. Example arguments ``fn`` cannot take and ``keywords`` (any but
    ``name`` and ``inline_limit``) are an ArgumentError naming ``fn``'s parameters; an error ``fn`` raises while
    JAX traces it (a matmul of mismatched shapes) a ModelImportError naming ``fn``, its line and JAX's message.
    """
    import jax

    require_callable("from_jax", fn, example_args)
    require_call("from_jax", fn, example_args, keywords)
    require_jax_leaves(fn, example_args)
    reachable = captured_paths(fn, _leaves, _is_module)  # holds the arrays: their ids stay theirs
    paths = {_array_key(array): path for path, array in reversed(reachable)}
    try:
        closed = jax.make_jaxpr(fn)(*example_args)
    except Exception as exc:  # whatever fn raises is named, with its line and JAX's message
        raise traced_error("from_jax", fn, example_args, exc, _raised_at(exc)) from exc
    closed = _without_dead_code(closed)
    b = GraphBuilder(graph_name(fn, name), inline_limit)
    arg_names = parameter_names(fn, len(example_args))
    args = []
    for var, (key_path, _leaf) in zip(closed.jaxpr.invars, jax.tree_util.tree_flatten_with_path(example_args)[0]):
        inner = jax.tree_util.keystr(key_path[1:])
        path = join_path(arg_names[key_path[0].idx], inner) if inner else None
        aval, where = var.aval, f"input {path or arg_names[key_path[0].idx]}"
        if _key_type(aval.dtype):
            raise _decline_key(where, aval)
        type_ = TensorType(tuple(aval.shape), dtype_of(str(aval.dtype), where))
        args.append(b.input(var, sanitize(path) if path else arg_names[key_path[0].idx], type_, path))
    outs = _Importer(b, paths).jaxpr(closed, args)
    b.graph.set_outputs(outs)
    return ImportedGraph(b.graph.verify(), b.params)


__all__ = ["from_jax"]
