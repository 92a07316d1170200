"""Passes over the attention IR: the pass contract, the manager, remarks, the shared rewrite layer and the rewrites.

The rewrite driver's order (one documented order for every rule-based pass) is
in :mod:`attnpass.passes.rewrite`; the pipeline driver's (list order, whole
graph per pass, bounded fixed point) in :mod:`attnpass.passes.manager`.
Built-in passes register themselves by name when imported here.
"""

from .base import REASONS, Pass, PassError, PassResult, Remark, Remarks
from .block_sparse import BlockSparse
from .canonicalize import Canonicalize
from .dce import DeadCodeElimination
from .decompose_sdpa import DecomposeSDPA
from .head_chunk import HeadChunkSDPA, head_chunk_plan
from .instrument import Instrumentation, PassTimings, PrintAfterChange
from .manager import PassManager
from .narrow_inputs import NarrowInputs
from .pipeline import format_pipeline, parse_pipeline
from .pipelines import default_pipeline
from .policy import SwitchedPass
from .qsa_gather import QSAGather
from .qsa_pool_cache import QSAPoolCache
from .raise_attention import RaiseAttention
from .registry import PipelineError, available_passes, get_pass, register_pass
from .reproducer import Reproducer, load_reproducer
from .rewrite import ANY, Decline, Rewriter, Rule, apply_rules
from .shard_attention import ShardAttention
from .split_kv import SplitKV

__all__ = [
    "ANY", "BlockSparse", "Canonicalize", "DeadCodeElimination", "Decline", "DecomposeSDPA", "HeadChunkSDPA", "Instrumentation",
    "NarrowInputs", "Pass", "PassError", "PassManager", "PassResult", "PassTimings", "PipelineError",
    "PrintAfterChange", "QSAGather", "QSAPoolCache", "REASONS", "RaiseAttention", "Remark", "Remarks", "Reproducer",
    "Rewriter",
    "Rule", "ShardAttention", "SplitKV", "SwitchedPass", "apply_rules", "available_passes", "default_pipeline",
    "format_pipeline", "get_pass", "head_chunk_plan", "load_reproducer", "parse_pipeline", "register_pass",
]  # fmt: skip
