"""Export lowered programs for other compilers: MLX ``.mlxfn`` files and JAX StableHLO text.

Both exports trace the program on example arguments (positional or by input
name, as for ``run``); only their shapes and dtypes matter. Without
arguments, zero placeholders of the program's input types are used
(:func:`placeholders`): lazy ``mx.zeros`` for MLX and ``jax.ShapeDtypeStruct``
for JAX, so nothing the size of a KV cache is allocated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from attnpass.ir import DType
from attnpass.lowering import Program

_MLX_NAMES = {DType.bool: "bool_"}  # dtype attribute names of mlx.core that differ from DType.value


def _require(program: Program, target: str, what: str) -> None:
    if program.target != target:
        raise ValueError(f"{what} needs a program lowered to {target!r}, got target {program.target!r}")


def placeholders(program: Program) -> list[Any]:
    """Zero-valued example arguments of the program's input types, in the target's own array kind."""
    if program.target == "mlx":
        import mlx.core as mx

        dtypes = [getattr(mx, _MLX_NAMES.get(t.dtype, t.dtype.value)) for t in program.input_types]
        return [mx.zeros(t.shape, dtype=dtype) for t, dtype in zip(program.input_types, dtypes)]
    if program.target == "jax":
        import jax

        return [jax.ShapeDtypeStruct(t.shape, t.dtype.numpy) for t in program.input_types]
    raise ValueError(f"no placeholders for target {program.target!r}; exports exist for 'mlx' and 'jax'")


def export_mlx(program: Program, path: str | os.PathLike, *args: Any, **kwargs: Any) -> Path:
    """Write ``program`` as an MLX function file (``mx.export_function``); returns the path.

    Read it back with ``mx.import_function(path)`` (it returns a tuple of
    arrays). The file's metadata is JSON: graph name, input names, program identity.
    """
    import mlx.core as mx

    _require(program, "mlx", "export_mlx")
    path = Path(path)
    bound = program.bind(*args, **kwargs) if args or kwargs else placeholders(program)
    metadata = {"graph": program.graph.name, "inputs": list(program.input_names), "identity": program.identity}
    mx.export_function(str(path), program.fn, *bound, metadata=json.dumps(metadata))
    return path


def export_stablehlo(program: Program, *args: Any, **kwargs: Any) -> str:
    """The StableHLO text (MLIR) of ``jax.jit(program.fn)`` lowered for these arguments."""
    import jax

    _require(program, "jax", "export_stablehlo")
    bound = program.bind(*args, **kwargs) if args or kwargs else placeholders(program)
    return jax.jit(program.fn).lower(*bound).as_text()


__all__ = ["export_mlx", "export_stablehlo", "placeholders"]
