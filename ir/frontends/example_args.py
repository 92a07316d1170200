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
what is valid, before the backend's own tracer sees it.
"""

from __future__ import annotations

from typing import Any, Callable

from attnpass.ir.core.arguments import argument_error

from .importing import parameter_names

STATIC = (bool, int, float)


def require_callable(where: str, fn: Any, example_args: tuple) -> None:
    """An ArgumentError unless ``fn`` is callable; when an example argument is, the arguments look swapped."""
    if callable(fn):
        return
    swapped = any(callable(a) for a in example_args)
    hint = "the arguments look swapped" if swapped else "the function comes first"
    raise argument_error(where, "fn", fn, "the function to import (a callable)", f"{hint}: {where}(fn, *example_args)")


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
    """An ArgumentError for a pytree leaf of ``example_args`` that is neither an array (anything with a shape
    and a dtype, ``jax.ShapeDtypeStruct`` too) nor a Python scalar."""
    import jax

    names = parameter_names(fn, len(example_args))
    for i, arg in enumerate(example_args):
        for leaf in jax.tree_util.tree_leaves(arg):
            if not (isinstance(leaf, STATIC) or (hasattr(leaf, "shape") and hasattr(leaf, "dtype"))):
                valid = "arrays, jax.ShapeDtypeStruct, Python scalars (traced, as jax.jit traces them) or pytrees"
                raise argument_error("from_jax", _argument(names, i), leaf, valid)


__all__ = ["mlx_static_scalars", "require_callable", "require_jax_leaves"]
