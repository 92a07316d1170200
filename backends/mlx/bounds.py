"""When a routed call is worth its program: the fewest key rows routed, per device, program kind and precision.

``DEVICES[device].min_keys`` (:mod:`attnpass.passes.analysis.devices`) maps ``(kind, dtype)`` (``kind`` is ``"float"``
for the attention programs, ``"quantized"`` for the one over a quantized cache; ``dtype`` the precision the rewritten
graph computes in) to the fewest key rows of the program's cut that are routed; ``None`` routes none
(``quantized_tie``). Only the CPU row has bounds (:data:`MIN_KEYS`; the measurements behind each number are in
docs/benchmarks.md, "Short contexts" and "Quantized caches on CPU"); the other devices' are empty.
``optimize(min_keys=)`` replaces the table (0 routes every depth). A signature's decision is taken once, on its
rewritten graph (:func:`too_short`), and recorded in a :data:`Bounds` so that later calls of the same kind and dtype
whose cut is shorter are declined before their arguments are built (:func:`known_short`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from attnpass.ir import DType, Graph
from attnpass.passes import Decline, PassResult
from attnpass.passes.analysis.devices import DEVICES

MIN_KEYS = DEVICES["cpu"].min_keys  # the CPU row's bounds, the only device with any
Bounds = dict[tuple[str, str], tuple["int | None", DType]]  # (kind, queries' dtype) -> (bound, precision)


def precision(graph: Graph) -> DType:
    """The dtype a rewritten attention graph computes in: its ``quantized_sdpa``'s (float32 when the pipeline
    widened it), else its queries' (the first input)."""
    for node in graph.nodes():
        if node.op == "quantized_sdpa":
            widened = node.type.dtype is DType.float32 or node.attrs["precision"] != "dtype"
            return DType.float32 if widened else node.type.dtype
    return graph.node(graph.inputs[0]).type.dtype


def bound_decline(kind: str, dtype: DType, least: int | None, rows: int) -> Decline | None:
    """The decline of a ``kind`` call computing in ``dtype`` over ``rows`` key rows when the bound is ``least``."""
    if least is None:
        return Decline(
            "quantized_tie",
            f"a {dtype.value} quantized_sdpa on CPU: the GQA-folded program only ties mlx-lm's helper at every "
            "depth measured (docs/benchmarks.md), so the helper runs it (optimize's min_keys, or a pipeline "
            "computing it in float32, routes it)",
            data={"dtype": dtype.value},
        )
    if rows < least:
        return Decline(
            "short_context",
            f"{rows} key rows, fewer than the {least} routed for {'' if kind == 'float' else kind + ' '}"
            f"{dtype.value} calls: at a short context "
            "the program's fixed cost and its cut's padding rows cost more than mlx-lm's helper over the valid keys",
            data={"rows": rows, "min_keys": least, "dtype": dtype.value},
        )
    return None


def too_short(
    kind: str, min_keys: int | None, table: Mapping[tuple[str, DType], int | None], bounds: Bounds
) -> Callable[[PassResult], Decline | None]:
    """The decline hook of a ``kind`` program: a signature whose keys (the second input: the cut's rows, or a
    quantized cache's words) are fewer rows than ``min_keys`` (None: what ``table`` gives its precision) is
    declined. Each decision records the bound in ``bounds`` by (kind, the queries' dtype), which decides the
    precision in a pipeline."""

    def decline(result: PassResult) -> Decline | None:
        graph = result.graph
        dtype = precision(graph)
        least = table.get((kind, dtype), 0) if min_keys is None else min_keys
        bounds[kind, graph.node(graph.inputs[0]).type.dtype.value] = (least, dtype)
        return bound_decline(kind, dtype, least, graph.node(graph.inputs[1]).type.shape[2])

    return decline


def known_short(bounds: Bounds, kind: str, dtype: str, rows: int) -> Decline | None:
    """The decline of a ``kind`` call with ``dtype`` queries over at most ``rows`` key rows, when a signature of
    its kind and dtype has found its bound (:func:`too_short`) and the call is under it; None otherwise."""
    found = bounds.get((kind, dtype))
    return None if found is None else bound_decline(kind, found[1], found[0], rows)


__all__ = ["MIN_KEYS", "Bounds", "bound_decline", "known_short", "precision", "too_short"]
