"""The typed attention IR, in three layers (imports flow downwards only):

- :mod:`attnpass.ir.core`: types, op registry, Graph, verifier, printer/parser, JSON, diffs, rendering;
- :mod:`attnpass.ir.dialects`: the op families (elementwise, layout, reductions, attention, QSA);
- :mod:`attnpass.ir.frontends`: the tracer with its op builders, and the MLX/JAX importers.

This module is their public face.
"""

from . import dialects
from .core import (
    FLOAT_DTYPES,
    ROLES,
    AttnpassError,
    AttrSpec,
    DType,
    Graph,
    GraphDiff,
    GraphFormatError,
    Node,
    OpDef,
    Operand,
    PrintSettings,
    ShapeError,
    SourceLoc,
    TensorType,
    VerifyError,
    attr,
    diff_graphs,
    format_graph,
    format_node,
    format_slice,
    get_op,
    operand,
    opt_operand,
    parse_graph,
    register,
    registered_ops,
    render,
    require_int,
    to_dot,
    var_operand,
    verify,
)
from .frontends import ImportedGraph, ModelImportError, Tensor, TensorSpec, from_jax, from_mlx, ops, trace

__all__ = [
    "FLOAT_DTYPES", "ROLES", "AttnpassError", "AttrSpec", "DType", "Graph", "GraphDiff", "GraphFormatError",
    "ImportedGraph", "ModelImportError", "Node", "OpDef", "Operand", "PrintSettings", "ShapeError", "SourceLoc",
    "Tensor", "TensorSpec", "TensorType", "VerifyError", "attr", "dialects", "diff_graphs", "format_graph",
    "format_node", "format_slice", "from_jax", "from_mlx", "get_op", "operand", "opt_operand", "ops",
    "parse_graph", "register", "registered_ops", "render", "require_int", "to_dot", "trace", "var_operand", "verify",
]  # fmt: skip
