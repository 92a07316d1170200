"""The core IR: types, the op registry, graphs, the verifier, the printer/parser, JSON, diffs and rendering.

Imports nothing of the rest of attnpass. Ops are registered into the registry
by the dialects (:mod:`attnpass.ir.dialects`); the core itself only knows the
builtin ``input`` and ``constant``.
"""

from .diff import GraphDiff, diff_graphs
from .graph import ROLES, Graph, Node
from .arguments import require_int
from .printer import PrintSettings, format_graph, format_node, format_slice, parse_graph
from .registry import (
    AttrSpec,
    OpDef,
    Operand,
    attr,
    get_op,
    operand,
    opt_operand,
    register,
    registered_ops,
    var_operand,
)
from .rendering import render, to_dot
from .types import (
    FLOAT_DTYPES,
    AttnpassError,
    DType,
    GraphFormatError,
    ShapeError,
    SourceLoc,
    TensorType,
    VerifyError,
)
from .verifier import verify

__all__ = [
    "FLOAT_DTYPES", "ROLES", "AttnpassError", "AttrSpec", "DType", "Graph", "GraphDiff", "GraphFormatError", "Node",
    "OpDef", "Operand", "PrintSettings", "ShapeError", "SourceLoc", "TensorType", "VerifyError", "attr", "diff_graphs",
    "format_graph", "format_node", "format_slice", "get_op", "operand", "opt_operand", "parse_graph", "register",
    "registered_ops", "render", "require_int", "to_dot", "var_operand", "verify",
]  # fmt: skip
