"""A lowered program: generated source, the compiled function, a checked calling convention."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
from typing import Any, Callable, Mapping

import numpy as np

from attnpass.ir import AttnpassError, Graph, ImportedGraph, TensorType
from attnpass.ir.core.arguments import argument_error, require_bool
from attnpass.ir.core.types import native_dtype_name, type_str

from .codegen import Source, generate
from .errors import LoweringError
from .registry import available_targets, get_target, sharded_lowering
from .sharding import check_mesh
from .target import Target


class IdentityMismatch(AttnpassError):
    """A saved graph or artifact belongs to a program other than the one expected."""


@functools.cache  # reading package metadata takes ~25 ms; a process does not change its installed backends
def backend_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def program_identity(graph: Graph, target: str) -> str:
    """sha256 over the graph fingerprint, the target and the backend version."""
    version = backend_version(get_target(target).distribution)
    doc = {"graph": graph.fingerprint(), "target": target, "backend": version}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def check_argument(name: str, expected: TensorType, value: Any) -> None:
    shape = getattr(value, "shape", None)
    if shape is None:
        raise AttnpassError(f"input {name}: expected an array of type {expected}, got {type(value).__name__}")
    dtype = native_dtype_name(value.dtype).replace("bool_", "bool")
    if tuple(shape) != expected.shape or dtype != expected.dtype.value:
        raise AttnpassError(f"input {name}: expected {expected}, got {type_str(shape, dtype)}")


def _graph_and_params(graph: Graph | ImportedGraph) -> tuple[Graph, Mapping[str, np.ndarray]]:
    """The graph to lower and the values of its weight inputs (an :class:`ImportedGraph`'s params, else none);
    an ArgumentError for anything else, saying how to read a saved graph when given a path."""
    if isinstance(graph, Graph):
        return graph, {}
    if isinstance(graph, ImportedGraph):
        return graph.graph, graph.params
    hint = ""
    if isinstance(graph, (str, os.PathLike)):
        hint = "read a saved graph first: ImportedGraph.load(path) (with its weights) or Graph.from_json(text)"
    raise argument_error("lower", "graph", graph, "a Graph or an ImportedGraph (from_mlx, from_jax)", hint)


class Program:
    """A graph lowered to one target. Call it positionally (graph-input order) or by input name.

    Attributes: ``graph`` (the lowered graph), ``target`` (the registered
    :class:`Target`), ``source`` (generated Python), ``fn`` (the generated
    function, for ``mx.compile`` or export; a target with a compile step
    returns it compiled unless lowered with ``jit=False``: JAX's ``jax.jit``,
    a graph's state donated (``donate_argnums``); with a mesh, the sharded
    ``jax.jit`` entry point), ``mesh``, ``input_names``, ``params`` (an ImportedGraph's weights, as backend
    arrays, for the inputs a call leaves out), ``line_to_node`` and ``identity``
    (placement does not enter it: a sharded program computes the same values).
    A decode loop carries state with :meth:`next_state`.
    """

    def __init__(
        self,
        graph: Graph | ImportedGraph,
        target: str,
        *,
        comments: bool = True,
        checks: bool = False,
        mesh: Any = None,
        jit: bool = True,
    ) -> None:
        for option, value in (("comments", comments), ("checks", checks), ("jit", jit)):
            require_bool("lower", option, value)
        graph, params = _graph_and_params(graph)
        if not isinstance(target, str):
            names = ", ".join(t.name for t in available_targets())
            raise argument_error("lower", "target", target, f"the name of a registered target ({names})")
        self.target = get_target(target)
        self.graph = graph.copy()
        self.mesh = mesh
        spmd = None
        if mesh is not None:
            spmd = sharded_lowering(self.target, "lower(mesh=)")
            check_mesh(self.graph, spmd, mesh)
        generated: Source = generate(
            self.graph, self.target, comments=comments, checks=checks, spmd=spmd, jit=jit and not checks
        )
        self.source = generated.text
        self.line_to_node = generated.line_to_node
        namespace: dict[str, Any] = {"__name__": f"attnpass_generated_{target}", "mesh": mesh}
        try:
            exec(compile(self.source, f"<attnpass {target}:{graph.name}>", "exec"), namespace)
        except ImportError as exc:
            raise LoweringError(f"target {target!r} needs its backend installed: {exc}") from None
        self.fn: Callable[..., Any] = namespace[generated.function]
        self.input_names = graph.inputs
        # an ImportedGraph's weights: the values of inputs a call leaves out, converted once
        self.params: dict[str, Any] = {n: self.target.from_numpy(params[n]) for n in graph.inputs if n in params}

    @functools.cached_property
    def identity(self) -> str:
        """:func:`program_identity` of the program's graph and target (computed when first asked: it hashes
        every node)."""
        return program_identity(self.graph, self.target.name)

    @property
    def input_types(self) -> list[TensorType]:
        return self.graph.input_types()

    def signature(self) -> list[tuple[str, TensorType, str]]:
        """``(name, type, role)`` of every input a caller provides, in order."""
        return [(n, self.graph.node(n).type, self.graph.input_role(n)) for n in self.input_names]

    def bind(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Order and type-check the arguments; convert numpy arrays and scalars (``np.int32(7)``) to backend
        arrays."""
        names = self.input_names
        if len(args) > len(names):
            raise AttnpassError(f"{self.graph.name} takes {len(names)} inputs ({', '.join(names)}), got {len(args)}")
        bound = dict(zip(names, args))
        for key, value in kwargs.items():
            if key not in names:
                raise AttnpassError(f"{self.graph.name} has no input {key!r}; inputs: {', '.join(names)}")
            if key in bound:
                raise AttnpassError(f"{self.graph.name}: input {key!r} given twice")
            bound[key] = value
        bound.update((n, v) for n, v in self.params.items() if n not in bound)
        missing = [n for n in names if n not in bound]
        if missing:
            raise AttnpassError(f"{self.graph.name}: missing input(s) {', '.join(missing)}")
        for name, t in zip(names, self.input_types):
            check_argument(name, t, bound[name])
        if self.mesh is not None:  # every argument on the mesh, with its input's sharding (None: replicated)
            place = self.target.spmd.place  # type: ignore[union-attr]
            return [place(bound[n], self.mesh, self.graph.node(n).sharding) for n in names]
        convert = self.target.from_numpy  # numpy arrays and scalars only: backend arrays and tracers pass as they are
        numpy = (np.ndarray, np.generic)
        return [convert(np.asarray(bound[n])) if isinstance(bound[n], numpy) else bound[n] for n in names]

    def next_state(self, outputs: Any) -> dict[str, Any]:
        """``{state input: its next value}`` taken from one call's ``outputs``, to pass to the next call."""
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        return {name: outs[position] for name, position in self.graph.state_pairs()}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*self.bind(*args, **kwargs))

    def require_target(self, target: Target, what: str) -> None:
        """Raise ValueError unless this program was lowered to ``target`` (``what`` names the caller)."""
        if self.target is not target:
            raise ValueError(f"{what} needs a program lowered to {target.name!r}, got target {self.target.name!r}")

    def __repr__(self) -> str:
        return f"<Program {self.graph.name} target={self.target.name} inputs={list(self.input_names)}>"


def lower(
    graph: Graph | ImportedGraph,
    target: str,
    *,
    comments: bool = True,
    checks: bool = False,
    mesh: Any = None,
    jit: bool = True,
) -> Program:
    """Lower ``graph`` to the target registered as ``target`` ("mlx", "jax", "numpy", ...) and compile it.

    ``graph`` is a :class:`Graph` or an :class:`ImportedGraph` (what ``from_mlx``/``from_jax`` return): the
    program then holds its params and a call passes only the function's own arguments (a param given by name
    replaces the held one).

    ``jit``: a target with a compile step returns its program compiled (JAX: ``jax.jit``, state donated);
    ``jit=False`` returns it eager (state not donated), and so does ``checks=True`` (a check reads the values
    on the host, and raises there). Targets without a compile step (numpy, MLX) ignore it.
    ``checks=True``: values outside an op's contract raise at run time (:mod:`attnpass.lowering.checks`).
    ``mesh`` (e.g. a ``jax.sharding.Mesh``): lower with the graph's sharding annotations
    placed on it (:mod:`attnpass.lowering.sharding`); without one they are ignored.
    """
    return Program(graph, target, comments=comments, checks=checks, mesh=mesh, jit=jit)
