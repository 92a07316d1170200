"""A lowering target: everything attnpass knows about one array library, in one record.

A target is one folder (the built-in ones: ``lowering/targets/<name>/``):
``emitters.py`` (op -> Python expression), the runtime modules its generated
code imports, and ``target.py`` holding its :class:`Target`. Besides what
code generation needs, the Target carries the facts ``attnpass.backends``
dispatches on: array conversion, the backend's version, primitive counting,
export placeholders and export, and its sharded lowering if it has one. The target's own functions import their
library when called, so importing ``attnpass.lowering`` imports neither MLX
nor JAX. :func:`attnpass.lowering.register_target` makes a Target known by
name; nothing outside the registry compares target names.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from attnpass.ir import Graph, Node, TensorType

from .errors import LoweringError
from .sharding import Spmd


@dataclass
class EmitEnv:
    """What an emitter may look at (the graph, for operand types) and ask for (runtime helpers)."""

    graph: Graph
    target: Target
    checks: bool = False  # import the runtime helpers' checked variants (attnpass.lowering.checks)
    imports: dict[str, None] = field(default_factory=dict)

    def type_of(self, name: str) -> TensorType:
        return self.graph.node(name).type

    def runtime(self, alias: str) -> str:
        """Import the target's runtime helper ``alias`` into the generated module (once); returns the alias."""
        path = self.checks and self.target.runtime.get(f"{alias}_checked") or self.target.runtime.get(alias)
        if path is None:
            raise LoweringError(f"target {self.target.name!r} has no runtime helper {alias!r}")
        module, _, name = path.rpartition(".")
        self.imports.setdefault(f"from {module} import {name}" + ("" if name == alias else f" as {alias}"))
        return alias


Emitter = Callable[[Node, list[str], EmitEnv], str]


@dataclass(frozen=True)
class Export:
    """A target's format for other compilers, as ``attnpass export --target FORMAT`` writes it.

    A binary format (``suffix`` set, e.g. ``".mlxfn"``) is written by
    ``function(program, path, *args)`` and read back with ``loader``; a text
    format is returned by ``function(program, *args)``.
    """

    format: str
    function: Callable[..., Any]
    suffix: str | None = None
    loader: str | None = None


@dataclass(frozen=True, eq=False)
class Target:
    """One lowering target; targets compare by identity (one registered object per name)."""

    name: str
    distribution: str  # the backend's distribution: its version is part of every program identity
    prelude: tuple[str, ...]  # import lines of every generated module
    aliases: frozenset[str]  # the names the prelude binds
    emitters: Mapping[str, Emitter]
    array_module: str  # top-level module of the backend's array type, e.g. "mlx" for mlx.core.array
    from_numpy: Callable[[np.ndarray], Any]  # a numpy argument as the backend's array
    # alias -> dotted path of a helper module or object, imported by the programs that use it (EmitEnv.runtime);
    # "<alias>_checked", when present, is imported as <alias> by programs lowered with checks=True
    runtime: Mapping[str, str] = field(default_factory=dict)
    to_numpy: Callable[[Any], np.ndarray] = np.asarray  # the backend's array as numpy, bit for bit
    count_primitives: Callable[..., Counter] | None = None  # (program, *args, **kwargs) -> primitive names
    placeholders: Callable[[Sequence[TensorType]], list[Any]] | None = None  # zero-cost example arguments
    export: Export | None = None
    # (function name, state argument positions) -> a module-level line rebinding the function compiled, the
    # state buffers donated so the backend updates them in place (JAX: jax.jit with donate_argnums); None: the
    # target has no compile step (its programs run as generated; lower's jit option does not apply)
    jit: Callable[[str, tuple[int, ...]], str] | None = None
    spmd: Spmd | None = None  # sharded lowering over a device mesh (lower(..., mesh=...)), if the target has one

    @property
    def reserved(self) -> frozenset[str]:
        """Names generated code never binds: the prelude's and the runtime's aliases."""
        return self.aliases | frozenset(self.runtime)


__all__ = ["EmitEnv", "Emitter", "Export", "Target"]
