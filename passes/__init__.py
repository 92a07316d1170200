"""Passes over the attention IR: the pass contract, the pass manager, remarks and the rewrites.

The driver order (list order, whole graph per pass, fixed point = repeat the
whole pipeline, bounded) is documented in :mod:`attnpass.passes.manager`.
"""

from .base import Pass, PassError, PassResult, Remark, Remarks
from .dce import DeadCodeElimination
from .instrument import Instrumentation, PassTimings, PrintAfterChange
from .manager import PassManager

__all__ = [
    "DeadCodeElimination", "Instrumentation", "Pass", "PassError", "PassManager", "PassResult",
    "PassTimings", "PrintAfterChange", "Remark", "Remarks",
]  # fmt: skip
