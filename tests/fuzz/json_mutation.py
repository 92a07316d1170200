"""JSON mutation fuzzing of ``Graph.from_json``: any text loads or raises an ``AttnpassError``, nothing else.

A case serialises a generated graph (a third of them stateful: a resident
buffer of the first output's type, updated by ``dynamic_update_slice`` and
paired with the new output, so ``"state"`` is mutated too; about a third with a
mesh and sharding annotations, so the mutations reach those fields too) and
applies one to three mutations to the decoded document (delete a key or element, duplicate or swap elements,
replace a value with a hostile one: wrong kinds, huge or non-finite numbers,
deep nesting, odd strings, another value's name) or to the text (truncate,
insert a character). A graph that loads must serialise again, load back equal
from its own JSON and from its printed text.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from attnpass.ir import AttnpassError, DType, Graph, PrintSettings, TensorType, format_graph, parse_graph

from .choices import Choices
from .differential import Failure
from .families import FAMILIES

HOSTILE: tuple[Any, ...] = (
    None, True, 0, -1, 1.5, "", "x", [], {}, 2**31, 2**40, -(2**63), 10**400, 1e308, float("inf"), float("nan"),
    "a b", "\n", "é", "\x00", "float32", "bool", "none", "-inf", {"float": "inf"}, {"float": "x"}, [1, [2]],
)  # fmt: skip


def _containers(doc: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every list and object in ``doc`` (the root first)."""
    found = [path] if isinstance(doc, (dict, list)) else []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        found += _containers(value, path + (key,))
    return found


def _at(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def _names(doc: Any) -> list[str]:
    nodes = doc.get("nodes") if isinstance(doc, dict) else None
    return (
        [n["name"] for n in nodes if isinstance(n, dict) and isinstance(n.get("name"), str)]
        if isinstance(nodes, list)
        else []
    )


# Values Python's json cannot build or write (deep nesting, more digits than int() converts) enter the
# text in place of these placeholder strings.
RAW = {'"@deep"': "[" * 3000 + "]" * 3000, '"@deep100"': "[" * 100 + "]" * 100, '"@digits"': "9" * 5000}


def _hostile(c: Choices, doc: Any) -> Any:
    kind = c.pick(["pool", "name", "raw"], (8, 2, 1))
    if kind == "name":
        return c.pick(_names(doc) or ["q"])
    if kind == "raw":
        return c.pick(sorted(RAW))[1:-1]
    return copy.deepcopy(c.pick(HOSTILE))  # a fresh [] or {}: a later mutation may append to it (even itself)


def _field(c: Choices, doc: Any) -> tuple | None:
    """The path of one field of one node's attrs, type or loc (where the loader's value checks are)."""
    nodes = doc.get("nodes") if isinstance(doc, dict) else None
    if not isinstance(nodes, list) or not nodes:
        return None
    i = c.int(0, len(nodes) - 1)
    part = c.pick(["attrs", "type", "loc"])
    inner = nodes[i].get(part) if isinstance(nodes[i], dict) else None
    return ("nodes", i, part) if isinstance(inner, dict) and inner else None


def _mutate(c: Choices, doc: Any) -> Any:
    path = _field(c, doc) if c.flag(0.5) else None
    container = _at(doc, path if path is not None else c.pick(_containers(doc)))
    keys = list(container) if isinstance(container, dict) else list(range(len(container)))
    op = c.pick(["replace", "delete", "duplicate", "swap", "add-key"])
    if not keys or op == "add-key":
        if isinstance(container, dict):
            container[c.pick(["extra", "loc", "attrs", "role", "sharding", "mesh"])] = _hostile(c, doc)
        else:
            container.append(_hostile(c, doc))
        return doc
    key = c.pick(keys)
    if op == "replace":
        container[key] = _hostile(c, doc)
    elif op == "delete":
        del container[key]
    elif op == "duplicate" and isinstance(container, list):
        container.insert(key, json.loads(json.dumps(container[key])))
    elif op == "swap" and isinstance(container, list):
        other = c.pick(keys)
        container[key], container[other] = container[other], container[key]
    return doc


def stateful(graph: Graph) -> Graph:
    """``graph`` with one state pair: a resident buffer of its first output's type, written whole at a runtime start."""
    first = graph.node(graph.outputs[0])
    if first.type.rank == 0:
        return graph
    g = graph.copy()
    buffer = g.add_input(g.fresh_name("cache"), first.type, "resident")
    start = g.add_input(g.fresh_name("at"), TensorType((first.type.rank,), DType.int32))
    g.set_outputs([*g.outputs, g.add_node("dynamic_update_slice", [buffer, first.name, start], hint="cache_next")])
    g.pair_state(buffer, len(g.outputs) - 1)
    return g.verify()


def _placed(c: Choices, graph: Graph) -> Graph:
    """``graph`` with a mesh ``x=2, y=1`` and valid shardings on some values (each axis on one even dimension)."""
    graph.set_mesh({"x": 2, "y": 1})
    for node in graph.nodes():
        shape = node.type.shape
        if not shape or not c.flag(0.3):
            continue
        sharding: list[str | None] = [None] * len(shape)
        sharding[c.int(0, len(shape) - 1)] = "y"
        even = [d for d, n in enumerate(shape) if n % 2 == 0 and sharding[d] is None]
        if even and c.flag():
            sharding[c.pick(even)] = "x"
        graph.set_sharding(node.name, sharding)
    return graph


def mutated_json(c: Choices) -> str:
    """The JSON of a generated graph, mutated."""
    graph = FAMILIES[c.pick(sorted(FAMILIES))](c).graph
    if c.flag(1 / 3):
        graph = stateful(graph)
    if c.flag(0.3):
        graph = _placed(c, graph)
    doc = json.loads(graph.to_json())
    for node in doc["nodes"]:  # source locations, as traced graphs carry them
        node["loc"] = {"file": "model.py", "line": c.int(1, 99), "function": c.pick(["f", "", "<lambda>"])}
    for _ in range(c.int(1, 3)):
        doc = _mutate(c, doc)
    text = json.dumps(doc)
    for placeholder, raw in RAW.items():
        text = text.replace(placeholder, raw)
    if c.flag(0.1):  # a text-level mutation: truncation or one inserted character
        at = c.int(0, len(text))
        text = text[:at] if c.flag() else text[:at] + c.pick(['"', "{", "]", ",", "\\", "0"]) + text[at:]
    return text


def check_loader(text: str) -> Failure | None:
    """None when ``text`` loads (and round-trips) or is refused with an AttnpassError."""
    try:
        graph = Graph.from_json(text)
    except AttnpassError:
        return None
    except Exception as exc:  # noqa: BLE001  the finding: a foreign exception out of the loader
        return Failure("loader", f"Graph.from_json raised {type(exc).__name__}: {str(exc)[:300]}")
    try:
        again = Graph.from_json(graph.to_json())
        printed = parse_graph(format_graph(graph, PrintSettings(max_values=None)))  # every value: text that reads back
    except Exception as exc:  # noqa: BLE001
        return Failure("round-trip", f"a loaded graph does not round-trip: {type(exc).__name__}: {str(exc)[:300]}")
    if again != graph or printed != graph:
        return Failure("round-trip", "a loaded graph round-trips to a different graph")
    return None
