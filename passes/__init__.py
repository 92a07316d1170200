"""Passes over the attention IR: the pass contract, the manager, remarks, the shared rewrite layer and the rewrites.

The rewrite driver's order (one documented order for every rule-based pass) is
in :mod:`attnpass.passes.infra.rewrite`; the pipeline driver's (list order, whole
graph per pass, bounded fixed point) in :mod:`attnpass.passes.infra.manager`.
Built-in passes register themselves by name when imported here.
"""

from .device_pipelines import default_pipeline
from .infra.base import REASONS, Pass, PassError, PassResult, Remark, Remarks
from .infra.instrument import Instrumentation, PassTimings, PrintAfterChange
from .infra.manager import PassManager
from .infra.pipeline_text import format_pipeline, parse_pipeline
from .infra.policy import SwitchedPass
from .infra.registry import PipelineError, available_passes, get_pass, register_pass
from .infra.reproducer import Reproducer, load_reproducer
from .infra.rewrite import ANY, Decline, Rewriter, Rule, apply_rules
from .rewrites.block_sparse import BlockSparse
from .rewrites.canonicalize import Canonicalize
from .rewrites.dce import DeadCodeElimination
from .rewrites.decompose_sdpa import DecomposeSDPA
from .rewrites.dsa_gather import DSAGather
from .rewrites.head_chunk import HeadChunkSDPA, head_chunk_plan
from .rewrites.mla_absorb import MLAAbsorb, mla_crossover, mla_flops
from .rewrites.narrow_inputs import NarrowInputs
from .rewrites.qsa_gather import QSAGather
from .rewrites.qsa_pool_cache import QSAPoolCache
from .rewrites.raise_attention import RaiseAttention
from .rewrites.shard_attention import ShardAttention
from .rewrites.split_kv import SplitKV

__all__ = [
    "ANY", "BlockSparse", "Canonicalize", "DSAGather", "DeadCodeElimination", "Decline", "DecomposeSDPA", "HeadChunkSDPA",
    "Instrumentation", "MLAAbsorb", "NarrowInputs", "Pass", "PassError", "PassManager", "PassResult", "PassTimings", "PipelineError",
    "PrintAfterChange", "QSAGather", "QSAPoolCache", "REASONS", "RaiseAttention", "Remark", "Remarks", "Reproducer",
    "Rewriter",
    "Rule", "ShardAttention", "SplitKV", "SwitchedPass", "apply_rules", "available_passes", "default_pipeline",
    "format_pipeline", "get_pass", "head_chunk_plan", "load_reproducer", "mla_crossover", "mla_flops", "parse_pipeline", "register_pass",
]  # fmt: skip
