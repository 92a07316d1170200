"""``attnpass.backends.mlx.compile``: ``mx.compile`` with attnpass's pipeline in front, per input signature.

Array arguments (``mx.array``, positional or keyword) are the program's
inputs; every other argument is static: its value is part of the signature
and bound when the function is imported. A numpy array is refused (an
ArgumentError naming it), as ``mx.compile`` refuses it. Arrays the function closes over
(weights) are captured at each signature's first call, as ``mx.compile`` does.
The function returns an array or a tuple/list of arrays.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Hashable, Sequence, overload

import numpy as np

from attnpass.ir import ImportedGraph, from_mlx
from attnpass.ir.core.arguments import argument_error
from attnpass.ir.core.types import native_dtype_name
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


class MLXFrontend(Frontend):
    """Signatures of MLX calls: ``mx.array`` arguments are inputs, the others static."""

    target = "mlx"

    def __init__(self, fn: Callable | None = None) -> None:
        """``fn``, when given, names the positional arguments of errors (``argument q``)."""
        import mlx.core as mx

        self._array = mx.array
        self._fn = fn

    def device(self) -> str:
        """The default MLX device: ``"cpu"``, ``"metal"`` or ``"gpu"`` (CUDA)."""
        import mlx.core as mx

        if mx.default_device().type == mx.DeviceType.cpu:
            return "cpu"
        return "metal" if mx.metal.is_available() else "gpu"

    def key(self, args: tuple, kwargs: dict) -> tuple[Hashable, list]:
        array = self._array
        entries: list[Hashable] = [
            (a.shape, a.dtype) if isinstance(a, array) else self._static(i, a) for i, a in enumerate(args)
        ]
        arrays = [a for a in args if isinstance(a, array)]
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, array):
                arrays.append(value)
                entries.append((name, value.shape, value.dtype))
            else:
                entries.append((name, self._static(name, value)))
        return tuple(entries), arrays

    def _static(self, where: int | str, value: Any) -> tuple:
        """The signature entry of a non-``mx.array`` argument; a numpy array is refused, as ``mx.compile`` does."""
        if isinstance(value, np.ndarray):
            if isinstance(where, int):
                where = parameter_names(self._fn, where + 1)[where] if self._fn is not None else f"arg{where}"
            raise argument_error(
                "attnpass.backends.mlx.compile", f"argument {where}", value, "an mx.array (or a static value)",
                f"convert it: mx.array({where})",
            )  # fmt: skip
        return static_spec(value)

    def traceable(self, fn: Callable, args: tuple, kwargs: dict) -> Traceable:
        array = self._array
        names = parameter_names(fn, len(args)) + sorted(kwargs)
        values = list(args) + [kwargs[k] for k in sorted(kwargs)]
        dynamic = [i for i, v in enumerate(values) if isinstance(v, array)]
        parts, unstatic = [], None
        for name, value in zip(names, values):
            if isinstance(value, array):
                parts.append(array_text(name, value.shape, native_dtype_name(value.dtype)))
            else:
                parts.append(static_text(name, value))
                if unstatic is None and static_spec(value)[0] == "unhashable":
                    unstatic = f"argument {name} is a {type(value).__name__}: not an array and not hashable"

        statics = [None if i in dynamic else v for i, v in enumerate(values)]  # fn holds no argument array
        rebuild = Rebuild()

        def call(*arrays: Any) -> Any:
            filled = list(statics)
            for i, a in zip(dynamic, arrays):
                filled[i] = a
            out = fn(*filled[: len(args)], **dict(zip(sorted(kwargs), filled[len(args) :])))
            if not isinstance(out, (list, tuple)):
                return out
            kind = list if isinstance(out, list) else tuple
            rebuild.structure = lambda o: kind(o if isinstance(o, tuple) else (o,))  # one output: returned bare
            return tuple(out)

        name_parameters(call, [names[i] for i in dynamic], fn)
        return Traceable(", ".join(parts), call, [values[i] for i in dynamic], unstatic, rebuild)

    def import_graph(self, t: Traceable) -> ImportedGraph:
        return from_mlx(t.fn, *t.arrays)

    def compile(self, fn: Callable) -> Callable:
        import mlx.core as mx

        return mx.compile(fn)

    def fallback(self, fn: Callable) -> Callable:
        return fn


@overload
def compile(
    fn: Callable, *, pipeline: str | Sequence[Pass] | None = None, strict: bool = False, max_signatures: int = ...
) -> CompiledFunction: ...


@overload
def compile(
    fn: None = None, *, pipeline: str | Sequence[Pass] | None = None, strict: bool = False, max_signatures: int = ...
) -> Callable[[Callable], CompiledFunction]: ...


def compile(
    fn: Callable | None = None,
    *,
    pipeline: str | Sequence[Pass] | None = None,
    strict: bool = False,
    max_signatures: int = MAX_SIGNATURES,
) -> CompiledFunction | Callable[[Callable], CompiledFunction]:
    """``fn`` compiled per input signature: imported, rewritten by ``pipeline``, lowered to MLX, ``mx.compile``'d.

    ``pipeline`` is text or passes; None is :func:`attnpass.backends.specialize.wrapper_pipeline`
    for the default device when the wrapper is made. ``strict=False``: a signature that cannot be
    compiled runs ``fn`` itself, with one :class:`FallbackWarning`; ``strict=True`` raises
    :class:`SpecializationError`. Use as ``compile(fn, ...)``, as ``@compile`` or as
    ``@compile(pipeline=..., ...)`` (without ``fn``: the decorator with these options).
    """
    name = "attnpass.backends.mlx.compile"
    if fn is None:
        return functools.partial(compile, pipeline=pipeline, strict=strict, max_signatures=max_signatures)
    check_callable(fn, name)
    frontend = MLXFrontend(fn)
    return CompiledFunction(fn, frontend, pipeline=pipeline, strict=strict, max_signatures=max_signatures, name=name)


__all__ = ["MLXFrontend", "compile"]
