"""The ``attnpass`` command line, graph diffs and rendering, and the example graphs it ships.

This is the one layer that imports all the others (ir, passes, lowering,
backends). For use from Python: :func:`diff_graphs` (before/after summary and
unified diff) and :func:`render` (Graphviz SVG/PNG/DOT with rewritten nodes
highlighted); the example builders live in :mod:`attnpass.cli.qwen38` and
:mod:`attnpass.cli.qsa_layer`.
"""

from .diff import GraphDiff, diff_graphs
from .rendering import render, to_dot

__all__ = ["GraphDiff", "diff_graphs", "render", "to_dot"]
