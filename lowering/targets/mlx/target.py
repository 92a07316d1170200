"""The MLX target: its emitters and runtime, and the MLX facts the backends use.

Primitive records come from ``mx.export_function``'s callback; placeholders
are lazy ``mx.zeros``; the export is an ``.mlxfn`` file. ``mlx.core`` is
imported only when one of these functions runs.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from attnpass.ir import DType, TensorType
from attnpass.ir.core.types import native_dtype_name
from attnpass.lowering.common import dtype_name
from attnpass.lowering.target import Export, Target

from .emitters import EMITTERS

if TYPE_CHECKING:
    from attnpass.lowering.program import Program


@dataclass(frozen=True)
class Primitive:
    """One primitive as MLX reports it: name, parameters, input and output (shape, dtype)."""

    name: str
    arguments: tuple
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    outputs: tuple[tuple[tuple[int, ...], str], ...]


def _io(entries: list) -> tuple[tuple[tuple[int, ...], str], ...]:
    return tuple((tuple(shape), native_dtype_name(dtype)) for _id, shape, dtype in entries)


def primitives(program: Program, *args: Any, **kwargs: Any) -> list[Primitive]:
    """The primitives of ``program``'s MLX graph for these inputs, in MLX's export order."""
    import mlx.core as mx

    program.require_target(MLX, "primitives()")
    records: list[Primitive] = []

    def callback(record: dict) -> None:
        if record.get("type") == "primitive":
            inputs, outputs = _io(record["inputs"]), _io(record["outputs"])
            records.append(Primitive(record["name"], tuple(record.get("arguments", ())), inputs, outputs))

    mx.export_function(callback, program.fn, *program.bind(*args, **kwargs))
    return records


def count_primitives(program: Program, *args: Any, **kwargs: Any) -> Counter:
    return Counter(p.name for p in primitives(program, *args, **kwargs))


def from_numpy(a: np.ndarray) -> Any:
    import mlx.core as mx

    return mx.array(a)


def to_numpy(x: Any) -> np.ndarray:
    """An MLX array as numpy (bfloat16 through ml_dtypes, bit for bit)."""
    import mlx.core as mx

    if x.dtype == mx.bfloat16:
        return np.array(x.view(mx.uint16)).view(DType.bfloat16.numpy)
    return np.array(x)


def placeholders(types: Sequence[TensorType]) -> list[Any]:
    """Lazy ``mx.zeros`` of these types: nothing the size of a KV cache is allocated."""
    import mlx.core as mx

    return [mx.zeros(t.shape, dtype=getattr(mx, dtype_name(t.dtype))) for t in types]


def export_mlx(program: Program, path: str | os.PathLike, *args: Any, **kwargs: Any) -> Path:
    """Write ``program`` as an MLX function file (``mx.export_function``); returns the path.

    Traced on the arguments (positional or by input name, only their types
    matter), or on zero placeholders without any. Read it back with
    ``mx.import_function(path)`` (it returns a tuple of arrays). The file's
    metadata is JSON: graph name, input names, program identity.
    """
    import mlx.core as mx

    program.require_target(MLX, "export_mlx")
    path = Path(path)
    bound = program.bind(*args, **kwargs) if args or kwargs else placeholders(program.input_types)
    metadata = {"graph": program.graph.name, "inputs": list(program.input_names), "identity": program.identity}
    mx.export_function(str(path), program.fn, *bound, metadata=json.dumps(metadata))
    return path


MLX = Target(
    name="mlx",
    distribution="mlx",
    prelude=("import mlx.core as mx",),
    aliases=frozenset({"mx"}),
    emitters=EMITTERS,
    array_module="mlx",
    from_numpy=from_numpy,
    runtime={
        "qsa": "attnpass.lowering.targets.mlx.runtime.qsa",
        "qsa_checked": "attnpass.lowering.targets.mlx.runtime.qsa_checked",
        "lse": "attnpass.lowering.targets.mlx.runtime.sdpa_lse",
        "attn": "attnpass.lowering.targets.mlx.runtime.explicit_sdpa",
        "qsdpa": "attnpass.lowering.targets.mlx.runtime.quantized_sdpa",
        "argtopk": "attnpass.lowering.targets.mlx.runtime.argtopk",
        "visible": "attnpass.ir.dialects.attention.visible",
    },
    to_numpy=to_numpy,
    count_primitives=count_primitives,
    placeholders=placeholders,
    export=Export("mlx", export_mlx, suffix=".mlxfn", loader="mlx.core.import_function"),
)
