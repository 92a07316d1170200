"""Per-target runtime facts: run programs, read back arrays, count the backend's own primitives, export.

Each function dispatches through the program's :class:`attnpass.lowering.Target`;
the target-specific parts live in the target's folder under ``lowering/targets/``.
The drop-in wrappers live in :mod:`attnpass.backends.mlx` (``compile``, ``optimize``)
and :mod:`attnpass.backends.jax` (``jit``), over :mod:`attnpass.backends.specialize`.
"""

from .dispatch import assert_primitive_counts, count_primitives, run, to_numpy

__all__ = ["assert_primitive_counts", "count_primitives", "run", "to_numpy"]
