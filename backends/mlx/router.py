"""What every client route of ``optimize`` shares: the active call, recorders, fetch proof, buffer cut, patches.

:mod:`.lm` routes mlx-lm's attention helper, :mod:`.vlm` mlx-vlm's QSA dispatch;
both substitute a cache's buffer only after :func:`fetch_reason` found the
call's keys and values to be what that cache's ``update_and_fetch`` returned
in this model call (recorded by :func:`record_fetch`).
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

NOT_FETCHED = (
    "keys/values are not the arrays this cache's update_and_fetch returned in this model call "
    "(e.g. MLA builds them from a cached latent)"
)


MLX_LM_CACHES = "mlx_lm.models.cache"
QWEN4_EXP = "mlx_vlm.models.qwen4_exp.language"


@functools.cache  # imported once: a decode step asks per call
def classes(module: str, *names: str) -> tuple[type, ...]:
    """The classes ``names`` of ``module`` (a model library's caches), imported when first asked."""
    found = importlib.import_module(module)
    return tuple(getattr(found, name) for name in names)


@dataclass(frozen=True)
class Fetch:
    """What one ``update_and_fetch`` returned, and the buffer and write position it left (``offset``; a
    batched cache's ``_idx``, the rows written for every stream)."""

    keys: Any
    values: Any
    buffer: tuple[Any, Any]
    position: int


@dataclass
class Call:
    """One call of an optimized model: the model, each cache's last fetch and last QSA selection (by cache id), the
    masks a batched cache made (by mask id)."""

    model: Any
    fetched: dict[int, tuple[Any, Fetch]] = field(default_factory=dict)
    selections: dict[int, tuple[Any, Any, int]] = field(default_factory=dict)  # cache, selection, ratio
    masks: dict[int, tuple[Any, bool]] = field(default_factory=dict)  # a made mask, every query row sees a key


ACTIVE: ContextVar[Call | None] = ContextVar("attnpass_optimized_call", default=None)
LOCK = threading.Lock()
_PATCHES: dict[tuple[Any, str], tuple[int, Any]] = {}  # (class or module, attribute) -> (models, original)


def offset(cache: Any) -> int:
    """The write position of a cache with one offset for every stream (KVCache and its kin)."""
    return cache.offset


def fetch_recorder(position: Callable[[Any], int]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A patch of a cache class's ``update_and_fetch`` that also records its :class:`Fetch` (the write position
    read by ``position``) in the active optimized call, if any."""

    def patch(update_and_fetch: Callable[..., Any]) -> Callable[..., Any]:
        def recording(cache: Any, keys: Any, values: Any) -> Any:
            result = update_and_fetch(cache, keys, values)
            call = ACTIVE.get()
            if call is not None:
                call.fetched[id(cache)] = (cache, Fetch(*result, (cache.keys, cache.values), position(cache)))
            return result

        recording.__wrapped__ = update_and_fetch  # type: ignore[attr-defined]
        return recording

    return patch


record_fetch = fetch_recorder(offset)


def fetch_reason(
    keys: Any, values: Any, cache: Any, fetched: dict[int, tuple[Any, Fetch]], position: Callable[[Any], int] = offset
) -> str | None:
    """None when ``keys``/``values`` are ``cache``'s last fetch and it still holds that buffer at the same write
    ``position`` (as recorded by :func:`fetch_recorder` with it); else why not."""
    held, fetch = fetched.get(id(cache), (None, None))
    if held is not cache or keys is not fetch.keys or values is not fetch.values:
        return NOT_FETCHED
    if cache.keys is not fetch.buffer[0] or cache.values is not fetch.buffer[1] or position(cache) != fetch.position:
        return "the cache changed between update_and_fetch and the attention call"
    return None


def buffer_rows(offset: int, length: int) -> int:
    """The rows of a cache's buffer (``length``) a decode program is given for ``offset`` valid ones: the
    offset rounded up to a multiple of ``max(32, 2^floor(log2(offset)) / 32)``, at most the buffer.

    A CPU program costs in proportion to the rows, padded ones too: the padding stays under 32 rows or under
    1/32 of the offset (a whole 256-row buffer step would cost up to twice the work just past a boundary), for
    one signature per 32 rows up to 2048 keys, then 32 per doubling."""
    step = max(32, (1 << max(offset, 1).bit_length() - 1) // 32)
    return min(length, -(-offset // step) * step)


def first_rows(array: Any, length: int) -> Any:
    """A buffer's first ``length`` rows (axis 2): the buffer itself when it has no more."""
    return array if array.shape[2] == length else array[:, :, :length]


def patch(owner: Any, name: str, replace: Callable[[Any], Any]) -> None:
    """``owner.name = replace(owner.name)`` for the first model that needs it (call with :data:`LOCK` held)."""
    key = (owner, name)
    count, original = _PATCHES.get(key, (0, getattr(owner, name)))
    if not count:
        setattr(owner, name, replace(original))
    _PATCHES[key] = (count + 1, original)


def unpatch(owner: Any, name: str) -> None:
    """Undo one :func:`patch`: the original comes back with the last model that needed it."""
    key = (owner, name)
    count, original = _PATCHES[key]
    if count > 1:
        _PATCHES[key] = (count - 1, original)
    else:
        del _PATCHES[key]
        setattr(owner, name, original)
