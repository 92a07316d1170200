"""Crash reproducers: when a pass fails, save the graph it received and the pass, ready to replay.

Like MLIR's local crash reproducer: the file holds the failing pass as a
one-pass textual pipeline with every option spelled out, the graph that pass
was handed (not the pipeline's input), the passes that ran before it and the
error. It is named ``attnpass-crash-<8 hex>.json`` after a hash of graph and
pipeline, so the same crash always maps to the same file. Replay it with
``attnpass run --reproducer FILE`` or, in Python::

    rep = load_reproducer(path)
    PassManager(rep.passes).run(rep.graph)   # raises the same PassError
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from attnpass.ir import Graph, GraphFormatError

from .base import Pass
from .pipeline import format_pipeline, parse_pipeline
from .registry import PipelineError, get_pass

FORMAT = "attnpass.reproducer"
VERSION = 1
REPLAY = "attnpass run --reproducer {path}"


@dataclass(frozen=True)
class Reproducer:
    """A failing pass (as pipeline text), the graph it received, what ran before it, and the error."""

    pipeline: str
    graph: Graph
    after: tuple[str, ...]
    error: str

    @property
    def passes(self) -> list[Pass]:
        return parse_pipeline(self.pipeline)

    def to_json(self) -> str:
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "pipeline": self.pipeline,
            "after": list(self.after),
            "error": self.error,
            "graph": json.loads(self.graph.to_json()),
        }
        return json.dumps(doc, indent=1)


def write_reproducer(directory: str | os.PathLike, pass_: Pass, graph: Graph, after: list[str], error: str) -> Path:
    """Write the reproducer of ``pass_`` failing on ``graph`` into ``directory``; returns its path."""
    rep = Reproducer(format_pipeline([pass_], include_defaults=True), graph, tuple(after), error)
    key = hashlib.sha256(f"{graph.fingerprint()}|{rep.pipeline}".encode()).hexdigest()[:8]
    path = Path(directory) / f"attnpass-crash-{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rep.to_json())
    return path


def crash_note(directory: str | os.PathLike, pass_: Pass, graph: Graph, after: list[str], error: str) -> str:
    """Write a reproducer and say where and how to replay it (or why none was written)."""
    try:
        path = write_reproducer(directory, pass_, graph, after, error)
    except (OSError, PipelineError) as exc:
        return f"no crash reproducer written: {exc}"
    note = f"crash reproducer: {path}\nreplay with: {REPLAY.format(path=path)}"
    try:
        registered = get_pass(pass_.name) is type(pass_)
    except PipelineError:
        registered = False
    if not registered:
        note += f"\n(pass {pass_.name!r} is not registered: register it with @register_pass to replay)"
    return note


def load_reproducer(path: str | os.PathLike) -> Reproducer:
    """Read a reproducer file; raises GraphFormatError when it is not one."""
    try:
        doc = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GraphFormatError(f"{path}: malformed JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise GraphFormatError(f"{path}: not an attnpass crash reproducer (format {FORMAT!r}, version {VERSION})")
    pipeline, after, error = doc.get("pipeline"), doc.get("after"), doc.get("error")
    if not isinstance(pipeline, str) or not isinstance(error, str) or not isinstance(after, list):
        raise GraphFormatError(f"{path}: reproducer fields pipeline, after and error are missing or malformed")
    return Reproducer(pipeline, Graph.from_json(json.dumps(doc.get("graph"))), tuple(map(str, after)), error)


__all__ = ["REPLAY", "Reproducer", "crash_note", "load_reproducer", "write_reproducer"]
