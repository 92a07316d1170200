"""Per-target runtime facts: run programs, read back arrays, count the backend's own primitives."""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any, Mapping

import numpy as np

from attnpass.lowering import Program

_MODULES = {"mlx": "attnpass.backends.mlx", "jax": "attnpass.backends.jax"}


def _backend(program: Program):
    if program.target not in _MODULES:
        raise ValueError(f"no primitive view for target {program.target!r}; targets with one: {', '.join(_MODULES)}")
    return importlib.import_module(_MODULES[program.target])


def count_primitives(program: Program, *args: Any, **kwargs: Any) -> Counter:
    """A Counter of the backend's own primitive names for ``program`` on these inputs.

    MLX: from ``mx.export_function``'s callback. JAX: from ``jax.make_jaxpr``,
    counted recursively through nested jaxprs.
    """
    return _backend(program).count_primitives(program, *args, **kwargs)


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
        raise AssertionError(f"primitive counts of {program.graph.name} on {program.target} differ:\n" + "\n".join(rows))
    return actual


def to_numpy(x: Any) -> np.ndarray:
    """A backend array (MLX, JAX or numpy) as a numpy array, bf16 bit for bit."""
    if type(x).__module__.startswith("mlx"):
        from .mlx import to_numpy as mlx_to_numpy

        return mlx_to_numpy(x)
    return np.asarray(x)


def run(program: Program, *args: Any, **kwargs: Any) -> Any:
    """Call ``program`` and return numpy arrays (a tuple when the graph has several outputs)."""
    out = program(*args, **kwargs)
    return tuple(to_numpy(o) for o in out) if isinstance(out, tuple) else to_numpy(out)


__all__ = ["assert_primitive_counts", "count_primitives", "run", "to_numpy"]
