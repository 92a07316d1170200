"""Lowering: IR -> readable generated Python for a target ("mlx", "jax", "numpy")."""

from .artifact import Artifact, ArtifactError, load_artifact, save_artifact
from .codegen import LoweringError, Target
from .program import TARGETS, IdentityMismatch, Program, lower, program_identity

__all__ = [
    "Artifact", "ArtifactError", "IdentityMismatch", "LoweringError", "Program", "TARGETS", "Target",
    "load_artifact", "lower", "program_identity", "save_artifact",
]  # fmt: skip
