"""The one printer (and its parser): a stable, jaxpr-like text form that round-trips.

::

    graph attention(q:bf16[1,24,5,256], k:bf16[1,2,64,256]{resident}, v:bf16[1,2,64,256]{resident}) {
      sdpa:bf16[1,24,5,256] = sdpa[scale=0.0625, causal='none'] q k v
      return sdpa
    }

Attribute values are Python literals (non-finite floats print as ``inf``,
``-inf``, ``nan``); :func:`parse_graph` reads them back with ``ast`` (nothing
is evaluated), so ``parse_graph(format_graph(g)) == g``. Optional operands follow the required
ones as ``name=value`` (``sdpa ... q k v sinks=s``). An output that is the
next value of a state input reads ``return out, cache_next -> cache``. A graph with a mesh
prints it after the inputs (``... ) mesh(data=2, model=4) {``) and a sharded
value writes its mesh axis after the dimension it splits: ``bf16[1,24@model,5,256]``.

An attribute tuple of more than ``PrintSettings.max_values`` values (a large constant) prints numpy-style, its
first and last three around ``...``, beside the constant's shape and dtype
(``constant[value=(0, 1, 2, ..., 4093, 4094, 4095), shape=(4096,), dtype='int32']``), so no line is absurdly
long; such text does not read back (:func:`parse_graph` says so): ``PrintSettings(max_values=None)`` prints every
value, as does ``graph.to_json()``.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .registry import get_op, registered_ops
from .sharding import Sharding, parse_mesh
from .types import AttnpassError, DType, GraphFormatError, TensorType, short_repr

if TYPE_CHECKING:
    from .graph import Graph, Node


MAX_VALUES = 64  # the most values an attribute tuple prints in full (the importers' constant inline limit)
EDGE_VALUES = 3  # an elided tuple's values shown at each end, as numpy summarises


@dataclass(frozen=True)
class PrintSettings:
    """Printer options in one record."""

    show_locs: bool = False  # append '# file:line' to nodes with a source location
    indent: str = "  "
    max_values: int | None = MAX_VALUES  # a longer attribute tuple prints its ends around '...'; None: all of it


def format_type(t: TensorType, sharding: Sharding | None = None) -> str:
    """``bf16[1,24,5,256]``; with a sharding, each split dimension names its mesh axis: ``24@model``."""
    if sharding is None:
        return str(t)
    dims = ",".join(f"{d}@{a}" if a else str(d) for d, a in zip(t.shape, sharding))
    return f"{t.dtype.short}[{dims}]"


_AS_REPR = frozenset({int, str, bool, type(None)})


def _format_value(v: Any) -> str:
    if type(v) in _AS_REPR or (type(v) is tuple and all(type(x) is int for x in v)):
        return repr(v)  # spelled alike; the common case, checked first
    if isinstance(v, DType):
        return repr(v.value)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if v is Ellipsis:
        return "..."
    if isinstance(v, tuple):
        inner = ", ".join(_format_value(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    return repr(v)


def _summary(value: Any, max_values: int | None) -> Any:
    """``value``, or a tuple of more than ``max_values`` values as its ends around ``...`` (numpy's summary)."""
    if max_values is None or not isinstance(value, tuple) or len(value) <= max(max_values, 2 * EDGE_VALUES):
        return value
    return (*value[:EDGE_VALUES], ..., *value[-EDGE_VALUES:])


def format_slice(node: "Node") -> str:
    """A static slice node's bounds in Python syntax: ``0:1, 8:12, 0:4:2`` (no brackets)."""
    bounds = zip(node.attrs["start"], node.attrs["stop"], node.attrs["step"])
    return ", ".join(f"{lo}:{hi}" + (f":{st}" if st != 1 else "") for lo, hi, st in bounds)


def format_node(node: "Node", settings: PrintSettings = PrintSettings()) -> str:
    """``name:type = op[attrs] operands`` for one node."""
    op = registered_ops().get(node.op)
    specs = op.attrs if op is not None else {}
    shown = {k: v for k, v in node.attrs.items() if not (k in specs and specs[k].quiet and v == specs[k].default)}
    attrs = ", ".join(f"{k}={_format_value(_summary(v, settings.max_values))}" for k, v in shown.items())
    head = f"{node.name}:{format_type(node.type, node.sharding)} = {node.op}{f'[{attrs}]' if attrs else ''}"
    split = max(len(node.inputs) - len(node.optionals), 0)  # the required operands, then the named optional ones
    named = (f"{o}={v}" for o, v in zip(node.optionals, node.inputs[split:]))
    line = " ".join([head, *node.inputs[:split], *named])
    if settings.show_locs and node.loc is not None:
        line += f"  # {node.loc}"
    return line


def format_graph(graph: "Graph", settings: PrintSettings = PrintSettings()) -> str:
    """The full text form of ``graph``."""
    params = []
    for name in graph.inputs:
        n = graph.node(name)
        role = n.attrs.get("role", "streamed")
        params.append(f"{name}:{format_type(n.type, n.sharding)}" + ("" if role == "streamed" else f"{{{role}}}"))
    mesh = ", ".join(f"{axis}={size}" for axis, size in graph.mesh_axes.items())
    lines = [f"graph {graph.name}({', '.join(params)}){f' mesh({mesh})' if mesh else ''} {{"]
    for n in graph.nodes():
        if n.op != "input":
            lines.append(settings.indent + format_node(n, settings))
    state = {out: name for name, out in graph.state_pairs()}
    results = [o + (f" -> {state[i]}" if i in state else "") for i, o in enumerate(graph.outputs)]
    lines.append(f"{settings.indent}return {', '.join(results)}")
    lines.append("}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- parsing

_SHARDED_TYPE = re.compile(r"(\w+)\[((?:[0-9]+(?:@\w+)?(?:,[0-9]+(?:@\w+)?)*)?)\]\Z")  # dims, each maybe @axis
_HEADER = re.compile(r"graph (\w+)\(([^()]*)\)(?: mesh\(([^()]*)\))? \{\Z")
_PARAM = re.compile(r"(\w+):(\w+\[[\w@,]*\])(?:\{(\w+)\})?\Z")
_NODE_HEAD = re.compile(r"(\w+):(\w+\[[\w@,]*\]) = (\w+)")
_OPERANDS = re.compile(r"(?: \w+)*(?: \w+=\w+)*\Z")  # the required operands, then optional ones as name=value
_NONFINITE = {"inf": math.inf, "nan": math.nan}
MAX_TEXT_CHARS = 256 << 20  # as for JSON (serialize.MAX_JSON_BYTES)
MAX_DIGITS = 20  # a dimension or an attribute integer: int64 and a sign


def parse_type(text: str) -> TensorType:
    """``bf16[1,24,5,256]`` -> the TensorType (a sharded type is an error here)."""
    type_, sharding = parse_sharded_type(text)
    if sharding is not None:
        raise GraphFormatError(
            f"type {short_repr(text)} names mesh axes; expected a plain type such as bf16[1,24,5,256]"
        )
    return type_


def parse_sharded_type(text: str) -> tuple[TensorType, Sharding | None]:
    """``bf16[1,24@model,5,256]`` -> the type and its sharding (None when no dimension names an axis)."""
    m = _SHARDED_TYPE.match(text.strip())
    if not m:
        raise GraphFormatError(
            f"malformed type {short_repr(text)}; expected e.g. bf16[1,24,5,256] or bf16[1,24@model,5,256]"
        )
    dims = [d.partition("@") for d in m.group(2).split(",")] if m.group(2) else []
    if any(len(d) > MAX_DIGITS for d, _, _ in dims):
        raise GraphFormatError(f"type {short_repr(text)}: a dimension is out of range")
    sharding = tuple(axis or None for _, _, axis in dims)
    type_ = TensorType(tuple(int(d) for d, _, _ in dims), DType.parse(m.group(1)))
    return type_, sharding if any(sharding) else None


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _NONFINITE:
        return _NONFINITE[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_literal(node.operand)
    if isinstance(node, ast.Tuple):
        return tuple(_literal(e) for e in node.elts)
    return ast.literal_eval(node)


def _parse_attrs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        assert isinstance(call, ast.Call) and not call.args
        assert all(kw.arg is not None for kw in call.keywords), "expected name=value pairs"
        return {kw.arg: _literal(kw.value) for kw in call.keywords}
    except (SyntaxError, ValueError, TypeError, AssertionError, RecursionError, MemoryError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GraphFormatError(f"malformed attributes [{short_repr(text)[1:-1]}]: {reason}") from None


def _parse_node(lineno: int, line: str) -> tuple[str, str, str, str | None, list[str]]:
    """``name, type, op, attrs text (or None), operand words`` of one node line (linear time: no regex backtracking)."""
    m = _NODE_HEAD.match(line)
    rest = line[m.end() :] if m else ""
    attrs = None
    if m and rest.startswith("["):
        close = rest.rfind("]")  # operands never contain ']', so the attributes end at the last one
        attrs, rest = (rest[1:close], rest[close + 1 :]) if close > 0 else (None, "?")
    if not m or not _OPERANDS.match(rest):
        raise GraphFormatError(f"line {lineno}: malformed node {short_repr(line)}")
    return m.group(1), m.group(2), m.group(3), attrs, rest.split()


def parse_graph(text: str) -> "Graph":
    """Read the text form back into a verified Graph. Never evaluates code."""
    from .graph import Graph, Node

    if not isinstance(text, str):
        raise GraphFormatError(f"expected graph text, got {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise GraphFormatError(f"graph text of {len(text)} characters is more than the {MAX_TEXT_CHARS} a loader reads")
    lines = [ln.split("  #")[0].rstrip() for ln in text.strip().splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    if len(lines) < 3 or lines[-1].strip() != "}" or not lines[-2].strip().startswith("return "):
        raise GraphFormatError("malformed graph text: expected 'graph NAME(...) {', node lines, 'return ...', '}'")
    header = _HEADER.match(lines[0].strip())
    if not header:
        raise GraphFormatError(f"malformed graph header {short_repr(lines[0])}")
    try:
        graph = Graph(header.group(1))
        graph.set_mesh(parse_mesh(header.group(3) or ""))
        for param in filter(None, (p.strip() for p in header.group(2).split(", "))):
            m = _PARAM.match(param)
            if not m:
                raise GraphFormatError(
                    f"malformed graph input {short_repr(param)}; expected name:type or name:type{{role}}"
                )
            type_, sharding = parse_sharded_type(m.group(2))
            graph.add_input(m.group(1), type_, m.group(3) or "streamed")
            graph.set_sharding(m.group(1), sharding)
        for lineno, line in enumerate(lines[1:-2], start=2):
            name, type_, op, attrs, args = _parse_node(lineno, line.strip())
            values = _parse_attrs(attrs)
            elided = next((k for k, v in values.items() if isinstance(v, tuple) and Ellipsis in v), None)
            if elided is not None:
                raise GraphFormatError(
                    f"line {lineno}: the {elided} of {name} was elided when printed (more than {MAX_VALUES} values "
                    "by default): read the graph from its JSON (graph.to_json()) or from "
                    "format_graph(graph, PrintSettings(max_values=None))"
                )
            norm = get_op(op).normalize_attrs(values, name)
            type_, sharding = parse_sharded_type(type_)
            named = [a.partition("=")[::2] for a in args if "=" in a]
            inputs = tuple(a for a in args if "=" not in a) + tuple(value for _, value in named)
            optionals = tuple(o for o, _ in named)
            graph.insert(Node(name, op, inputs, norm, type_, sharding=sharding, optionals=optionals))
        results = [o.strip().partition(" -> ") for o in lines[-2].strip()[len("return ") :].split(",")]
        graph.set_outputs([value for value, _, _ in results])
        for i, (_value, arrow, state) in enumerate(results):
            if arrow:
                graph.pair_state(state, i)
        return graph.verify()
    except GraphFormatError:
        raise
    except AttnpassError as exc:
        raise GraphFormatError(f"malformed graph text: {exc}") from None


__all__ = [
    "PrintSettings", "format_graph", "format_node", "format_type", "parse_graph", "parse_sharded_type", "parse_type",
]  # fmt: skip
