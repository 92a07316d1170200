"""The JAX target's sharded lowering: ``NamedSharding`` placement and sharding constraints, partitioned by XLA.

Why constraints and not ``shard_map``: the annotated graph is already in a
form where every sharded dimension is an array dimension of the values that
carry it (``shard-attention`` regroups head-chunked calls so the KV-head axis
stays an axis, and ``split-kv`` puts T-shards on a leading axis). The program
can then stay the global, single-device program, with
``jax.lax.with_sharding_constraint`` on each annotated value and a ``jax.jit``
entry point whose ``in_shardings``/``out_shardings`` are the annotations; XLA's
SPMD partitioner derives the per-device program and inserts collectives only
where a value's sharding forces them (a reduction over the sharded shard axis:
the split-KV combine). ``shard_map`` would need per-device shapes in every
generated line and hand-written collectives, and a graph lowered without a
mesh would no longer be the same program. The constraints also survive into
StableHLO (``sdy.sharding`` attributes), so an exported module keeps its
shardings for any XLA backend.

Meshes must use ``AxisType.Auto`` axes (the partitioner propagates shardings
between the constrained values); an ``Explicit``-axis mesh (the default of
``jax.make_mesh`` in recent JAX) is rejected with a LoweringError that says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import prod
from typing import Any

from attnpass.ir.core.sharding import Sharding
from attnpass.lowering.errors import LoweringError
from attnpass.lowering.sharding import Placed, Spmd


def _spec(sharding: Sharding | None) -> str:
    """``P(None, 'model', None, None)``; ``P()`` (replicated) for None."""
    return f"P({', '.join(repr(a) for a in sharding or ())})"


def _named(sharding: Sharding | None) -> str:
    return f"NamedSharding(mesh, {_spec(sharding)})"


def _constrain(var: str, sharding: Sharding) -> str:
    return f"jax.lax.with_sharding_constraint({var}, {_named(sharding)})"


def _entry(function: str, entry: str, inputs: Sequence[Placed], outputs: Sequence[Placed]) -> list[str]:
    def line(name: str, sharding: Sharding | None, replicated: str) -> str:
        return f"{_named(sharding) if sharding is not None else replicated},  # {name}"

    ins = [f"        {line(n, s, _named(None))}" for n, s in inputs]
    if len(outputs) == 1:
        outs = [f"    out_shardings={line(*outputs[0], 'None')}"]
    else:
        outs = ["    out_shardings=(", *(f"        {line(n, s, 'None')}" for n, s in outputs), "    ),"]
    return [f"{entry} = jax.jit(", f"    {function},", "    in_shardings=(", *ins, "    ),", *outs, ")"]


def _mesh_axes(mesh: Any) -> Mapping[str, int]:
    from jax.sharding import AbstractMesh, AxisType, Mesh

    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise LoweringError(f"mesh must be a jax.sharding.Mesh or AbstractMesh, got {type(mesh).__name__}")
    explicit = [a for a, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Auto]
    if explicit:
        raise LoweringError(
            f"mesh axes {', '.join(explicit)} are not AxisType.Auto; the sharded lowering leaves propagation to "
            "XLA's partitioner: build the mesh with axis_types=(jax.sharding.AxisType.Auto,) * n"
        )
    return dict(mesh.shape)


def _place(array: Any, mesh: Any, sharding: Sharding | None) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.device_put(array, NamedSharding(mesh, PartitionSpec(*(sharding or ()))))


def make_mesh(axes: Mapping[str, int]) -> Any:
    """A mesh with these axes (all ``Auto``): over the first devices when there are enough, else abstract.

    An ``AbstractMesh`` is enough to generate and export a program (StableHLO
    for the default backend), not to run it.
    """
    import jax
    from jax.sharding import AbstractMesh, AxisType

    shape, names = tuple(axes.values()), tuple(axes)
    types = (AxisType.Auto,) * len(names)
    if len(jax.devices()) >= prod(shape):
        return jax.make_mesh(shape, names, axis_types=types, devices=jax.devices()[: prod(shape)])
    return AbstractMesh(shape, names, axis_types=types)


SPMD = Spmd(
    prelude=("from jax.sharding import NamedSharding, PartitionSpec as P",),
    reserved=frozenset({"mesh", "NamedSharding", "P"}),
    mesh_axes=_mesh_axes,
    constrain=_constrain,
    entry=_entry,
    place=_place,
    make_mesh=make_mesh,
)

__all__ = ["SPMD", "make_mesh"]
