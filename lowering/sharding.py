"""Sharded lowering: a graph's sharding annotations, placed on a device mesh by the target's SPMD support.

``lower(graph, "jax", mesh=mesh)`` generates the single-device program plus,
for every annotated value, one line that keeps it on its sharding, and a
sharded entry point that places the inputs and returns the outputs with their
annotated shardings. Without a mesh the annotations are ignored and the
program is the single-device one. A target offers this through
``Target.spmd`` (an :class:`Spmd`); only JAX does (XLA's SPMD partitioner).

The mesh must have every axis the graph declares (``graph.mesh_axes``), with
the same size; it may have more axes (values are replicated over them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from attnpass.ir import Graph
from attnpass.ir.core.sharding import Sharding

from .errors import LoweringError

Placed = tuple[str, "Sharding | None"]  # a program input or output: its name and sharding


@dataclass(frozen=True)
class Spmd:
    """A target's sharded lowering: what generated code needs, and how inputs reach the mesh.

    ``mesh_axes(mesh)`` reads a mesh's axis sizes (LoweringError for a mesh the
    target cannot use); ``constrain(var, sharding)`` is the expression that keeps
    ``var`` on ``sharding``; ``entry(function, name, inputs, outputs)`` returns
    the module lines defining the entry point ``name`` from the ``(value,
    sharding)`` of each input and output (None: an input is replicated, an
    output left to the partitioner);
    ``place(array, mesh, sharding)`` puts an argument on the mesh;
    ``make_mesh(axes)`` builds a mesh from axis sizes (``attnpass lower
    --mesh``). Generated code refers to the mesh as ``mesh``.
    """

    prelude: tuple[str, ...]
    reserved: frozenset[str]
    mesh_axes: Callable[[Any], Mapping[str, int]]
    constrain: Callable[[str, Sharding], str]
    entry: Callable[[str, str, Sequence[Placed], Sequence[Placed]], list[str]]
    place: Callable[[Any, Any, Sharding | None], Any]
    make_mesh: Callable[[Mapping[str, int]], Any]


def check_mesh(graph: Graph, spmd: Spmd, mesh: Any) -> None:
    """LoweringError unless ``mesh`` has every axis ``graph`` declares, each with the declared size."""
    check_mesh_axes(graph, spmd.mesh_axes(mesh))


def check_mesh_axes(graph: Graph, sizes: Mapping[str, int]) -> None:
    """LoweringError unless a mesh of axes ``sizes`` (name -> size) has every axis ``graph`` declares, same size."""
    wrong = [f"{axis}={size}" for axis, size in graph.mesh_axes.items() if sizes.get(axis) != size]
    if wrong:
        have = ", ".join(f"{a}={n}" for a, n in sizes.items()) or "no axes"
        raise LoweringError(
            f"graph {graph.name} is annotated for mesh axes {', '.join(wrong)}, but the mesh has {have}"
        )


__all__ = ["Placed", "Spmd", "check_mesh", "check_mesh_axes"]
