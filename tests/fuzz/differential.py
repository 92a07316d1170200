"""The differential check: a pipeline's output graph must compute what its input graph computes.

Both graphs run on the numpy reference (float64 arithmetic, rounded per
node) with the same inputs. A pass that drops an input (dce) is fed the
rest by name; a pass that narrows an input (narrow-inputs) is fed the slice
its readers took, found by :class:`InputViews` around every pass. Outputs
must match within :data:`TOLERANCE` relative to their magnitude (the
rewrites differ from their source in rounding only: reduction order, and a
decomposed half-precision attention rounds every intermediate where sdpa
rounds once); non-finite values must match exactly, so a NaN that appears or
disappears is a failure.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from attnpass.backends import run
from attnpass.ir import DType, Graph
from attnpass.lowering import lower
from attnpass.passes import Instrumentation, Pass, PassError, PassManager, format_pipeline

from .families import Case

TOLERANCE = {DType.float32: 1e-5, DType.float16: 1e-2, DType.bfloat16: 6e-2}  # 7x-100x the worst seen in 2,400 cases


@dataclass(frozen=True)
class Failure:
    """What went wrong (``kind``: crash, mismatch, inputs, reference) and the details."""

    kind: str
    message: str


class InputViews(Instrumentation):
    """For every input of the rewritten graph, the index expressions that turn the original array into it."""

    def __init__(self, graph: Graph) -> None:
        self.views: dict[str, tuple[tuple[slice, ...], ...]] = {name: () for name in graph.inputs}
        self.unmapped: list[str] = []
        self._slices: dict[str, list] = {}

    def before_pass(self, pass_: Pass, graph: Graph) -> None:
        self._slices = {
            name: [(n.type, n.attrs) for n in graph.users(name) if n.op == "slice"] + [(graph.node(name).type, None)]
            for name in graph.inputs
        }

    def after_pass(self, pass_: Pass, graph: Graph, changed: bool, seconds: float) -> None:
        for name in graph.inputs:
            before = self._slices.get(name)
            if before is None:
                self.unmapped.append(f"{pass_.name} added input {name}")
                continue
            found = [attrs for t, attrs in before if t == graph.node(name).type]
            if not found:
                self.unmapped.append(
                    f"{pass_.name} retyped input {name} to {graph.node(name).type}, not through a slice"
                )
            elif found[0] is not None:
                bounds = zip(found[0]["start"], found[0]["stop"], found[0]["step"])
                self.views[name] += (tuple(slice(*b) for b in bounds),)

    def arrays(self, original: dict[str, np.ndarray], graph: Graph) -> dict[str, np.ndarray]:
        out = {}
        for name in graph.inputs:
            array = original[name]
            for index in self.views[name]:
                array = array[index]
            out[name] = array
        return out


def _outputs(graph: Graph, arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    out = run(lower(graph, "numpy", comments=False), **arrays)
    return list(out) if isinstance(out, tuple) else [out]


def compare(actual: np.ndarray, expected: np.ndarray) -> str | None:
    """None when ``actual`` matches ``expected`` (see the module docstring), else why not."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"output {actual.dtype}{list(actual.shape)} != expected {expected.dtype}{list(expected.shape)}"
    if actual.dtype.kind in "biu":
        bad = np.flatnonzero(actual != expected)
        return f"{bad.size} elements differ (first at flat index {bad[0]})" if bad.size else None
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    finite = np.isfinite(e)
    nonfinite = ~finite | ~np.isfinite(a)
    same = (np.isnan(a) & np.isnan(e)) | (a == e)
    if (nonfinite & ~same).any():
        i = int(np.flatnonzero(nonfinite & ~same)[0])
        return f"non-finite values differ: at flat index {i} got {a.flat[i]!r}, expected {e.flat[i]!r}"
    if not finite.any():
        return None
    tol = TOLERANCE[DType.from_numpy(expected.dtype)]
    err = np.abs(a - e)[finite]
    bound = tol * (np.abs(e[finite]) + np.max(np.abs(e[finite])))
    if (err > bound).any():
        worst = int(np.argmax(err / np.maximum(bound, 1e-300)))
        return (
            f"{int((err > bound).sum())} of {err.size} elements beyond tolerance {tol}: "
            f"got {a[finite][worst]!r}, expected {e[finite][worst]!r}"
        )
    return None


def check(
    case: Case, pipeline: list[Pass], *, fixed_point: bool = False, applied: Counter | None = None
) -> Failure | None:
    """Run ``pipeline`` on the case's graph and compare both graphs on the numpy reference.

    ``applied`` counts the passes' applied remarks (how much rewriting the case exercised).
    """
    try:
        expected = _outputs(case.graph, case.arrays)
    except Exception as exc:  # noqa: BLE001  the generator made inputs outside a contract: a fuzzer bug
        return Failure("reference", f"the original graph does not run: {type(exc).__name__}: {exc}")
    views = InputViews(case.graph)
    manager = PassManager(pipeline, fixed_point=fixed_point, max_iterations=3, instrumentations=[views])
    try:
        result = manager.run(case.graph)
    except PassError as exc:
        return Failure("crash", str(exc))
    rewritten = result.graph
    if applied is not None:
        applied.update(r.pass_name for r in result.applied())
    if views.unmapped:
        return Failure("inputs", "; ".join(views.unmapped))
    try:
        actual = _outputs(rewritten, views.arrays(case.arrays, rewritten))
    except Exception as exc:  # noqa: BLE001  a rewritten graph that does not lower or run is a finding
        return Failure("crash", f"the rewritten graph does not run: {type(exc).__name__}: {exc}\n{rewritten}")
    if len(actual) != len(expected):
        return Failure("mismatch", f"{len(actual)} outputs, expected {len(expected)}")
    for i, (a, e) in enumerate(zip(actual, expected)):
        why = compare(a, e)
        if why:
            return Failure("mismatch", f"output {i} ({case.graph.outputs[i]}): {why}\nrewritten graph:\n{rewritten}")
    return None


def describe(case: Case, pipeline: list[Pass], fixed_point: bool) -> str:
    """The reproducer: graph text, pipeline text, and the input arrays."""
    manager = " (PassManager fixed_point=True, max_iterations=3)" if fixed_point else ""
    lines = [f"graph ({case.family}):", str(case.graph), f"pipeline: {format_pipeline(pipeline)!r}{manager}", "inputs:"]
    for name, array in case.arrays.items():
        dtype = DType.from_numpy(array.dtype)
        values = array.tolist() if array.size <= 256 else f"<{array.size} values>"
        lines.append(f"  {name}: {dtype.value}{list(array.shape)} = {values}")
    return "\n".join(lines)
