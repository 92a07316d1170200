"""The client functions ``optimize`` routes, and the trampolines that replace them in the model's modules.

mlx-lm's attention modules call ``scaled_dot_product_attention``, which each model module imports from
``mlx_lm.models.base``; mlx-vlm Qwen4-Exp's ``language`` module calls ``dispatch_qsa_attention`` from its
``qsa_kernel``. ``optimize`` replaces that name, in the modules defining the model's layers, with :func:`route`
or :func:`route_qsa`, which send the call of an active optimized model to it and every other call (of models not
optimized) to the original.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from .routing import ACTIVE

HELPER = "scaled_dot_product_attention"  # mlx-lm's, client "lm"
QSA_DISPATCH = "dispatch_qsa_attention"  # mlx-vlm Qwen4-Exp's, client "qsa"


def helper() -> Callable[..., Any]:
    """mlx-lm's ``scaled_dot_product_attention``."""
    from mlx_lm.models import base

    return base.scaled_dot_product_attention


def qsa_dispatch() -> Callable[..., Any]:
    """mlx-vlm's ``dispatch_qsa_attention``."""
    from mlx_vlm.models.qwen4_exp import qsa_kernel

    return qsa_kernel.dispatch_qsa_attention


def route(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any = None) -> Any:
    """mlx-lm's ``scaled_dot_product_attention``, through the active optimized model's programs if any."""
    call = ACTIVE.get()
    if call is None:
        return helper()(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return call.model.attend(queries, keys, values, cache, scale, mask, sinks)


def route_qsa(queries: Any, keys: Any, values: Any, blocks: Any, query_ends: Any, **options: Any) -> Any:
    """mlx-vlm's ``dispatch_qsa_attention``, through the active optimized model's programs if any."""
    call = ACTIVE.get()
    if call is None:
        return qsa_dispatch()(queries, keys, values, blocks, query_ends, **options)
    return call.model.attend_qsa(queries, keys, values, blocks, query_ends, **options)


def helper_modules(names: Sequence[str]) -> list[str]:
    """The modules among ``names`` calling mlx-lm's helper (or already :func:`route`)."""
    base = sys.modules.get("mlx_lm.models.base")  # a module calling mlx-lm's helper has imported it
    found = () if base is None else (getattr(base, HELPER), route)
    return [n for n in names if getattr(sys.modules.get(n), HELPER, None) in found]


def qsa_modules(names: Sequence[str]) -> list[str]:
    """The modules among ``names`` calling mlx-vlm's QSA dispatch (or already :func:`route_qsa`)."""
    kernel = sys.modules.get("mlx_vlm.models.qwen4_exp.qsa_kernel")
    found = () if kernel is None else (kernel.dispatch_qsa_attention, route_qsa)
    return [n for n in names if getattr(sys.modules.get(n), QSA_DISPATCH, None) in found]


__all__ = ["HELPER", "QSA_DISPATCH", "helper", "helper_modules", "qsa_dispatch", "qsa_modules", "route", "route_qsa"]
