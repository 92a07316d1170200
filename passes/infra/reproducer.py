"""Crash reproducers: when a pass fails, save the graph it received and the pass, ready to replay.

Like MLIR's local crash reproducer: the file holds the failing pass as a
one-pass textual pipeline with every option spelled out, the graph that pass
was handed (not the pipeline's input), the passes that ran before it and the
error. It is named ``attnpass-crash-<8 hex>.json`` after a hash of graph and
pipeline, so the same crash always maps to the same file. A crash under the
``attnpass`` command also records the modules it imported with ``--load``
(the CLI hands them to ``PassManager(plugin_loads=...)``; none are recorded
for attnpass's own passes), and the printed replay command
loads them again: ``attnpass --load plugin.py run --reproducer FILE``. Without
``plugin_loads`` (a pass defined in a script that runs the PassManager itself)
the reproducer records the module that defines the pass: its ``.py`` file for a
script or a top-level module, its name for a module of a package. Loading
a reproducer never imports them itself. Replay it with
``attnpass run --reproducer FILE`` or, in Python::

    rep = load_reproducer(path)
    PassManager(rep.passes).run(rep.graph)   # raises the same PassError
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from attnpass.ir import Graph, GraphFormatError
from attnpass.ir.core.serialize import MAX_JSON_BYTES, check_envelope, graph_from_doc, read_json

from .base import Pass
from .pipeline_text import format_pipeline, parse_pipeline
from .registry import PipelineError, get_pass

FORMAT = "attnpass.reproducer"
VERSION = 1
REPLAY = "attnpass run --reproducer {path}"


def replay_command(path: str | os.PathLike, load: Sequence[str] = ()) -> str:
    """The shell command that replays the reproducer at ``path`` (``--load`` first, every word quoted)."""
    loads = "".join(f"--load {shlex.quote(spec)} " for spec in load)
    return f"attnpass {loads}run --reproducer {shlex.quote(os.fspath(path))}"


def needed_loads(pass_: Pass, loads: Sequence[str]) -> tuple[str, ...]:
    """The ``--load`` specs a replay of ``pass_`` needs: none for attnpass's own passes, else ``loads``, else
    the module that defines it (:func:`defining_load`)."""
    module = type(pass_).__module__
    if module == "attnpass" or module.startswith("attnpass."):
        return ()
    return tuple(loads) or defining_load(type(pass_))


def defining_load(cls: type) -> tuple[str, ...]:
    """The ``--load`` spec of the module defining ``cls``: a package module by name, a script (``__main__``)
    or top-level module by its absolute ``.py`` path; none when it has no source file (a notebook cell)."""
    if "." in cls.__module__:
        return (cls.__module__,)
    try:
        source = inspect.getsourcefile(cls)
    except TypeError:
        return ()
    return (str(Path(source).resolve()),) if source and source.endswith(".py") else ()


@dataclass(frozen=True)
class Reproducer:
    """A failing pass (as pipeline text), the graph it received, what ran before it, the error,
    and the ``--load`` modules (names or ``.py`` paths) that define the pass."""

    pipeline: str
    graph: Graph
    after: tuple[str, ...]
    error: str
    load: tuple[str, ...] = ()

    @property
    def passes(self) -> list[Pass]:
        try:
            return parse_pipeline(self.pipeline)
        except PipelineError as exc:
            if not self.load:
                raise
            loads = " ".join(f"--load {shlex.quote(spec)}" for spec in self.load)
            hint = f"this reproducer needs {loads} (attnpass {loads} run --reproducer FILE)"
            raise PipelineError(f"{exc}; {hint}") from None

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "pipeline": self.pipeline,
            "after": list(self.after),
            "error": self.error,
            "load": list(self.load),
            "graph": json.loads(self.graph.to_json()),
        }
        return json.dumps(doc, indent=1)


def write_reproducer(
    directory: str | os.PathLike, pass_: Pass, graph: Graph, after: list[str], error: str, loads: Sequence[str] = ()
) -> Path:
    """Write the reproducer of ``pass_`` failing on ``graph`` into ``directory``; returns its path.

    ``loads``: the ``--load`` specs (module names or absolute ``.py`` paths) that define plugin passes; the
    reproducer records them when ``pass_`` is not one of attnpass's own."""
    load = needed_loads(pass_, loads)
    rep = Reproducer(format_pipeline([pass_], include_defaults=True), graph, tuple(after), error, load)
    key = hashlib.sha256(f"{graph.fingerprint()}|{rep.pipeline}".encode()).hexdigest()[:8]
    path = Path(directory) / f"attnpass-crash-{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rep.to_json())
    return path


def crash_note(
    directory: str | os.PathLike, pass_: Pass, graph: Graph, after: list[str], error: str, loads: Sequence[str] = ()
) -> str:
    """Write a reproducer and say where and how to replay it (or why none was written); ``loads``: as
    :func:`write_reproducer`."""
    try:
        path = write_reproducer(directory, pass_, graph, after, error, loads)
    except (OSError, PipelineError) as exc:
        return f"no crash reproducer written: {exc}"
    note = f"crash reproducer: {path}\nreplay with: {replay_command(path, needed_loads(pass_, loads))}"
    try:
        registered = get_pass(pass_.name) is type(pass_)
    except PipelineError:
        registered = False
    if not registered:
        note += f"\n(pass {pass_.name!r} is not registered: register it with @register_pass to replay)"
    return note


def _strings(doc: dict, key: str, where: str, default: Any = ...) -> list[str]:
    value = doc.get(key, default)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise GraphFormatError(f"{where}: reproducer field {key!r} must be a list of strings")
    return value


def load_reproducer(path: str | os.PathLike) -> Reproducer:
    """Read a reproducer file; raises GraphFormatError when it is not one (OSError when it cannot be read).

    Nothing in the file is executed or imported: its ``load`` list is only reported.
    """
    with open(path, "rb") as f:
        text = f.read(MAX_JSON_BYTES + 1)
    doc = check_envelope(read_json(text, os.fspath(path)), FORMAT, VERSION, f"crash reproducer ({path})")
    pipeline, error = doc.get("pipeline"), doc.get("error")
    if not isinstance(pipeline, str) or not isinstance(error, str) or not isinstance(doc.get("after"), list):
        raise GraphFormatError(f"{path}: reproducer fields pipeline, after and error are missing or malformed")
    after, load = _strings(doc, "after", os.fspath(path)), _strings(doc, "load", os.fspath(path), [])
    try:
        graph = graph_from_doc(doc.get("graph"))
    except GraphFormatError as exc:
        raise GraphFormatError(f"{path}: graph: {exc}") from None
    return Reproducer(pipeline, graph, tuple(after), error, tuple(load))


__all__ = [
    "REPLAY", "Reproducer", "crash_note", "load_reproducer", "needed_loads", "replay_command",
    "write_reproducer",
]  # fmt: skip
