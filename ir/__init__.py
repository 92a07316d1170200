"""The typed attention IR: types, the op registry, graphs, verifier, printer, JSON and the tracer."""

from . import opdefs as _opdefs  # noqa: F401  (registers the core op set)
from . import qsa as _qsa  # noqa: F401  (registers the QSA dialect)
from . import ops
from .graph import ROLES, Graph, Node
from .printer import PrintSettings, format_graph, format_node, format_slice, parse_graph
from .registry import AttrSpec, OpDef, attr, get_op, register, registered_ops
from .tracer import Tensor, TensorSpec, trace
from .types import (
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
    "AttnpassError", "AttrSpec", "DType", "Graph", "GraphFormatError", "Node", "OpDef", "PrintSettings",
    "ROLES", "ShapeError", "SourceLoc", "Tensor", "TensorSpec", "TensorType", "VerifyError", "attr",
    "format_graph", "format_node", "format_slice", "get_op", "ops", "parse_graph", "register", "registered_ops", "trace",
    "verify",
]  # fmt: skip

from .importing import ImportedGraph, ModelImportError  # noqa: E402
from .import_mlx import from_mlx  # noqa: E402
from .import_jax import from_jax  # noqa: E402

__all__ += ["ImportedGraph", "ModelImportError", "from_jax", "from_mlx"]
