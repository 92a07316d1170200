"""What every route of ``optimize`` shares: the active call, the fetch recorder and its proof, the buffer cut, patches.

While an optimized model runs, :data:`ACTIVE` holds its :class:`Call`: what each cache's ``update_and_fetch``
returned and left (a :class:`Fetch`, recorded by :func:`fetch_recorder`), the masks a batched cache made and the
selections an indexer returned. A cache adapter substitutes a cache's buffer for the arrays a client function
received only after :func:`fetch_decline` found them to be that cache's last fetch in this model call and the
cache unchanged since. :func:`patch` and :func:`unpatch` count the models that need a patch, so that several
optimized models share one patched class and the original comes back with the last.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from attnpass.passes import Decline

Patch = tuple[Any, str, Callable[[Any], Any]]  # (class or module, attribute, original -> replacement)


@functools.cache  # imported once: a decode step asks per call
def classes(module: str, *names: str) -> tuple[type, ...]:
    """The classes ``names`` of ``module`` (a model library's caches), imported when first asked."""
    found = importlib.import_module(module)
    return tuple(getattr(found, name) for name in names)


@dataclass(frozen=True)
class Fetch:
    """What one ``update_and_fetch`` returned, and the buffer and write position it left."""

    keys: Any
    values: Any
    buffer: tuple[Any, Any]
    position: int


@dataclass
class Call:
    """One call of an optimized model: the model, each cache's last fetch and last QSA selection (by cache id), the
    masks a batched cache made (by mask id), what the up-projections of MLA layers returned (by output id) and
    what each DSA indexer returned (by its cache's id)."""

    model: Any
    fetched: dict[int, tuple[Any, Fetch]] = field(default_factory=dict)
    selections: dict[int, tuple[Any, Any, int]] = field(default_factory=dict)  # cache, selection, ratio
    masks: dict[int, tuple[Any, bool]] = field(default_factory=dict)  # a made mask, every query row sees a key
    projections: dict[int, tuple[Any, Any, Any, bool]] = field(default_factory=dict)  # out, layer, input, transpose
    indexed: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # indexer cache, top-k (None: attends all)


ACTIVE: ContextVar[Call | None] = ContextVar("attnpass_optimized_call", default=None)
LOCK = threading.Lock()
_PATCHES: dict[tuple[Any, str], tuple[int, Any]] = {}  # (class or module, attribute) -> (models, original)


def recorded(model: Any) -> Call:
    """The active call's records when ``model`` is the model running, else an empty record."""
    call = ACTIVE.get()
    return call if call is not None and call.model is model else Call(model)


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


NOT_FETCHED = "keys/values are not the arrays this cache's update_and_fetch returned in this model call"


def last_fetch(cache: Any, call: Call) -> Fetch | None:
    """``cache``'s last fetch in ``call``, if any."""
    held, fetch = call.fetched.get(id(cache), (None, None))
    return fetch if held is cache else None


def fetch_decline(
    keys: Any, values: Any, cache: Any, call: Call, position: Callable[[Any], int] = offset
) -> Decline | None:  # fmt: skip
    """None when ``keys``/``values`` are ``cache``'s last fetch in ``call`` and it still holds that buffer at the
    same write ``position`` (as recorded by :func:`fetch_recorder` with it); else why not."""
    fetch = last_fetch(cache, call)
    if fetch is None or keys is not fetch.keys or values is not fetch.values:
        return Decline("not_fetched", NOT_FETCHED)
    return unchanged_decline(cache, fetch, position)


def unchanged_decline(cache: Any, fetch: Fetch, position: Callable[[Any], int] = offset) -> Decline | None:
    """None when ``cache`` still holds the buffer and write position ``fetch`` left; else why not."""
    if cache.keys is not fetch.buffer[0] or cache.values is not fetch.buffer[1] or position(cache) != fetch.position:
        return Decline("cache_changed", "the cache changed between update_and_fetch and the attention call")
    return None


CUT_ROWS = 32  # the finest step of a buffer cut: the cuts of offsets up to 128 are multiples of 32
CUTS_PER_OCTAVE = 4  # past 128 rows, a cut is 2^k times 1, 1.25, 1.5 or 1.75: four cuts per doubling


def buffer_rows(offset: int, length: int | None = None) -> int:
    """The rows of a cache's buffer a decode program is given for ``offset`` valid ones (one program signature
    per cut): the offset rounded up to a multiple of ``max(CUT_ROWS, 2^floor(log2(offset)) / CUTS_PER_OCTAVE)``,
    at most ``length`` (a buffer that cannot grow; None: no limit).

    A CPU program costs in proportion to the rows, padded ones too: the padding is under 32 rows or under a
    quarter of the offset (:func:`padding_bound`), and the offsets up to ``T`` have at most
    :func:`cuts_bound` ``(T)`` distinct cuts, whatever the context length: a single stream never evicts one."""
    step = padding_bound(offset) + 1
    rows = -(-offset // step) * step
    return rows if length is None else min(length, rows)


def padding_bound(offset: int) -> int:
    """The most padding rows :func:`buffer_rows` adds to ``offset``: its step, less one."""
    return max(CUT_ROWS, (1 << max(offset, 1).bit_length() - 1) // CUTS_PER_OCTAVE) - 1


def cuts_bound(most: int) -> int:
    """How many distinct cuts :func:`buffer_rows` gives the offsets 1 to ``most``: the multiples of ``CUT_ROWS``
    up to ``CUT_ROWS * CUTS_PER_OCTAVE`` (128), then ``CUTS_PER_OCTAVE`` per doubling (44 up to 131072)."""
    cut, first = buffer_rows(most), CUT_ROWS * CUTS_PER_OCTAVE
    if cut <= first:
        return cut // CUT_ROWS
    octave = (cut - 1).bit_length() - 1  # cut in (2^octave, 2^(octave + 1)]
    below = CUTS_PER_OCTAVE * (octave - first.bit_length() + 2)  # every cut up to 2^octave
    return below + (cut - (1 << octave)) // ((1 << octave) // CUTS_PER_OCTAVE)


def grow(cache: Any, rows: int, call: Call) -> None:
    """Give ``cache``'s buffer (``keys`` and ``values``: arrays, or tuples of a quantized cache's arrays) ``rows``
    rows (axis 2) when it holds fewer, zeros appended as its own ``update_and_fetch`` appends them; the fetch
    ``call`` recorded of it then holds the grown buffer (the cache is unchanged for the proofs that follow)."""
    import mlx.core as mx

    def grown(a: Any) -> Any:
        extra = mx.zeros((*a.shape[:2], rows - a.shape[2], *a.shape[3:]), a.dtype)
        return mx.concatenate([a, extra], axis=2)

    quantized = isinstance(cache.keys, (tuple, list))
    if (cache.keys[0] if quantized else cache.keys).shape[2] >= rows:
        return
    if quantized:
        kind = type(cache.keys)
        cache.keys, cache.values = kind(map(grown, cache.keys)), kind(map(grown, cache.values))
    else:
        cache.keys, cache.values = grown(cache.keys), grown(cache.values)
    fetch = last_fetch(cache, call)
    if fetch is not None:
        call.fetched[id(cache)] = (cache, dataclasses.replace(fetch, buffer=(cache.keys, cache.values)))


def first_rows(array: Any, length: int) -> Any:
    """A buffer's first ``length`` rows (axis 2): the buffer itself when it has no more."""
    return array if array.shape[2] == length else array[:, :, :length]


def words(array: Any) -> Any:
    """A program argument: packed uint32 words as int32 of the same bits (the IR's type), the rest as they are."""
    import mlx.core as mx

    return array.view(mx.int32) if array.dtype == mx.uint32 else array


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


__all__ = [
    "ACTIVE", "CUTS_PER_OCTAVE", "CUT_ROWS", "LOCK", "NOT_FETCHED", "Call", "Fetch", "Patch", "buffer_rows",
    "classes", "cuts_bound", "fetch_decline", "fetch_recorder", "first_rows", "grow", "last_fetch", "offset",
    "padding_bound", "patch", "recorded", "unchanged_decline", "unpatch", "words",
]  # fmt: skip
