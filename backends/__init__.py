"""Per-target runtime facts: run programs, read back arrays, count the backend's own primitives, export.

Each function dispatches through the program's :class:`attnpass.lowering.Target`;
the target-specific parts live in the target's folder under ``lowering/targets/``.
"""

from .dispatch import assert_primitive_counts, count_primitives, run, to_numpy

__all__ = ["assert_primitive_counts", "count_primitives", "run", "to_numpy"]
