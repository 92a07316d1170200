"""What ``from_mlx`` and ``from_jax`` accept as the function and its example arguments.

``fn`` must be callable (``from_mlx(q, fn)`` is refused naming ``fn``, and says the arguments look swapped).
A Python ``bool``, ``int`` or ``float`` argument follows the backend's own compiler:

- ``from_mlx``: static, as ``mx.compile`` (and ``attnpass.backends.mlx.compile``) treats it: its value is
  part of the graph (a constant), the graph has no input for it, and the lowered program is called without
  it. Every other argument must be an ``mx.array``;
- ``from_jax``: traced, as ``jax.jit`` traces it: a scalar input (``i32[]``, ``f32[]``, ``bool[]``). Bind it
  with ``functools.partial`` to make it static. Arguments are arrays, ``jax.ShapeDtypeStruct`` or pytrees of
  them.

Anything else is an :class:`~attnpass.ir.core.arguments.ArgumentError` naming the argument, what it got and
what is valid, before the backend's own tracer sees it; so are example arguments ``fn``'s signature cannot take
(too few, too many) and keywords other than the importer's own (example arguments are positional). An error
``fn`` itself raises while it is traced is a :class:`~attnpass.ir.frontends.importing.ModelImportError` naming
``fn``, the example arguments' types and the backend's message (:func:`traced_error`).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np

from attnpass.ir.core.arguments import ArgumentError, argument_error, describe
from attnpass.ir.core.types import SourceLoc, printable

from .importing import ModelImportError, parameter_names

STATIC = (bool, int, float)
OPTIONS = ("name", "inline_limit")  # the keywords from_mlx and from_jax take themselves


def require_callable(where: str, fn: Any, example_args: tuple) -> None:
    """An ArgumentError unless ``fn`` is callable; when an example argument is, the arguments look swapped."""
    if callable(fn):
        return
    swapped = any(callable(a) for a in example_args)
    hint = "the arguments look swapped" if swapped else "the function comes first"
    raise argument_error(where, "fn", fn, "the function to import (a callable)", f"{hint}: {where}(fn, *example_args)")


def _parameters(fn: Callable) -> tuple[inspect.Signature | None, str]:
    """``fn``'s signature (None when it has none, a builtin) and its parameters as text, without annotations:
    ``(q, k, v, *, mask=None)``."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, "(...)"
    bare = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return signature, str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def require_call(where: str, fn: Callable, example_args: tuple, keywords: dict[str, Any]) -> None:
    """An ArgumentError for ``keywords`` (anything but the importer's :data:`OPTIONS`: example arguments are
    positional) and for example arguments ``fn`` cannot be called with, naming ``fn``'s parameters."""
    signature, parameters = _parameters(fn)
    name = _name(fn)
    required = [] if signature is None else [p.name for p in signature.parameters.values() if _keyword_only(p)]
    hint = f" (bind keyword-only {', '.join(required)} with functools.partial)" if required else ""
    if keywords:
        given = ", ".join(f"{k}={describe(v)}" for k, v in keywords.items())
        raise ArgumentError(
            f"{where}: its keywords are {' and '.join(OPTIONS)}, got {given}; example arguments are positional, in "
            f"the order of {name}{parameters}: {where}(fn, *example_args){hint}"
        )
    if signature is None:
        return
    try:
        signature.bind(*example_args)
    except TypeError as exc:
        raise ArgumentError(
            f"{where}: example_args must be what {name}{parameters} takes, got {len(example_args)} argument(s): "
            f"{exc}; {where}(fn, *example_args) traces fn(*example_args){hint}"
        ) from None


def _keyword_only(parameter: inspect.Parameter) -> bool:
    """A keyword-only parameter without a default: one the importer cannot fill."""
    return parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is inspect.Parameter.empty


def _name(fn: Callable) -> str:
    """How a message names ``fn``: its qualified name (``attend``), else its type's name (a module: ``Model``)."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def traced_error(
    where: str, fn: Callable, example_args: tuple, exc: Exception, at: SourceLoc | None
) -> ModelImportError:
    """``fn`` raised ``exc`` while ``where`` traced it (its own mistake, such as a matmul of mismatched shapes):
    one line naming ``fn``, the example arguments' types, the line ``at`` and the backend's message."""
    message = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    types = ", ".join(describe(a) for a in example_args)
    line = f" at {at}" if at is not None else ""
    return ModelImportError(
        f"{where}: fn {_name(fn)} raised {type(exc).__name__} on its example arguments ({types}){line}: "
        f"{printable(message)}"
    )


def _argument(names: list[str], index: int) -> str:
    return f"example argument {names[index]} (position {index + 1} after fn)"


def mlx_static_scalars(fn: Callable, example_args: tuple) -> tuple[Callable, tuple, list[str]]:
    """``(function of the array arguments only, those arrays, their parameter names)``: the Python scalars of
    ``example_args`` bound as static values; an ArgumentError for any argument that is neither."""
    import mlx.core as mx

    names = parameter_names(fn, len(example_args))
    static: dict[int, Any] = {}
    for i, arg in enumerate(example_args):
        if isinstance(arg, STATIC):
            static[i] = arg
        elif not isinstance(arg, mx.array):
            hint = "pass mx.array(...) of it" if hasattr(arg, "shape") else ""
            if isinstance(arg, (list, tuple, dict)):
                hint = "MLX's export takes arrays, not containers of them: pass each array as an argument"
            valid = "an mx.array, or a Python bool, int or float (static, as mx.compile treats it)"
            raise argument_error("from_mlx", _argument(names, i), arg, valid, hint)
    if not static:
        return fn, example_args, names

    def bound(*arrays: Any) -> Any:
        given = iter(arrays)
        return fn(*(static[i] if i in static else next(given) for i in range(len(example_args))))

    bound.__name__ = bound.__qualname__ = getattr(fn, "__name__", type(fn).__name__)
    arrays = tuple(a for i, a in enumerate(example_args) if i not in static)
    return bound, arrays, [n for i, n in enumerate(names) if i not in static]


def require_jax_leaves(fn: Callable, example_args: tuple) -> None:
    """An ArgumentError for a pytree leaf of ``example_args`` that JAX does not trace: neither a JAX or numpy
    array (a numpy scalar, ``jax.ShapeDtypeStruct``, an object with ``__jax_array__`` too) nor a Python scalar.
    An array of another framework (an ``mx.array``, a torch tensor) is named, with how to convert it."""
    import jax

    arrays = (np.ndarray, np.generic, jax.Array, jax.ShapeDtypeStruct)
    names = parameter_names(fn, len(example_args))
    for i, arg in enumerate(example_args):
        for leaf in jax.tree_util.tree_leaves(arg):
            if not (isinstance(leaf, (*STATIC, *arrays)) or hasattr(leaf, "__jax_array__")):
                hint = "convert it with np.asarray(x) or jnp.asarray(x)" if hasattr(leaf, "shape") else ""
                if type(leaf).__module__.startswith("mlx"):
                    hint = "convert it with np.array(x), or import MLX code with from_mlx"
                valid = (
                    "arrays (JAX, numpy, jax.ShapeDtypeStruct), Python scalars (traced, as jax.jit traces them) "
                    "or pytrees of them"
                )
                raise argument_error("from_jax", _argument(names, i), leaf, valid, hint)


__all__ = ["OPTIONS", "mlx_static_scalars", "require_call", "require_callable", "require_jax_leaves", "traced_error"]
