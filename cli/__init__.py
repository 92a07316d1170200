"""The ``attnpass`` command line: the one layer that imports all the others (ir, passes, lowering, backends, models).

The library APIs it uses live in those layers: graph diffs and rendering in
:mod:`attnpass.ir.core`, the example graphs in :mod:`attnpass.models`.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
