"""The JAX target: its emitters and runtime, and the JAX facts the backends use.

Primitive counts come from the jaxpr, recursing into nested jaxprs;
placeholders are ``jax.ShapeDtypeStruct``; the export is StableHLO text. A
program is ``jax.jit``-ed (``lower(..., jit=False)``: eager), a graph's state
inputs donated (``donate_argnums``), so XLA updates those buffers in place.
``jax`` is imported only when one of these functions runs.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from attnpass.ir import TensorType
from attnpass.lowering.target import Export, Target

from .emitters import EMITTERS
from .sharding import SPMD

if TYPE_CHECKING:
    from attnpass.lowering.program import Program


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

    program.require_target(JAX, "jaxpr()")
    return jax.make_jaxpr(program.fn)(*program.bind(*args, **kwargs))


def count_primitives(program: Program, *args: Any, **kwargs: Any) -> Counter:
    """Primitive names of the jaxpr, counted recursively through nested jit/custom_jvp/... bodies."""
    counts: Counter = Counter()
    _walk(jaxpr(program, *args, **kwargs).jaxpr, counts)
    return counts


def from_numpy(a: np.ndarray) -> Any:
    import jax.numpy as jnp

    return jnp.asarray(a)


def placeholders(types: Sequence[TensorType]) -> list[Any]:
    """``jax.ShapeDtypeStruct`` of these types: nothing is allocated."""
    import jax

    return [jax.ShapeDtypeStruct(t.shape, t.dtype.numpy) for t in types]


def export_stablehlo(program: Program, *args: Any, **kwargs: Any) -> str:
    """The StableHLO text (MLIR) of ``jax.jit(program.fn)`` lowered for these arguments.

    Positional or by input name, only their types matter; without any, zero placeholders.
    A sharded program (lowered with a mesh) keeps its shardings (``sdy.sharding``);
    on an abstract mesh it is lowered for the default backend.
    """
    import jax
    from jax.sharding import AbstractMesh

    program.require_target(JAX, "export_stablehlo")
    bound = program.bind(*args, **kwargs) if args or kwargs else placeholders(program.input_types)
    if program.mesh is None:
        return jax.jit(program.fn).lower(*bound).as_text()
    platforms = (jax.default_backend(),) if isinstance(program.mesh, AbstractMesh) else None
    return program.fn.trace(*bound).lower(lowering_platforms=platforms).as_text()


def jit_line(fn: str, state: tuple[int, ...]) -> str:
    """The line rebinding the generated function ``fn`` to its ``jax.jit``, the ``state`` arguments donated."""
    if not state:
        return f"{fn} = jax.jit({fn})"
    return f"{fn} = jax.jit({fn}, donate_argnums={state!r})  # state updated in place"


JAX = Target(
    name="jax",
    distribution="jax",
    prelude=("import jax", "import jax.numpy as jnp"),
    aliases=frozenset({"jax", "jnp"}),
    emitters=EMITTERS,
    array_module="jaxlib",
    from_numpy=from_numpy,
    runtime={
        "jrt": "attnpass.lowering.targets.jax.runtime",
        "qsa": "attnpass.lowering.targets.jax.runtime.qsa",
        "qsa_checked": "attnpass.lowering.targets.jax.runtime.qsa_checked",
        "lse": "attnpass.lowering.targets.jax.runtime.sdpa_lse",
        "attn": "attnpass.lowering.targets.jax.runtime.sinks_sdpa",
        "visible": "attnpass.ir.dialects.attention.visible",
    },
    count_primitives=count_primitives,
    placeholders=placeholders,
    export=Export("stablehlo", export_stablehlo),
    jit=jit_line,
    spmd=SPMD,
)
