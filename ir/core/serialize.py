"""JSON form of a graph. Loading validates every field and never executes anything.

:func:`read_json` is the one JSON reader of every loader (graphs, artifact
headers, crash reproducers): whatever the text, it returns plain JSON values
or raises the loader's :class:`AttnpassError`, within fixed bounds of size
(:data:`MAX_JSON_BYTES`), nesting (:data:`MAX_JSON_DEPTH`) and number range
(integer literals of at most :data:`MAX_INT_DIGITS` digits, finite floats, no
``NaN``/``Infinity`` constants).

Optional fields, written only when set: the graph's ``mesh`` (``[[axis, size], ...]``
in mesh order), a node's ``sharding`` (one axis name or null per dimension) and its
``optionals`` (the optional operands it has, by name: ``Node.optionals``).

Version 1 named no optional operand (sdpa flagged its sinks with a ``has_sinks``
attribute); such a document is read as version 2 (:func:`_from_version_1`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from .registry import decode_attr, encode_attr, get_op, registered_ops
from .sharding import decode_sharding
from .types import AttnpassError, DType, GraphFormatError, SourceLoc, TensorType, short_repr

if TYPE_CHECKING:
    from .graph import Graph

FORMAT = "attnpass.graph"
VERSION = 2
MAX_JSON_BYTES = 256 << 20  # a 192-layer model is ~3 MB
MAX_JSON_DEPTH = 64  # a graph nests 6 deep
MAX_INT_DIGITS = 20  # int64 and a sign
MAX_LOC_CHARS = 4096  # a source location's file or function


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer literal of {len(text.lstrip('-'))} digits is out of range")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of the float range")
    return value


def _parse_constant(name: str) -> Any:
    raise ValueError(f'{name} is not JSON (a non-finite attribute is written {{"float": "nan"}})')


def _depth(value: Any) -> int:
    """The nesting depth of a JSON value (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def read_json(text: str | bytes, what: str, error: type[AttnpassError] = GraphFormatError) -> Any:
    """Parse untrusted JSON ``text`` within the loader bounds, or raise ``error`` (prefixed with ``what``, if any)."""
    prefix = f"{what}: " if what else ""
    if not isinstance(text, (str, bytes, bytearray)):
        raise error(f"{prefix}expected JSON text, got {type(text).__name__}")
    if len(text) > MAX_JSON_BYTES:
        raise error(f"{prefix}{len(text)} bytes is more than the {MAX_JSON_BYTES} a loader reads")
    try:
        value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except RecursionError:
        raise error(f"{prefix}JSON nested more than {MAX_JSON_DEPTH} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{prefix}malformed JSON: {exc}") from None
    except ValueError as exc:  # our number checks
        raise error(f"{prefix}{exc}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise error(f"{prefix}JSON nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def check_envelope(
    doc: Any, format: str, version: int, what: str, error: type[AttnpassError] = GraphFormatError
) -> dict:
    """The one format/version check of every saved document (graph, artifact header, reproducer)."""
    if not isinstance(doc, dict) or doc.get("format") != format:
        raise error(f'not an attnpass {what}: expected an object with "format": "{format}"')
    if doc.get("version") != version:
        raise error(f"unsupported {what} version {short_repr(doc.get('version'))}; this library reads {version}")
    return doc


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
        if n.optionals:
            nodes[-1]["optionals"] = list(n.optionals)
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "name": graph.name,
        "inputs": list(graph.inputs),
        "outputs": list(graph.outputs),
        "nodes": nodes,
    }
    if graph.state_pairs():
        doc["state"] = [[name, out] for name, out in graph.state_pairs()]
    if graph.mesh_axes:
        doc["mesh"] = [[axis, size] for axis, size in graph.mesh_axes.items()]
    return json.dumps(doc, indent=indent, allow_nan=False)


def _field(obj: dict, key: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    if not isinstance(obj, dict):
        raise GraphFormatError(f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        if default is not ...:
            return default
        raise GraphFormatError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise GraphFormatError(f"{where}: field {key!r} has the wrong kind ({type(value).__name__})")
    return value


def _type(obj: Any, where: str) -> TensorType:
    shape = _field(obj, "shape", list, where)
    dtype = _field(obj, "dtype", str, where)
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise GraphFormatError(f"{where}: shape {short_repr(shape)} must be a list of ints")
    try:
        return TensorType(tuple(shape), DType.parse(dtype))
    except AttnpassError as exc:
        raise GraphFormatError(f"{where}: type: {exc}") from None


def _loc(obj: Any, where: str) -> SourceLoc | None:
    if obj is None:
        return None
    where = f"{where}: loc"
    file, function = _field(obj, "file", str, where), _field(obj, "function", str, where, "")
    line = _field(obj, "line", int, where)
    if max(len(file), len(function)) > MAX_LOC_CHARS or not 0 <= line < 2**31:
        raise GraphFormatError(
            f"{where}: file or function longer than {MAX_LOC_CHARS} characters, or line out of range"
        )
    return SourceLoc(file, line, function)  # printed escaped (SourceLoc.__str__)


def _from_version_1(doc: dict) -> dict:
    """A version-1 graph document in version 2's terms. Version 1 filled an op's optional operands in order from the
    inputs past its required ones, except sdpa's and sdpa_lse's ``sinks``: the last input when their ``has_sinks``
    attribute (gone since) was true. Malformed nodes are copied as they are, for the loader's checks to name."""
    nodes = []
    for raw in doc["nodes"] if isinstance(doc.get("nodes"), list) else []:
        op, inputs, attrs = (raw.get(k) if isinstance(raw, dict) else None for k in ("op", "inputs", "attrs"))
        opdef = registered_ops().get(op) if isinstance(op, str) else None
        if opdef is None or not (isinstance(inputs, list) and isinstance(attrs, dict)):
            nodes.append(raw)
            continue
        flagged = "sinks" in opdef.optional  # sdpa and sdpa_lse
        sinks = flagged and attrs.get("has_sinks") is True
        extra = max(len(inputs) - len(opdef.required) - sinks, 0)
        filled = [o for o in opdef.optional if o != "sinks"][:extra] + ["sinks"] * sinks
        attrs = {k: v for k, v in attrs.items() if not (flagged and k == "has_sinks")}
        nodes.append({**raw, "attrs": attrs, "optionals": filled})
    return {**doc, "version": 2, **({"nodes": nodes} if "nodes" in doc else {})}


def graph_from_json(text: str | bytes) -> "Graph":
    """Parse, validate and verify a graph written by :func:`graph_to_json`."""
    return graph_from_doc(read_json(text, ""))


def graph_from_doc(doc: Any) -> "Graph":
    """Validate and verify a graph from its parsed JSON document (as :func:`read_json` returns it)."""
    from .graph import Graph, Node

    if isinstance(doc, dict) and doc.get("format") == FORMAT and doc.get("version") == 1:
        doc = _from_version_1(doc)
    check_envelope(doc, FORMAT, VERSION, "graph")
    try:
        graph = Graph(_field(doc, "name", str, "graph"))
        mesh = doc.get("mesh", [])
        if not isinstance(mesh, list) or not all(isinstance(p, list) for p in mesh):
            raise GraphFormatError(f"graph: field 'mesh' must be a list of [axis, size] pairs, got {short_repr(mesh)}")
        graph.set_mesh(mesh)
        inputs = _field(doc, "inputs", list, "graph")
        for i, raw in enumerate(_field(doc, "nodes", list, "graph")):
            where = f"node #{i}"
            name = _field(raw, "name", str, where)
            where = f"node {short_repr(name)}"
            op = get_op(_field(raw, "op", str, where))
            operands = _field(raw, "inputs", list, where)
            if not all(isinstance(o, str) for o in operands):
                raise GraphFormatError(f"{where}: inputs must be names")
            try:
                attrs = {k: decode_attr(v) for k, v in _field(raw, "attrs", dict, where).items()}
            except ValueError as exc:
                raise GraphFormatError(f"{where}: {exc}") from None
            attrs = op.normalize_attrs(attrs, name)
            node_type, loc = _type(_field(raw, "type", dict, where), where), _loc(raw.get("loc"), where)
            sharding = decode_sharding(raw.get("sharding"), where)
            optionals = _field(raw, "optionals", list, where, [])
            if not all(isinstance(o, str) for o in optionals):
                raise GraphFormatError(f"{where}: optionals must be operand names, got {short_repr(optionals)}")
            graph.insert(Node(name, op.name, tuple(operands), attrs, node_type, loc, sharding, tuple(optionals)))
        graph.set_inputs(inputs)
        graph.set_outputs(_field(doc, "outputs", list, "graph"))
        for pair in _field(doc, "state", list, "graph", []):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and type(pair[1]) is int):
                raise GraphFormatError(f"graph: state entry {short_repr(pair)} must be [input name, output position]")
            graph.pair_state(*pair)
        return graph.verify()
    except GraphFormatError:
        raise
    except AttnpassError as exc:
        raise GraphFormatError(f"invalid graph JSON: {exc}") from None
