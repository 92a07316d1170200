"""JSON form of a graph. Loading validates every field and never executes anything.

Optional fields, written only when set: the graph's ``mesh`` (``[[axis, size], ...]``
in mesh order) and a node's ``sharding`` (one axis name or null per dimension).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .registry import decode_attr, encode_attr, get_op
from .sharding import decode_sharding
from .types import AttnpassError, DType, GraphFormatError, SourceLoc, TensorType

if TYPE_CHECKING:
    from .graph import Graph

FORMAT = "attnpass.graph"
VERSION = 1


def graph_to_json(graph: "Graph", indent: int | None = None) -> str:
    nodes = []
    for n in graph.nodes():
        loc = None if n.loc is None else {"file": n.loc.file, "line": n.loc.line, "function": n.loc.function}
        nodes.append(
            {
                "name": n.name,
                "op": n.op,
                "inputs": list(n.inputs),
                "attrs": {k: encode_attr(v) for k, v in n.attrs.items()},
                "type": {"shape": list(n.type.shape), "dtype": n.type.dtype.value},
                "loc": loc,
            }
        )
        if n.sharding is not None:
            nodes[-1]["sharding"] = list(n.sharding)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "name": graph.name,
        "inputs": list(graph.inputs),
        "outputs": list(graph.outputs),
        "nodes": nodes,
    }
    if graph.mesh_axes:
        doc["mesh"] = [[axis, size] for axis, size in graph.mesh_axes.items()]
    return json.dumps(doc, indent=indent, allow_nan=False)


def _field(obj: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise GraphFormatError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise GraphFormatError(f"{where}: field {key!r} has the wrong kind ({type(value).__name__})")
    return value


def _type(obj: Any, where: str) -> TensorType:
    shape = _field(obj, "shape", list, where)
    dtype = _field(obj, "dtype", str, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise GraphFormatError(f"{where}: shape {shape!r} must be a list of ints")
    return TensorType(tuple(shape), DType.parse(dtype))


def _loc(obj: Any, where: str) -> SourceLoc | None:
    if obj is None:
        return None
    return SourceLoc(_field(obj, "file", str, where), _field(obj, "line", int, where), obj.get("function", "") or "")


def graph_from_json(text: str | bytes) -> "Graph":
    """Parse, validate and verify a graph written by :func:`graph_to_json`."""
    from .graph import Graph, Node

    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GraphFormatError(f"malformed JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise GraphFormatError(f"not an attnpass graph: expected an object with \"format\": \"{FORMAT}\"")
    if doc.get("version") != VERSION:
        raise GraphFormatError(f"unsupported graph version {doc.get('version')!r}; this library reads {VERSION}")
    try:
        graph = Graph(_field(doc, "name", str, "graph"))
        mesh = doc.get("mesh", [])
        if not isinstance(mesh, list) or not all(isinstance(p, list) for p in mesh):
            raise GraphFormatError(f"graph: field 'mesh' must be a list of [axis, size] pairs, got {mesh!r}")
        graph.set_mesh(mesh)
        inputs = _field(doc, "inputs", list, "graph")
        for i, raw in enumerate(_field(doc, "nodes", list, "graph")):
            where = f"node #{i}"
            name = _field(raw, "name", str, where)
            where = f"node {name!r}"
            op = get_op(_field(raw, "op", str, where))
            operands = _field(raw, "inputs", list, where)
            if not all(isinstance(o, str) for o in operands):
                raise GraphFormatError(f"{where}: inputs must be names")
            try:
                attrs = {k: decode_attr(v) for k, v in _field(raw, "attrs", dict, where).items()}
            except ValueError as exc:
                raise GraphFormatError(f"{where}: {exc}") from None
            attrs = op.normalize_attrs(attrs)
            sharding = decode_sharding(raw.get("sharding"), where)
            type_, loc = _type(raw.get("type"), where), _loc(raw.get("loc"), where)
            graph.insert(Node(name, op.name, tuple(operands), attrs, type_, loc, sharding))
        graph.set_inputs(inputs)
        graph.set_outputs(_field(doc, "outputs", list, "graph"))
        return graph.verify()
    except GraphFormatError:
        raise
    except AttnpassError as exc:
        raise GraphFormatError(f"invalid graph JSON: {exc}") from None
