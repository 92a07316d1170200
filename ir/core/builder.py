"""One way to add nodes to a graph: at a source location, named from a hint, skipping no-op layout ops.

:class:`Builder` is shared by every producer of nodes that is not the tracer:
the MLX/JAX importers (:class:`~attnpass.ir.frontends.importing.GraphBuilder`)
and the passes' rewriter (:class:`~attnpass.passes.infra.rewrite.Rewriter`). Layout
helpers return their operand unchanged when the op would be the identity, so
rewrites never add ``reshape`` to the same shape or a full ``slice``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .graph import Graph
from .types import DType, SourceLoc, TensorType


class Builder:
    """Adds nodes to ``graph`` at ``loc``; every method returns the name of the value it produced."""

    def __init__(self, graph: Graph, loc: SourceLoc | None = None) -> None:
        self.graph = graph
        self.loc = loc

    def op(
        self,
        op: str,
        inputs: Sequence[str] | Mapping[str, str | None],
        attrs: Mapping[str, Any] | None = None,
        hint: str | None = None,
    ) -> str:
        """Add ``op(inputs)`` named from ``hint`` (default: the op name); the shape rule types it. ``inputs`` as
        for :meth:`Graph.add_node`: by position, or operand name -> value."""
        inputs = dict(inputs) if isinstance(inputs, Mapping) else list(inputs)
        return self.graph.add_node(op, inputs, dict(attrs or {}), hint=hint or op, loc=self.loc)

    def type(self, x: str) -> TensorType:
        return self.graph.node(x).type

    def scalar(self, value: float | int | bool, dtype: DType, hint: str = "scalar") -> str:
        """A rank-0 constant."""
        return self.op("constant", [], {"value": (value,), "shape": (), "dtype": dtype}, hint)

    def reshape(self, x: str, shape: Sequence[int], hint: str | None = None) -> str:
        shape = tuple(int(d) for d in shape)
        return x if self.type(x).shape == shape else self.op("reshape", [x], {"shape": shape}, hint)

    def transpose(self, x: str, perm: Sequence[int], hint: str | None = None) -> str:
        perm = tuple(int(p) for p in perm)
        return x if perm == tuple(range(len(perm))) else self.op("transpose", [x], {"perm": perm}, hint)

    def cast(self, x: str, dtype: DType, hint: str | None = None) -> str:
        return x if self.type(x).dtype is dtype else self.op("cast", [x], {"dtype": dtype}, hint)

    def broadcast(self, x: str, shape: Sequence[int], hint: str | None = None) -> str:
        shape = tuple(int(d) for d in shape)
        return x if self.type(x).shape == shape else self.op("broadcast_to", [x], {"shape": shape}, hint)

    def concat(self, xs: Sequence[str], axis: int, hint: str | None = None) -> str:
        return xs[0] if len(xs) == 1 else self.op("concat", xs, {"axis": axis}, hint)

    def slice_axis(self, x: str, axis: int, start: int, stop: int, step: int = 1, hint: str | None = None) -> str:
        """``x[..., start:stop:step, ...]`` on ``axis``, every other axis whole."""
        shape = self.type(x).shape
        if (start, stop, step) == (0, shape[axis], 1):
            return x
        starts, stops, steps = [0] * len(shape), list(shape), [1] * len(shape)
        starts[axis], stops[axis], steps[axis] = start, stop, step
        return self.op("slice", [x], {"start": tuple(starts), "stop": tuple(stops), "step": tuple(steps)}, hint)

    def pick(self, x: str, picks: Mapping[int, int], hint: str | None = None) -> str:
        """Index ``i`` of each axis in ``picks``, keeping the axis (size-1 axes are left alone)."""
        shape = self.type(x).shape
        picks = {a: i for a, i in picks.items() if shape[a] > 1}
        if not picks:
            return x
        start = tuple(picks.get(a, 0) for a in range(len(shape)))
        stop = tuple(picks[a] + 1 if a in picks else n for a, n in enumerate(shape))
        return self.op("slice", [x], {"start": start, "stop": stop, "step": (1,) * len(shape)}, hint)


__all__ = ["Builder"]
