"""``optimize(model)``: an mlx-lm model's attention through attnpass programs, compiled per signature.

**Routing.** mlx-lm's attention modules call ``scaled_dot_product_attention``,
which each model module imports from ``mlx_lm.models.base``. ``optimize``
replaces that name, in the modules defining the model's layers, with a router,
and gives the model a subclass whose ``__call__`` marks it active (a context
variable, so per thread). The router sends the attention of an active optimized
model to its compiled program (:func:`attnpass.backends.mlx.compile` of
:func:`attention`) and every other call, of models not optimized, to mlx-lm's
helper. :meth:`OptimizedModel.restore` (or leaving a ``with`` block) undoes both.

**Signatures.** With a ``KVCache`` the keys grow by one row per decode step
while the cache's buffer grows in steps of ``KVCache.step`` (256). The router
passes the whole buffer and a bool mask of the valid (and, for several query
rows, causal) positions, so a signature is the query shape, the buffer length,
the mask shape, the scale and the dtype: one trace per buffer length per layer
shape, whatever the position inside the buffer. Without a cache the keys are
passed as they are (one signature per length).

**What the router proves before it substitutes the buffer.** While an
optimized model runs, ``KVCache.update_and_fetch`` records, per cache, the
arrays it returned and the buffer and offset it left. A call with a cache is
routed only if the cache is exactly a ``KVCache``, the helper's ``keys`` and
``values`` *are* (object identity) the arrays that cache's last
``update_and_fetch`` of this model call returned, and the cache still holds
that buffer and offset: then ``keys == cache.keys[..., :offset, :]`` (and so
for values) by ``KVCache``'s own code, and the padded buffer with its mask
computes the same attention. Models that build keys from what the cache holds
(MLA: deepseek_v3, kimi_linear, glm4_moe_lite, ... cache a latent) fail the
identity and are declined.

**Declined** calls run mlx-lm's helper and are counted by reason in
:attr:`OptimizedModel.declined`: attention sinks, caches other than
``KVCache`` (quantized, rotating, batched, ...: no buffer to key on), k/v that
are not the cache's fetched arrays, string masks other than ``"causal"``,
signatures that fell back to the original function, and signatures whose
rewritten graph is still one MLX fused call (:data:`FUSED`: the helper computes
the same on the valid keys, without the buffer padding). A ``FUSED`` signature
is decided after the pipeline, before lowering: it is never compiled, and as
every signature, built once. So a model is only as fast as the pipeline's
rewrites make it, and never pays the padding for nothing.

**Numerics** (on CPU; ``tests/backends/test_dropin_mlx_lm.py``). A routed call
runs the rewritten program instead of mlx-lm's helper. Head-chunk (MLX's fused
call per chunk of heads) gives plain mlx-lm's log-probabilities bit for bit, in
float32 and bfloat16; the default pipeline's decompose-sdpa does in float32,
and in bfloat16 rounds differently than MLX's call: log-probabilities within two
bf16 steps, so greedy decoding may take the other branch of a near-tie and the
texts part from there. Declined calls are mlx-lm's helper, bit for bit.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence, TextIO

from attnpass.ir import Graph
from attnpass.passes import Pass

from ..specialize import MAX_SIGNATURES, CompiledFunction
from .compiled import MLXFrontend

HELPER = "scaled_dot_product_attention"
FUSED = "the pipeline kept MLX's fused call: mlx-lm's helper runs it on the valid keys, without the buffer padding"
NOT_FETCHED = (
    "keys/values are not the arrays this cache's update_and_fetch returned in this model call "
    "(e.g. MLA builds them from a cached latent)"
)


@dataclass(frozen=True)
class _Fetch:
    """What one ``KVCache.update_and_fetch`` returned, and the buffer and offset it left."""

    keys: Any
    values: Any
    buffer: tuple[Any, Any]
    offset: int


@dataclass
class _Call:
    """One call of an optimized model: the model and each cache's last fetch (by cache id, cache held)."""

    model: OptimizedModel
    fetched: dict[int, tuple[Any, _Fetch]] = field(default_factory=dict)


_ACTIVE: ContextVar[_Call | None] = ContextVar("attnpass_optimized_call", default=None)
_LOCK = threading.Lock()
_ROUTED_MODULES: dict[str, int] = {}  # module name -> optimized models routing through it
_OPTIMIZED: list[OptimizedModel] = []  # not restored yet: KVCache.update_and_fetch records while there is one


def attention(queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
    """The attention an optimized model compiles: MLX's fused call, imported and rewritten per signature."""
    import mlx.core as mx

    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def _helper() -> Any:
    from mlx_lm.models import base

    return base.scaled_dot_product_attention


def route(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any = None) -> Any:
    """mlx-lm's ``scaled_dot_product_attention``, through the active optimized model's programs if any."""
    call = _ACTIVE.get()
    if call is None:
        return _helper()(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return call.model.attend(queries, keys, values, cache, scale, mask, sinks)


def _record_fetch(update_and_fetch: Any) -> Any:
    """``KVCache.update_and_fetch`` that also records its result in the active optimized call, if any."""

    def recording(cache: Any, keys: Any, values: Any) -> Any:
        result = update_and_fetch(cache, keys, values)
        call = _ACTIVE.get()
        if call is not None:
            call.fetched[id(cache)] = (cache, _Fetch(*result, (cache.keys, cache.values), cache.offset))
        return result

    recording.__wrapped__ = update_and_fetch  # type: ignore[attr-defined]
    return recording


def _kept_fused(graph: Graph) -> str | None:
    """:data:`FUSED` when the rewritten graph is still one MLX fused call (reshapes aside): decline, don't lower."""
    ops = Counter(n.op for n in graph.nodes() if n.op not in ("input", "reshape"))
    return FUSED if ops == {"sdpa": 1} else None


class OptimizedModel:
    """What :func:`optimize` returns: the compiled attention, routing counts, and :meth:`restore`.

    ``compiled`` is the :class:`CompiledFunction` of :func:`attention` (its
    ``specializations`` hold each signature's rewritten graph and remarks),
    ``traces`` the number of signatures built, ``routed`` the attention calls
    that ran an attnpass program and ``declined`` the others, by reason.
    """

    def __init__(self, model: Any, compiled: CompiledFunction, modules: Sequence[str]) -> None:
        self.model = model
        self.compiled = compiled
        self.modules = tuple(modules)
        self.routed = 0
        self.declined: Counter[str] = Counter()
        self._original_class = type(model)
        self._lock = threading.Lock()
        self._last_mask: tuple[tuple, Any] | None = None  # every layer of a step shares its mask
        self._restored = False

    @property
    def traces(self) -> int:
        return self.compiled.traces

    @contextmanager
    def active(self) -> Iterator[None]:
        """Where the model's calls run: this thread's attention comes here, ``KVCache`` fetches are recorded.

        Outside the model (a benchmark timing :meth:`attend`), fetch and attend inside one ``with opt.active():``.
        """
        token = _ACTIVE.set(_Call(self))
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def attend(self, queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any) -> Any:
        """One attention call of the model: its compiled program, or mlx-lm's helper when declined."""
        call = _ACTIVE.get()
        fetched = call.fetched if call is not None and call.model is self else {}
        reason = _unroutable(keys, values, cache, mask, sinks, fetched)
        if reason is None:
            args = self._program_arguments(queries, keys, values, cache, mask)
            entry = self.compiled.specialization(*args, scale)
            if entry.compiled:
                with self._lock:
                    self.routed += 1
                return entry.call([a for a in args if a is not None])
            reason = FUSED if entry.reason == FUSED else f"no compiled program: {entry.reason.splitlines()[0]}"
        with self._lock:
            self.declined[reason] += 1
        return _helper()(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    def _program_arguments(self, queries: Any, keys: Any, values: Any, cache: Any, mask: Any) -> tuple:
        """``(queries, keys, values, mask)`` for the program: the cache's whole buffer and a mask of its valid rows."""
        rows = queries.shape[2]
        if cache is None:
            if isinstance(mask, str):
                mask = self._valid(rows, keys.shape[2], keys.shape[2], causal=True)
            return queries, keys, values, mask
        length = cache.keys.shape[2]
        if mask is None or isinstance(mask, str):
            mask = self._valid(rows, cache.offset, length, causal=mask is not None)
        elif length > cache.offset:
            mask = _pad_last(mask, length - cache.offset)
        return queries, cache.keys, cache.values, mask

    def _valid(self, rows: int, offset: int, length: int, *, causal: bool) -> Any:
        """bool ``[1, 1, rows|1, length]``: key ``j`` valid below ``offset``, and causal (bottom-right) if asked."""
        import mlx.core as mx

        key = (rows, offset, length, causal)
        last = self._last_mask
        if last is not None and last[0] == key:
            return last[1]
        positions = mx.arange(length)
        if causal:
            mask = positions[None] <= (offset - rows + mx.arange(rows))[:, None]
        else:
            mask = (positions < offset)[None]
        mask = mask[None, None]
        self._last_mask = (key, mask)
        return mask

    def explain(self, *, graphs: bool = False, file: TextIO | None = None) -> None:
        """Print the routing counts, then every signature with its remarks (and rewritten graph)."""
        out = file if file is not None else sys.stdout
        declined = ", ".join(f"{n} x {r}" for r, n in self.declined.most_common()) or "none"
        print(f"optimize({self._original_class.__name__}): routed {self.routed} attention call(s) through "
              f"{', '.join(self.modules)}; declined: {declined}", file=out)  # fmt: skip
        self.compiled.explain(graphs=graphs, file=out)

    def restore(self) -> None:
        """Undo :func:`optimize`: the model's own class, mlx-lm's helper where no other model still routes."""
        with _LOCK:
            if self._restored:
                return
            self._restored = True
            self.model.__class__ = self._original_class
            helper = _helper()
            for name in self.modules:
                _ROUTED_MODULES[name] -= 1
                if not _ROUTED_MODULES[name]:
                    del _ROUTED_MODULES[name]
                    setattr(sys.modules[name], HELPER, helper)
            _OPTIMIZED.remove(self)
            if not _OPTIMIZED:
                from mlx_lm.models.cache import KVCache

                KVCache.update_and_fetch = KVCache.update_and_fetch.__wrapped__

    def __enter__(self) -> OptimizedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "restored" if self._restored else "active"
        name = self._original_class.__name__
        return f"<OptimizedModel {name} ({state}): {self.traces} trace(s), {self.routed} routed>"


def _unroutable(
    keys: Any, values: Any, cache: Any, mask: Any, sinks: Any, fetched: dict[int, tuple[Any, _Fetch]]
) -> str | None:
    """Why a call cannot take the program (None when it can): sinks, odd masks, k/v not provably the cache's."""
    from mlx_lm.models.cache import KVCache

    if sinks is not None:
        return "attention sinks"
    if isinstance(mask, str) and mask != "causal":
        return f"string mask {mask!r}"
    if cache is None:
        return None
    if type(cache) is not KVCache:
        return f"{type(cache).__name__}: only KVCache has a buffer to key signatures on"
    held, fetch = fetched.get(id(cache), (None, None))
    if held is not cache or keys is not fetch.keys or values is not fetch.values:
        return NOT_FETCHED
    if cache.keys is not fetch.buffer[0] or cache.values is not fetch.buffer[1] or cache.offset != fetch.offset:
        return "the cache changed between update_and_fetch and the attention call"
    if mask is not None and not isinstance(mask, str) and mask.shape[-1] != cache.offset:
        return f"the mask covers {mask.shape[-1]} keys, the cache holds {cache.offset}"
    return None


def _pad_last(mask: Any, count: int) -> Any:
    """``mask`` extended by ``count`` masked-out keys: False for bool masks, -inf for additive ones."""
    import mlx.core as mx

    fill = False if mask.dtype == mx.bool_ else float("-inf")
    return mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, count)], constant_values=fill)


def optimize(
    model: Any,
    pipeline: str | Sequence[Pass] | None = None,
    *,
    strict: bool = False,
    max_signatures: int = MAX_SIGNATURES,
) -> OptimizedModel:
    """Run ``model``'s attention (an mlx-lm model) through attnpass programs compiled per signature.

    ``mlx_lm.generate``, ``stream_generate`` and speculative decoding work
    unchanged. ``pipeline``, ``strict`` and ``max_signatures`` are as for
    :func:`attnpass.backends.mlx.compile`. Returns an :class:`OptimizedModel`;
    its ``restore()``, or leaving ``with optimize(model):``, undoes the change.
    Raises ``TypeError`` when ``model`` is not an ``mlx.nn.Module``, ``ValueError``
    when it is already optimized or none of its modules calls mlx-lm's helper.
    """
    import mlx.nn as nn
    from mlx_lm.models.cache import KVCache

    if not isinstance(model, nn.Module):
        hint = " (mlx_lm.load returns (model, tokenizer): pass the model)" if isinstance(model, tuple) else ""
        raise TypeError(
            f"optimize: expected an mlx-lm model (an mlx.nn.Module such as mlx_lm.load(path)[0]), "
            f"got {type(model).__name__} {_short(model)}{hint}"
        )
    helper = _helper()
    if getattr(type(model), "_attnpass_optimized", None) is not None:
        raise ValueError(f"{type(model).__name__} is already optimized; restore() it first")
    names = sorted({type(m).__module__ for m in model.modules()})
    routed = [n for n in names if getattr(sys.modules.get(n), HELPER, None) in (helper, route)]
    if not routed:
        raise ValueError(
            f"optimize: no module of {type(model).__name__} ({', '.join(names)}) calls "
            f"mlx_lm.models.base.{HELPER}; its attention cannot be routed"
        )
    compiled = CompiledFunction(
        attention, MLXFrontend(), pipeline=pipeline, strict=strict, max_signatures=max_signatures,
        name="attnpass.backends.mlx.compile", decline=_kept_fused,
    )  # fmt: skip
    optimized = OptimizedModel(model, compiled, routed)
    cls = type(model)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        with optimized.active():
            return cls.__call__(self, *args, **kwargs)

    namespace = {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    subclass = type(cls.__name__, (cls,), {**namespace, "_attnpass_optimized": optimized})
    with _LOCK:
        for name in routed:
            _ROUTED_MODULES[name] = _ROUTED_MODULES.get(name, 0) + 1
            setattr(sys.modules[name], HELPER, route)
        if not _OPTIMIZED:
            KVCache.update_and_fetch = _record_fetch(KVCache.update_and_fetch)
        _OPTIMIZED.append(optimized)
        model.__class__ = subclass
    return optimized


def _short(value: Any) -> str:
    """``repr(value)`` on one line, cut to 60 characters."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["FUSED", "NOT_FETCHED", "OptimizedModel", "attention", "optimize", "route"]
