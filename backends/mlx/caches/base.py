"""The cache-adapter contract: what the router knows of one cache class, as one question per call.

An adapter is one registered object per cache class (:func:`register`, keyed by the class's module and name, as
targets and passes are registered). It owns everything the router knows of its class: how the class's position
and valid rows are read, the proof that what a client function received is the cache's valid prefix (what
``update_and_fetch`` returned and left), what it records to prove it (its :meth:`CacheAdapter.patches` and its
own notes in the call record), and the program of a call. The router asks it one question,
:meth:`CacheAdapter.plan`: a :class:`~attnpass.passes.Decline` (a reason code of :data:`~..reasons.ROUTER_REASONS`)
or a :class:`Plan`. The router core holds no per-class knowledge: a new cache class is one new adapter, and the
coverage test (tests/backends/mlx_backend/test_caches.py) lists every class mlx-lm and mlx-vlm ship that has none.

A call reaches an adapter as a :class:`~..clients.HelperCall` (an attention helper's) or a
:class:`~..clients.QSACall` (mlx-vlm Qwen4-Exp's QSA dispatch), with what the active model call recorded.
"""

from __future__ import annotations

from typing import Any, ClassVar

from attnpass.passes import Decline

from ..calls import Patch, Plan, Routed
from ..clients import HELPERS, Client, HelperCall, QSACall

MLX_LM = "mlx_lm.models.cache"
MLX_VLM = "mlx_vlm.models.cache"
QWEN4_EXP = "mlx_vlm.models.qwen4_exp.language"


class CacheAdapter:
    """What the router knows of one cache class (``module``.``name``), for the client functions whose names are
    in ``clients`` (:data:`~..clients.CLIENTS`). One question per call: :meth:`plan`."""

    module: ClassVar[str]
    name: ClassVar[str]
    clients: ClassVar[frozenset[str]] = HELPERS

    def patches(self) -> list[Patch]:
        """The recorders this adapter's proofs read, as ``(owner, attribute, original -> replacement)``."""
        return []

    def plan(self, call: Any) -> Decline | Plan:
        """Why ``call`` cannot take a program (a :class:`~attnpass.passes.Decline`), or its :class:`Plan`."""
        raise NotImplementedError


ADAPTERS: dict[tuple[str, str], CacheAdapter] = {}


def register(cls: type[CacheAdapter]) -> type[CacheAdapter]:
    """Register the adapter of the cache class ``cls.module``.``cls.name`` (one per class)."""
    key = (cls.module, cls.name)
    if key in ADAPTERS:
        raise ValueError(f"cache {cls.module}.{cls.name} already has an adapter: {type(ADAPTERS[key]).__name__}")
    ADAPTERS[key] = cls()
    return cls


def registered(cache: Any) -> CacheAdapter | None:
    """The adapter registered for ``cache``'s exact class (a subclass has its own, or none)."""
    kind = type(cache)
    return ADAPTERS.get((kind.__module__, kind.__qualname__))


def adapter_for(client: Client, cache: Any) -> CacheAdapter | Decline:
    """The adapter of ``cache``'s exact class (a subclass has its own, or none) when it serves ``client``; else
    why not: the class has no adapter (``unknown_cache``), or its adapter routes no call of ``client``
    (``cache_unrouted``)."""
    kind = type(cache)
    found = registered(cache)
    if found is None:
        message = f"{kind.__module__}.{kind.__qualname__} has no cache adapter"
        return Decline("unknown_cache", message, data={"cache": kind.__name__})
    if client.name not in found.clients:
        message = f"{kind.__name__} is not a cache the route of {client} reads"
        return Decline("cache_unrouted", message, data={"cache": kind.__name__})
    return found


__all__ = [
    "ADAPTERS", "MLX_LM", "MLX_VLM", "QWEN4_EXP", "CacheAdapter", "HelperCall", "Plan", "QSACall", "Routed",
    "adapter_for", "register", "registered",
]  # fmt: skip
