"""Lowering: IR -> readable generated Python for a target ("mlx", "jax", "numpy")."""

from .codegen import LoweringError, Target
from .program import TARGETS, IdentityMismatch, Program, lower, program_identity

__all__ = ["IdentityMismatch", "LoweringError", "Program", "TARGETS", "Target", "lower", "program_identity"]
