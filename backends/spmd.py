"""What a sharded JAX program does on its mesh: the collectives XLA compiled in, and the bytes each device holds.

Both read the compiled program, not the graph: :func:`collectives` parses the
HLO after SPMD partitioning (``.lower(...).compile().as_text()``), and
:func:`input_bytes_per_device` asks each input's ``NamedSharding`` for its
shard shape (what ``addressable_shards`` of a placed argument hold, without
allocating it). Programs come from ``lower(graph, "jax", mesh=mesh)`` on a
concrete mesh.
"""

from __future__ import annotations

import re
from math import prod
from typing import Any

from attnpass.lowering import Program
from attnpass.lowering.targets.jax import JAX

from .export import placeholders

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
_ITEMSIZE = {
    "pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8,
    "s64": 8, "u64": 8,
}  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.-]+ = (.+?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(", re.M)
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")


def _require_mesh(program: Program, what: str) -> None:
    if program.mesh is None:
        raise ValueError(f"{what} needs a program lowered with a mesh (lower(graph, 'jax', mesh=mesh))")


def compiled_hlo(program: Program, *args: Any, **kwargs: Any) -> str:
    """The partitioned HLO text of a sharded program, compiled for these arguments (default: placeholders)."""
    _require_mesh(program, "compiled_hlo")
    program.require_target(JAX, "compiled_hlo")
    bound = program.bind(*args, **kwargs) if args or kwargs else placeholders(program)
    return program.fn.lower(*bound).compile().as_text()


def collectives(hlo: str) -> dict[str, list[int]]:
    """Each collective op of partitioned HLO text -> the bytes of every instance's result, in program order."""
    found: dict[str, list[int]] = {op: [] for op in COLLECTIVES}
    for types, op in _INSTRUCTION.findall(hlo):
        arrays = _ARRAY.findall(types)
        found[op].append(sum(prod(int(d) for d in dims.split(",") if d) * _ITEMSIZE[t] for t, dims in arrays))
    return found


def input_bytes_per_device(program: Program) -> dict[str, int]:
    """Bytes of each input that one device holds under the program's input shardings."""
    _require_mesh(program, "input_bytes_per_device")
    from jax.sharding import NamedSharding, PartitionSpec

    out = {}
    for name, type_ in zip(program.input_names, program.input_types):
        sharding = NamedSharding(program.mesh, PartitionSpec(*(program.graph.node(name).sharding or ())))
        out[name] = prod(sharding.shard_shape(type_.shape)) * type_.dtype.itemsize
    return out


__all__ = ["COLLECTIVES", "collectives", "compiled_hlo", "input_bytes_per_device"]
