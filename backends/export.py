"""Export lowered programs for other compilers: MLX ``.mlxfn`` files and JAX StableHLO text.

Both exports trace the program on example arguments (positional or by input
name, as for ``run``); only their shapes and dtypes matter. Without
arguments, zero placeholders of the program's input types are used
(:func:`placeholders`): lazy ``mx.zeros`` for MLX and ``jax.ShapeDtypeStruct``
for JAX, so nothing the size of a KV cache is allocated. Each export is its
target's (``Target.export``); this module gathers them.
"""

from __future__ import annotations

from typing import Any

from attnpass.lowering import Program
from attnpass.lowering.targets.jax import export_stablehlo
from attnpass.lowering.targets.mlx import export_mlx

from .dispatch import target_function


def placeholders(program: Program) -> list[Any]:
    """Zero-valued example arguments of the program's input types, in the target's own array kind."""
    return target_function(program, "placeholders", "placeholders")(program.input_types)


__all__ = ["export_mlx", "export_stablehlo", "placeholders"]
