"""The JAX target: ``jax.numpy`` programs, their jaxprs and StableHLO export."""

from .target import JAX, export_stablehlo, jaxpr

__all__ = ["JAX", "export_stablehlo", "jaxpr"]
