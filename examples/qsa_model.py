"""The QSA decode layer for the examples, tests and benchmark: the library's builder plus pipeline helpers.

The layer itself (``QSAConfig``, ``build_layer``, ``make_inputs``, ...) lives in
:mod:`attnpass.cli.qsa_layer`, so the installed ``attnpass example`` command can
build it too; this module re-exports it and adds :func:`gather_pipeline` and
:func:`narrowed_inputs`. Imported by ``examples/qwen38_qsa_decode.py``, the
tests and the benchmark.
"""

from __future__ import annotations

import numpy as np

from attnpass.cli.qsa_layer import (  # noqa: F401  (re-exported)
    QSAConfig,
    build_layer,
    make_inputs,
    padded_mask,
    rms_norm,
    rope,
)
from attnpass.ir import Graph
from attnpass.passes import DeadCodeElimination, NarrowInputs, PassManager, QSAGather


def gather_pipeline(**gather_options) -> PassManager:
    """QSA gather, then drop the dead masked path, narrow the padded mask to its one read row, clean up."""
    return PassManager([QSAGather(**gather_options), DeadCodeElimination(), NarrowInputs(), DeadCodeElimination()])


def narrowed_inputs(graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``inputs`` cut to ``graph``'s signature: dropped inputs left out, narrowed ones cut to their shape.

    The layer reads the *first* ``S`` rows of the padded mask, so a narrowed input is its leading part.
    """
    out = {}
    for name, expected in zip(graph.inputs, graph.input_types()):
        value = inputs[name]
        out[name] = value[tuple(slice(0, n) for n in expected.shape)]
    return out
