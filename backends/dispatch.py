"""Run programs, read back arrays, count the backend's own primitives: each through the program's Target."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Mapping

import numpy as np

from attnpass.ir import Graph, ImportedGraph
from attnpass.ir.core.arguments import argument_error
from attnpass.lowering import Program, available_targets


def target_function(program: Program, field: str, what: str) -> Callable[..., Any]:
    """``program.target``'s function ``field``; ValueError naming the targets that have one."""
    function = getattr(program.target, field)
    if function is None:
        having = ", ".join(t.name for t in available_targets() if getattr(t, field) is not None)
        raise ValueError(f"no {what} for target {program.target.name!r}; targets with one: {having}")
    return function


def count_primitives(program: Program, *args: Any, **kwargs: Any) -> Counter:
    """A Counter of the backend's own primitive names for ``program`` on these inputs.

    MLX: from ``mx.export_function``'s callback. JAX: from ``jax.make_jaxpr``,
    counted recursively through nested jaxprs.
    """
    return target_function(program, "count_primitives", "primitive view")(program, *args, **kwargs)


def assert_primitive_counts(
    program: Program, expected: Mapping[str, int], *args: Any, exact: bool = False, **kwargs: Any
) -> Counter:
    """Check the counts of the primitives named in ``expected`` (all primitives if ``exact``).

    Raises AssertionError with a readable table of the differences; returns the counts.
    """
    actual = count_primitives(program, *args, **kwargs)
    names = sorted(set(expected) | (set(actual) if exact else set()))
    diff = [(n, expected.get(n, 0), actual.get(n, 0)) for n in names if expected.get(n, 0) != actual.get(n, 0)]
    if diff:
        width = max(len(n) for n, _, _ in diff + [("primitive", 0, 0)])
        rows = [f"  {'primitive':<{width}}  expected  actual"]
        rows += [f"  {n:<{width}}  {e:>8}  {a:>6}" for n, e, a in diff]
        rows.append(f"  all counts: {dict(sorted(actual.items()))}")
        raise AssertionError(
            f"primitive counts of {program.graph.name} on {program.target.name} differ:\n" + "\n".join(rows)
        )
    return actual


def to_numpy(x: Any) -> np.ndarray:
    """A backend array (of any registered target) as a numpy array, bf16 bit for bit."""
    module = type(x).__module__.partition(".")[0]
    owner = next((t for t in available_targets() if t.array_module == module), None)
    return owner.to_numpy(x) if owner is not None else np.asarray(x)


def run(program: Program, *args: Any, **kwargs: Any) -> Any:
    """Call ``program`` and return numpy arrays (a tuple when the graph has several outputs).

    ``program`` comes from :func:`attnpass.lowering.lower` (of a Graph or an ImportedGraph, whose params
    it then holds); anything else is an ArgumentError saying so.
    """
    if not isinstance(program, Program):
        hint = "lower it first: run(lower(graph, target), *args)" if isinstance(program, (Graph, ImportedGraph)) else ""
        raise argument_error("run", "program", program, "a Program (from lower(graph, target))", hint)
    out = program(*args, **kwargs)
    return tuple(to_numpy(o) for o in out) if isinstance(out, tuple) else to_numpy(out)


__all__ = ["assert_primitive_counts", "count_primitives", "run", "target_function", "to_numpy"]
