"""The cache-adapter contract: what the router knows of one cache class, and the calls adapters read.

An adapter is one registered object per cache class (:func:`register`, keyed by the class's module and name, as
targets and passes are registered). It owns everything the router knows of its class: how the class's position
and valid rows are read, the proof that what a client function received is the cache's valid prefix
(:meth:`CacheAdapter.decline`: what ``update_and_fetch`` returned and left), the program and arguments of a call
(:meth:`CacheAdapter.route`) and the patches it installs (:meth:`CacheAdapter.patches`). The router core holds no
per-class knowledge: a new cache class is one new module with one adapter, and the coverage test
(tests/backends/mlx/test_caches.py) lists every class mlx-lm and mlx-vlm ship that has none.

A call reaches an adapter as a :class:`HelperCall` (mlx-lm's attention helper) or a :class:`QSACall` (mlx-vlm's
QSA dispatch), with what the active model call recorded; the adapter answers a
:class:`~attnpass.passes.Decline` (a reason code of :data:`attnpass.passes.REASONS`) or a :class:`Routed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from attnpass.passes import Decline

from ..masks import CAUSAL, Masks, Structure
from ..routing import Call, Patch

MLX_LM = "mlx_lm.models.cache"
MLX_VLM = "mlx_vlm.models.cache"
QWEN4_EXP = "mlx_vlm.models.qwen4_exp.language"


@dataclass
class HelperCall:
    """One call of mlx-lm's ``scaled_dot_product_attention``, with the active model call's records."""

    queries: Any
    keys: Any
    values: Any
    cache: Any
    scale: float
    mask: Any
    sinks: Any
    recorded: Call
    masks: Masks

    @property
    def rows(self) -> int:
        """The query rows."""
        return self.queries.shape[2]


@dataclass
class QSACall:
    """One call of mlx-vlm's ``dispatch_qsa_attention``, with the active model call's records."""

    queries: Any
    keys: Any
    values: Any
    blocks: Any
    query_ends: Any
    options: dict[str, Any]
    recorded: Call

    @property
    def cache(self) -> Any:
        return self.options["cache"]


@dataclass(frozen=True)
class Routed:
    """A call's program: ``program`` names a row of :data:`~attnpass.backends.mlx.programs.PROGRAMS`, ``args``
    are its arguments (arrays and statics, what its signature is keyed on) and ``given`` the arrays its compiled
    program is called with, in order; ``streams``, when given, replaces ``given``: one such list per stream of a
    batch, the program called on each and the outputs joined on axis 0 (``args`` are then the first stream's)."""

    program: str
    args: tuple
    given: list
    streams: list[list] | None = None


class CacheAdapter:
    """What the router knows of one cache class (``module``.``name``), for the client functions in ``clients``
    (``"lm"``: mlx-lm's attention helper; ``"qsa"``: mlx-vlm's QSA dispatch)."""

    module: ClassVar[str]
    name: ClassVar[str]
    clients: ClassVar[frozenset[str]] = frozenset({"lm"})

    def patches(self) -> list[Patch]:
        """The recorders this adapter's proofs read, as ``(owner, attribute, original -> replacement)``."""
        return []

    def decline(self, call: Any) -> Decline | None:
        """Why ``call`` cannot take a program (None when it can)."""
        raise NotImplementedError

    def route(self, call: Any) -> Routed:
        """The program and arguments of a call :meth:`decline` accepted."""
        raise NotImplementedError

    def most_rows(self, call: Any) -> int:
        """The most key rows the program of ``call`` would get (the policy's early decline reads it)."""
        raise NotImplementedError

    def policy(self, call: Any) -> str:
        """The kind of program :data:`~attnpass.backends.mlx.policy.MIN_KEYS` bounds for ``call``."""
        return "float"


ADAPTERS: dict[tuple[str, str], CacheAdapter] = {}


def register(cls: type[CacheAdapter]) -> type[CacheAdapter]:
    """Register the adapter of the cache class ``cls.module``.``cls.name`` (one per class)."""
    key = (cls.module, cls.name)
    if key in ADAPTERS:
        raise ValueError(f"cache {cls.module}.{cls.name} already has an adapter: {type(ADAPTERS[key]).__name__}")
    ADAPTERS[key] = cls()
    return cls


def adapter_for(cache: Any) -> CacheAdapter | None:
    """The adapter of ``cache``'s exact class (a subclass has its own, or none), None when it has none."""
    kind = type(cache)
    return ADAPTERS.get((kind.__module__, kind.__qualname__))


def string_mask_decline(call: HelperCall) -> Decline | None:
    """A string mask other than ``"causal"`` (MLX's only one)."""
    if isinstance(call.mask, str) and call.mask != "causal":
        return Decline("string_mask", f"string mask {call.mask!r} (only 'causal' is one)", data={"mask": call.mask})
    return None


def mask_keys_decline(call: HelperCall, keys: int) -> Decline | None:
    """An array mask over another number of keys than the call's ``keys``."""
    mask = call.mask
    if mask is not None and not isinstance(mask, str) and mask.shape[-1] != keys:
        message = f"the mask covers {mask.shape[-1]} keys, the helper has {keys}"
        return Decline("mask_keys_mismatch", message, data={"mask_keys": mask.shape[-1], "keys": keys})
    return None


def own_keys(call: HelperCall) -> Routed:
    """The helper's own keys (a prefill, a windowed cache's step of several rows, a call without a cache): a
    ``"causal"`` mask, or a bool mask proven a causal kind with a window or chunk (:meth:`Masks.structure`), goes
    to the program as its structure; the keys before the first one any row sees are left out. Any other mask is
    passed as it is."""
    import mlx.core as mx

    q, k, v, mask = call.queries, call.keys, call.values, call.mask
    if isinstance(mask, str):
        return structured(call, k, v, CAUSAL)
    if mask is None or mask.dtype != mx.bool_:
        return masked(call, k, v, mask)
    found = call.masks.structure(mask, q.shape[2], k.shape[2])
    if found is None:
        return masked(call, k, v, mask)
    first, structure = found
    if first:  # keys before the first one any row sees: hidden from every row, left out
        k, v = k[:, :, first:], v[:, :, first:]
    return structured(call, k, v, structure)


def structured(call: HelperCall, keys: Any, values: Any, structure: Structure) -> Routed:
    """The structured attention program over ``keys``/``values``: the mask as ``sdpa``'s causal kind and window."""
    args = (call.queries, keys, values, call.sinks, call.scale, structure)
    return Routed("structured_attention", args, [a for a in args[:4] if a is not None])


def masked(call: HelperCall, keys: Any, values: Any, mask: Any) -> Routed:
    """The attention program over ``keys``/``values`` with an array mask (or none)."""
    args = (call.queries, keys, values, mask, call.sinks, call.scale)
    return Routed("attention", args, [a for a in args[:5] if a is not None])


__all__ = [
    "ADAPTERS", "MLX_LM", "MLX_VLM", "QWEN4_EXP", "CacheAdapter", "HelperCall", "QSACall", "Routed", "adapter_for",
    "mask_keys_decline", "masked", "own_keys", "register", "string_mask_decline", "structured",
]  # fmt: skip
