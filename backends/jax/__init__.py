"""JAX drop-in use.

- :func:`jit`: ``jax.jit`` with attnpass's pipeline in front, per input signature (:mod:`.jitted`).

JAX's backend facts (array conversion, primitive counts, export, sharded lowering) live in its
lowering target, :mod:`attnpass.lowering.targets.jax`.
"""

from .jitted import PASSED_THROUGH, JAXFrontend, jit

__all__ = ["JAXFrontend", "PASSED_THROUGH", "jit"]
