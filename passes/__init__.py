"""Passes over the attention IR: the pass contract, the pass manager, remarks and the rewrites.

The driver order (list order, whole graph per pass, fixed point = repeat the
whole pipeline, bounded) is documented in :mod:`attnpass.passes.manager`.
"""

from .base import Pass, PassError, PassResult, Remark, Remarks
from .dce import DeadCodeElimination
from .head_chunk import HeadChunkSDPA, head_chunk_plan
from .instrument import Instrumentation, PassTimings, PrintAfterChange
from .manager import PassManager
from .narrow_inputs import NarrowInputs
from .qsa_gather import QSAGather

__all__ = [
    "DeadCodeElimination", "HeadChunkSDPA", "Instrumentation", "Pass", "PassError", "PassManager", "PassResult",
    "PassTimings", "PrintAfterChange", "Remark", "Remarks", "head_chunk_plan",
]  # fmt: skip
__all__ += ["NarrowInputs", "QSAGather"]
from .raise_attention import RaiseAttention  # noqa: E402

__all__ += ["RaiseAttention"]
from .pipeline import format_pipeline, parse_pipeline  # noqa: E402
from .registry import PipelineError, available_passes, get_pass, register_pass  # noqa: E402
from .reproducer import Reproducer, load_reproducer  # noqa: E402

__all__ += [
    "PipelineError", "Reproducer", "available_passes", "format_pipeline", "get_pass", "load_reproducer",
    "parse_pipeline", "register_pass",
]  # fmt: skip
