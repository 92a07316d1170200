"""The built-in targets, one folder each: emitters, the runtime its programs import, its :class:`Target`."""

from .jax import JAX
from .mlx import MLX
from .numpy import NUMPY

__all__ = ["JAX", "MLX", "NUMPY"]
