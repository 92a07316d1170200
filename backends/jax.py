"""JAX runtime facts: primitive counts from the jaxpr, recursing into nested jaxprs."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator

from attnpass.lowering import Program


def _subjaxprs(value: Any) -> Iterator[Any]:
    from jax.extend import core

    if isinstance(value, core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def _walk(jaxpr: Any, counts: Counter) -> None:
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for param in eqn.params.values():
            for sub in _subjaxprs(param):
                _walk(sub, counts)


def jaxpr(program: Program, *args: Any, **kwargs: Any) -> Any:
    """The ClosedJaxpr of ``program`` for these inputs."""
    import jax

    if program.target != "jax":
        raise ValueError(f"jaxpr() needs a JAX program, got target {program.target!r}")
    return jax.make_jaxpr(program.fn)(*program.bind(*args, **kwargs))


def count_primitives(program: Program, *args: Any, **kwargs: Any) -> Counter:
    """Primitive names of the jaxpr, counted recursively through nested jit/custom_jvp/... bodies."""
    counts: Counter = Counter()
    _walk(jaxpr(program, *args, **kwargs).jaxpr, counts)
    return counts
