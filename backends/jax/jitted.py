"""``attnpass.backends.jax.jit``: ``jax.jit`` with attnpass's pipeline in front, per input signature.

As with ``jax.jit``, arguments are pytrees of arrays (or Python scalars,
traced weakly typed) except those named by ``static_argnums`` /
``static_argnames``, whose hashable values are part of the signature. Arrays
the function closes over are captured at each signature's first call; the
output keeps the function's pytree structure. Of ``jax.jit``'s other options
those that do not name argument positions pass through (:data:`PASSED_THROUGH`).
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable, Hashable, Iterable, Sequence, overload

from attnpass.ir import ImportedGraph, from_jax
from attnpass.ir.frontends.importing import parameter_names
from attnpass.passes import Pass

from ..specialize import (
    MAX_SIGNATURES,
    CompiledFunction,
    Frontend,
    Rebuild,
    Traceable,
    array_text,
    check_callable,
    name_parameters,
    static_spec,
    static_text,
)  # fmt: skip

PASSED_THROUGH = frozenset({"keep_unused", "device", "backend", "inline", "compiler_options"})
_STATIC = ("static_argnums", "static_argnames")


def _as_tuple(value: int | str | Iterable | None) -> tuple:
    if value is None:
        return ()
    return (value,) if isinstance(value, (int, str)) else tuple(value)


def _leaf_spec(x: Any) -> tuple:
    if isinstance(x, (bool, int, float, complex)):
        return (type(x),)  # a Python scalar: traced weakly typed, its value is not in the signature
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return ("invalid", type(x).__qualname__)
    return (tuple(shape), str(dtype), bool(getattr(x, "weak_type", False)))


class JAXFrontend(Frontend):
    """Signatures of JAX calls: pytree structure, leaf shapes and dtypes, static argument values."""

    target = "jax"

    def __init__(
        self, fn: Callable, static_argnums: tuple[int, ...], static_argnames: tuple[str, ...], jit_kwargs: dict
    ) -> None:
        import jax

        self._tree = jax.tree_util
        self._jax = jax
        positional = parameter_names(fn, len(_positional_parameters(fn)))
        by_name = {positional.index(n) for n in static_argnames if n in positional}
        self.static_positions = frozenset(static_argnums) | by_name
        self.static_names = frozenset(static_argnames) | {positional[i] for i in static_argnums if i < len(positional)}
        self.jit_kwargs = jit_kwargs
        self._static_kwargs = {"static_argnums": static_argnums, "static_argnames": static_argnames}

    def device(self) -> str:
        """JAX's default backend: ``"cpu"``, ``"gpu"`` or ``"tpu"``."""
        return self._jax.default_backend()

    def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        dynamic_args = tuple(None if i in self.static_positions else a for i, a in enumerate(args))
        dynamic_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_names}
        statics = tuple((i, static_spec(args[i])) for i in sorted(self.static_positions) if i < len(args))
        statics += tuple((k, static_spec(kwargs[k])) for k in sorted(kwargs) if k in self.static_names)
        return dynamic_args, dynamic_kwargs, statics

    def key(self, args: tuple, kwargs: dict) -> tuple[Hashable, list]:
        dynamic_args, dynamic_kwargs, statics = self._split(args, kwargs)
        leaves, treedef = self._tree.tree_flatten((dynamic_args, dynamic_kwargs))
        return (treedef, tuple(_leaf_spec(x) for x in leaves), statics), leaves

    def traceable(self, fn: Callable, args: tuple, kwargs: dict) -> Traceable:
        tree = self._tree
        dynamic_args, dynamic_kwargs, statics = self._split(args, kwargs)
        paths, treedef = tree.tree_flatten_with_path((dynamic_args, dynamic_kwargs))
        arg_names = parameter_names(fn, len(args))
        names, parts = [], []
        for path, leaf in paths:
            top = path[1].idx if hasattr(path[1], "idx") else path[1].key
            base = arg_names[top] if isinstance(top, int) else str(top)
            names.append(re.sub(r"\W+", "_", base + tree.keystr(path[2:])).strip("_") or "arg")
            shape, dtype = getattr(leaf, "shape", ()), getattr(leaf, "dtype", type(leaf).__name__)
            parts.append(array_text(names[-1], shape, str(dtype)))
        parts += [static_text(arg_names[k] if isinstance(k, int) else k, spec[-1]) for k, spec in statics]
        unhashable = [k for k, spec in statics if spec[0] == "unhashable"]
        unstatic = f"static argument {unhashable[0]} is not hashable" if unhashable else None

        static_args = {i: args[i] for i in self.static_positions if i < len(args)}  # fn holds no argument array
        static_kwargs = {k: v for k, v in kwargs.items() if k in self.static_names}
        rebuild = Rebuild()

        def call(*leaves: Any) -> Any:
            dyn_args, dyn_kwargs = tree.tree_unflatten(treedef, leaves)
            full_args = [static_args[i] if i in static_args else a for i, a in enumerate(dyn_args)]
            out = fn(*full_args, **{**static_kwargs, **dyn_kwargs})
            out_leaves, out_tree = tree.tree_flatten(out)
            single = len(out_leaves) == 1
            rebuild.structure = lambda o: tree.tree_unflatten(out_tree, [o] if single else list(o))
            return out

        name_parameters(call, names, fn)
        return Traceable(", ".join(parts), call, [leaf for _path, leaf in paths], unstatic, rebuild)

    def import_graph(self, t: Traceable) -> ImportedGraph:
        return from_jax(t.fn, *t.arrays)

    def compile(self, fn: Callable) -> Callable:
        return self._jax.jit(fn, **self.jit_kwargs)

    def fallback(self, fn: Callable) -> Callable:
        return self._jax.jit(fn, **self._static_kwargs, **self.jit_kwargs)


def _positional_parameters(fn: Callable) -> list[inspect.Parameter]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


@overload
def jit(
    fn: Callable,
    *,
    pipeline: str | Sequence[Pass] | None = None,
    strict: bool = False,
    max_signatures: int = ...,
    numerics: str = ...,
    **jit_kwargs: Any,
) -> CompiledFunction: ...


@overload
def jit(
    fn: None = None,
    *,
    pipeline: str | Sequence[Pass] | None = None,
    strict: bool = False,
    max_signatures: int = ...,
    numerics: str = ...,
    **jit_kwargs: Any,
) -> Callable[[Callable], CompiledFunction]: ...


def jit(
    fn: Callable | None = None,
    *,
    pipeline: str | Sequence[Pass] | None = None,
    strict: bool = False,
    max_signatures: int = MAX_SIGNATURES,
    numerics: str = "pipeline",
    **jit_kwargs: Any,
) -> CompiledFunction | Callable[[Callable], CompiledFunction]:
    """``fn`` compiled per input signature: imported, rewritten by ``pipeline``, lowered to JAX, ``jax.jit``'d.

    ``static_argnums`` / ``static_argnames`` work as in ``jax.jit``; the options in
    :data:`PASSED_THROUGH` go to ``jax.jit``; options tied to argument positions
    (``donate_argnums``, ``in_shardings``, ...) are refused. ``pipeline``, ``strict``
    and the fallback (``jax.jit(fn, **jit_kwargs)``) are as for :func:`attnpass.backends.mlx.compile`.
    ``numerics="pipeline"`` computes what the pipeline makes of the function (raised attention: not bit for
    bit ``jax.jit``'s, docs/numerics.md); ``numerics="source"`` runs only canonicalize and dce, so every bit
    is ``jax.jit(fn)``'s. Without ``fn`` (``@jit(static_argnames="causal")``) it returns the decorator with these options.
    """
    name = "attnpass.backends.jax.jit"
    unknown = sorted(set(jit_kwargs) - PASSED_THROUGH - set(_STATIC))
    if unknown:
        raise ValueError(
            f"{name}: unsupported jax.jit option(s) {', '.join(unknown)}; "
            f"supported: {', '.join(sorted(PASSED_THROUGH | set(_STATIC)))}"
        )
    if fn is None:
        return functools.partial(
            jit, pipeline=pipeline, strict=strict, max_signatures=max_signatures, numerics=numerics, **jit_kwargs
        )
    check_callable(fn, name)
    static_argnums = tuple(int(i) for i in _as_tuple(jit_kwargs.pop("static_argnums", None)))
    static_argnames = tuple(str(n) for n in _as_tuple(jit_kwargs.pop("static_argnames", None)))
    frontend = JAXFrontend(fn, static_argnums, static_argnames, jit_kwargs)
    return CompiledFunction(
        fn, frontend, pipeline=pipeline, strict=strict, max_signatures=max_signatures, name=name, numerics=numerics
    )


__all__ = ["JAXFrontend", "PASSED_THROUGH", "jit"]
