"""Frontends that build graphs: the tracer and its op builders, and the MLX and JAX importers."""

from . import ops
from .import_jax import from_jax
from .import_mlx import from_mlx
from .importing import GraphBuilder, ImportedGraph, ModelImportError
from .tracer import Tensor, TensorSpec, trace

__all__ = [
    "GraphBuilder", "ImportedGraph", "ModelImportError", "Tensor", "TensorSpec", "from_jax", "from_mlx", "ops", "trace",
]  # fmt: skip
