"""MLX runtime facts: primitive records from ``mx.export_function``, array conversion."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from attnpass.lowering import Program

from .mlx_route import Route, sdpa_route, sdpa_routes  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Primitive:
    """One primitive as MLX reports it: name, parameters, input and output (shape, dtype)."""

    name: str
    arguments: tuple
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    outputs: tuple[tuple[tuple[int, ...], str], ...]


def _io(entries: list) -> tuple[tuple[tuple[int, ...], str], ...]:
    return tuple((tuple(shape), str(dtype).rsplit(".", 1)[-1]) for _id, shape, dtype in entries)


def primitives(program: Program, *args: Any, **kwargs: Any) -> list[Primitive]:
    """The primitives of ``program``'s MLX graph for these inputs, in MLX's export order."""
    import mlx.core as mx

    if program.target != "mlx":
        raise ValueError(f"primitives() needs an MLX program, got target {program.target!r}")
    records: list[Primitive] = []

    def callback(record: dict) -> None:
        if record.get("type") == "primitive":
            records.append(
                Primitive(record["name"], tuple(record.get("arguments", ())), _io(record["inputs"]), _io(record["outputs"]))
            )

    mx.export_function(callback, program.fn, *program.bind(*args, **kwargs))
    return records


def count_primitives(program: Program, *args: Any, **kwargs: Any) -> Counter:
    return Counter(p.name for p in primitives(program, *args, **kwargs))


def to_numpy(x: Any) -> np.ndarray:
    """An MLX array as numpy (bfloat16 through ml_dtypes, bit for bit)."""
    import mlx.core as mx

    if x.dtype == mx.bfloat16:
        from attnpass.ir import DType

        return np.array(x.view(mx.uint16)).view(DType.bfloat16.numpy)
    return np.array(x)
