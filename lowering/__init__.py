"""Lowering: IR -> readable generated Python for a registered target ("mlx", "jax", "numpy", ...)."""

from .artifact import Artifact, ArtifactError, load_artifact, save_artifact
from .checks import RuntimeCheckError
from .errors import LoweringError
from .program import IdentityMismatch, Program, lower, program_identity
from .registry import available_targets, export_formats, get_target, register_target, sharded_lowering
from .target import Export, Target
from .targets import JAX, MLX, NUMPY

for _builtin in (NUMPY, MLX, JAX):  # the numpy reference first
    register_target(_builtin)

__all__ = [
    "Artifact", "ArtifactError", "Export", "IdentityMismatch", "LoweringError", "Program", "RuntimeCheckError",
    "Target",
    "available_targets", "export_formats", "get_target", "load_artifact", "lower", "program_identity",
    "register_target", "save_artifact", "sharded_lowering",
]  # fmt: skip
