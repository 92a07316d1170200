"""How the command line shows remarks and source locations: short paths, wrapped lines, JSON, summaries.

Source locations are recorded as absolute paths by the tracer. On the terminal
a path under the working directory is shown relative to it, a path of an
imported module as the module's path (``attnpass/models/qwen38.py``), any
other path as recorded; ``--full-paths`` keeps every path as recorded.
Remarks wrap to the terminal's width (at most :data:`MAX_WIDTH`) when stdout
is a terminal; ``--remarks-json FILE`` writes them whole.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    from attnpass.ir import Graph, SourceLoc
    from attnpass.passes import Remark

MAX_WIDTH = 100  # remarks wrap to the terminal's width, but no wider: long lines are hard to read
INDENT = "    "  # continuation lines of a wrapped remark


_MODULE_FILES: tuple[int, dict[str, str]] = (-1, {})  # (len(sys.modules) when built, real file -> module name)


def module_path(file: str) -> str | None:
    """``attnpass/models/qwen38.py`` for the file of an imported module, else None."""
    global _MODULE_FILES
    if _MODULE_FILES[0] != len(sys.modules):  # rebuilt only when modules were imported since
        files = {}
        for name, module in list(sys.modules.items()):
            origin = getattr(module, "__file__", None)
            if isinstance(origin, str) and name != "__main__":
                files.setdefault(os.path.realpath(origin), name)
        _MODULE_FILES = (len(sys.modules), files)
    real = os.path.realpath(file)
    name = _MODULE_FILES[1].get(real)
    if name is None:
        return None
    stem = name.replace(".", "/")
    return f"{stem}/__init__.py" if os.path.basename(real) == "__init__.py" else f"{stem}.py"


def short_path(file: str) -> str:
    """``file`` relative to the working directory if it lies below it, else as its module, else as recorded."""
    if not os.path.isabs(file):
        return file
    try:
        relative = os.path.relpath(file)
    except ValueError:  # another drive
        relative = os.pardir
    if relative != os.pardir and not relative.startswith(os.pardir + os.sep):
        return relative
    return module_path(file) or file


def path_style(full_paths: bool) -> Callable[[str], str]:
    """The path formatter of ``--full-paths`` (as recorded) or the default (short)."""
    return (lambda file: file) if full_paths else short_path


def _relocated(loc: "SourceLoc | None", paths: Callable[[str], str]) -> "SourceLoc | None":
    return None if loc is None else replace(loc, file=paths(loc.file))


def relocate(graph: "Graph", paths: Callable[[str], str]) -> "Graph":
    """A copy of ``graph`` whose source locations name their files through ``paths``."""
    out = graph.copy()
    for node in graph.nodes():
        if node.loc is not None:
            out.replace_node(node.name, node.replace(loc=_relocated(node.loc, paths)))
    return out


def terminal_width(stream=None) -> int:
    """The wrapping width for ``stream`` (stdout): the terminal's, at most MAX_WIDTH; 0 (no wrapping) off a terminal."""
    stream = sys.stdout if stream is None else stream
    if not getattr(stream, "isatty", lambda: False)():
        return 0
    return min(MAX_WIDTH, shutil.get_terminal_size((MAX_WIDTH, 24)).columns)


def format_remark(remark: "Remark", paths: Callable[[str], str], width: int = 0) -> str:
    """One remark as text: its location through ``paths``, wrapped to ``width`` columns (0: one line)."""
    text = str(replace(remark, loc=_relocated(remark.loc, paths)))
    if width <= len(INDENT) or len(text) <= width:
        return text
    return textwrap.fill(text, width, subsequent_indent=INDENT, break_long_words=False, break_on_hyphens=False)


def remarks_json(remarks: Iterable["Remark"], paths: Callable[[str], str]) -> str:
    """Every remark whole, as a JSON list of objects (pass, rule, kind, node, reason, message, data, loc)."""
    rows = []
    for r in remarks:
        loc = _relocated(r.loc, paths)
        where = None if loc is None else {"file": loc.file, "line": loc.line, "function": loc.function}
        fields = {"pass": r.pass_name, "rule": r.rule, "kind": r.kind, "node": r.node, "reason": r.reason}
        rows.append({**fields, "message": r.message, "data": dict(r.data), "loc": where})
    return json.dumps(rows, indent=1, ensure_ascii=False) + "\n"


def summary_lines(remarks: Iterable["Remark"]) -> list[str]:
    """``// PASS: N applied, M declined`` per pass, in first-run order (and ``, K analysis`` when there are any)."""
    remarks = list(remarks)
    counts = Counter((r.pass_name, r.kind) for r in remarks)
    lines = []
    for name in dict.fromkeys(r.pass_name for r in remarks):
        line = f"// {name}: {counts[name, 'applied']} applied, {counts[name, 'declined']} declined"
        lines.append(line + (f", {counts[name, 'analysis']} analysis" if counts[name, "analysis"] else ""))
    return lines


__all__ = [
    "MAX_WIDTH", "format_remark", "module_path", "path_style", "relocate", "remarks_json", "short_path",
    "summary_lines", "terminal_width",
]  # fmt: skip
