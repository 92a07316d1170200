"""Render a graph with the Graphviz ``dot`` layout, highlighting the nodes a rewrite added or changed.

:func:`to_dot` writes DOT text (no dependency). SVG and PNG come from a
``dot`` program: ``graphviz-pure`` (the ``render`` extra: a pure-Rust port of
Graphviz 16.1 shipped as one static binary in its wheel, so ``pip`` alone
provides it) next to this Python, else on ``PATH``, else a system ``dot``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Mapping

from .diff import diff_graphs
from .graph import Graph, Node
from .printer import format_slice
from .types import AttnpassError, DType

ADDED, CHANGED = "#ffc971", "#fff3b0"  # fill colours of highlighted nodes
STREAMED, RESIDENT = "#dbe9f6", "#e6e6e6"  # fill colours of graph inputs by role
MAX_ATTRS = 60  # characters of attributes shown in a node before "..."
DOT_PROGRAMS = ("graphviz-pure", "dot")
FORMATS = ("svg", "png", "dot")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _label(node: Node) -> str:
    if node.op == "input":
        return f"{node.name}\n{node.type}\n{node.attrs['role']}"
    if node.op == "slice":
        attrs = format_slice(node)
    else:
        attrs = ", ".join(f"{k}={v.value if isinstance(v, DType) else v}" for k, v in node.attrs.items())
    if len(attrs) > MAX_ATTRS:
        attrs = attrs[: MAX_ATTRS - 3] + "..."
    return f"{node.name} = {node.op}" + (f"\n[{attrs}]" if attrs else "") + f"\n{node.type}"


def to_dot(graph: Graph, highlight: Mapping[str, str] | None = None, caption: str = "") -> str:
    """DOT text of ``graph`` top-down; ``highlight`` maps node names to fill colours."""
    highlight = highlight or {}
    lines = [
        f"digraph {_quote(graph.name)} {{",
        "  rankdir=TB;",
        f"  label={_quote(caption or f'graph {graph.name}')}; labelloc=t; fontname=Helvetica;",
        '  node [shape=box, style="rounded,filled", fillcolor=white, fontname=Helvetica, fontsize=11];',
        '  edge [color="#555555", arrowsize=0.6];',
    ]
    outputs = set(graph.outputs)
    for node in graph.nodes():
        attrs = [f"label={_quote(_label(node))}"]
        if node.op == "input":
            role_fill = STREAMED if node.attrs["role"] == "streamed" else RESIDENT
            attrs += ["shape=ellipse", f'fillcolor="{highlight.get(node.name, role_fill)}"']
        elif node.name in highlight:
            attrs.append(f'fillcolor="{highlight[node.name]}"')
        if node.name in outputs:
            attrs.append("peripheries=2")
        lines.append(f"  {_quote(node.name)} [{', '.join(attrs)}];")
    for node in graph.nodes():
        for operand in node.inputs:
            lines.append(f"  {_quote(operand)} -> {_quote(node.name)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def highlight_against(before: Graph, after: Graph) -> tuple[dict[str, str], str]:
    """Fill colours for ``after``'s nodes added or changed since ``before``, and a caption saying so."""
    diff = diff_graphs(before, after)
    colours = {n: ADDED for n in diff.added} | {n: CHANGED for n in diff.changed}
    removed = ", ".join(diff.removed[:8]) + (", ..." if len(diff.removed) > 8 else "")
    caption = (
        f"graph {after.name}: {len(diff.added)} added (orange), {len(diff.changed)} changed (yellow), "
        f"{len(diff.removed)} removed" + (f" ({removed})" if removed else "")
    )
    return colours, caption


def find_dot() -> str:
    """The path of a Graphviz ``dot`` program; raises AttnpassError saying how to get one."""
    scripts = Path(sysconfig.get_path("scripts"))
    for program in DOT_PROGRAMS:
        beside = scripts / program
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
        found = shutil.which(program)
        if found:
            return found
    raise AttnpassError(
        "rendering SVG/PNG needs Graphviz: pip install 'attnpass[render]' (graphviz-pure), "
        "or write DOT with -o FILE.dot"
    )


def render(graph: Graph, path: str | os.PathLike, *, against: Graph | None = None) -> Path:
    """Write ``graph`` to ``path`` (.svg, .png or .dot), highlighting what differs from ``against``."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise AttnpassError(f"cannot render to {path.name!r}: the file name must end in .svg, .png or .dot")
    colours, caption = highlight_against(against, graph) if against is not None else ({}, "")
    dot = to_dot(graph, colours, caption)
    if fmt == "dot":
        path.write_text(dot)
        return path
    done = subprocess.run([find_dot(), f"-T{fmt}", "-o", str(path)], input=dot.encode(), capture_output=True)
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {done.returncode}"]
        raise AttnpassError(f"Graphviz failed to render {path}: {reason[0]}")
    return path


__all__ = ["find_dot", "highlight_against", "render", "to_dot"]
