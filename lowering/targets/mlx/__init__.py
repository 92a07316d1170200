"""The MLX target: ``mlx.core`` programs, their primitive records and ``.mlxfn`` export."""

from .emitters import mask_kind
from .target import MLX, Primitive, export_mlx, primitives

__all__ = ["MLX", "Primitive", "export_mlx", "mask_kind", "primitives"]
