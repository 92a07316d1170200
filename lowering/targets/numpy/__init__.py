"""The numpy reference target: float64 programs, rounded per node, the oracle of the other targets."""

from .target import NUMPY

__all__ = ["NUMPY"]
