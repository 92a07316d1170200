"""The op dialects: each module registers one family of ops (a declarative record with a pure shape rule).

Core families: :mod:`.elementwise`, :mod:`.layout`, :mod:`.reductions`,
:mod:`.attention`, :mod:`.convolution`; the QSA dialect: :mod:`.qsa`; MLX's affine quantization:
:mod:`.quant`. Importing this package
registers them all. Adding an op is its record here plus its emitters in
each lowering target.
"""

from . import attention, convolution, elementwise, layout, qsa, quant, reductions
from .attention import CAUSAL_KINDS
from .qsa import min_width

__all__ = [
    "CAUSAL_KINDS", "attention", "convolution", "elementwise", "layout", "min_width", "qsa", "quant", "reductions",
]  # fmt: skip
