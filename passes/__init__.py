"""Passes over the attention IR: the pass contract, the pass manager, remarks and the rewrites."""

from .base import Pass, PassError, PassResult, Remark, Remarks

__all__ = ["Pass", "PassError", "PassResult", "Remark", "Remarks"]
