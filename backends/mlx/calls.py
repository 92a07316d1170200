"""The record of one optimized model call, the recorders that fill it, the fetch proof, and the patches.

While an optimized model runs, :data:`ACTIVE` holds its :class:`Call`: what each cache's ``update_and_fetch``
returned and left (a :class:`Fetch`), and the notes each adapter module keeps (:meth:`Call.notes`: a table per
owner, such as the masks a batched cache made or the selections an indexer returned; the call record has no field
of its own for any cache kind). :func:`recorder` makes every recording patch: the original method, then a note
in the active call. A cache adapter substitutes a cache's buffer for the arrays a client function received only
after :func:`fetch_decline` found them to be that cache's last fetch in this model call and the cache unchanged
since (:func:`received_decline`: that, and the mask's, for a helper call); what it then runs is a :class:`Plan`
of :class:`Routed` arguments. :func:`patch` and :func:`unpatch` count the models that need a patch, so that several optimized models
share one patched class and the original comes back with the last.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from attnpass.passes import Decline

Patch = tuple[Any, str, Callable[[Any], Any]]  # (class or module, attribute, original -> replacement)
Note = Callable[..., None]  # (call, result, *the method's arguments) -> None: what a recorder keeps


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
    """One call of an optimized model: the model, each cache's last fetch (by cache id) and the notes of each
    adapter module (:meth:`notes`)."""

    model: Any
    fetched: dict[int, tuple[Any, Fetch]] = field(default_factory=dict)
    _notes: dict[str, dict[int, Any]] = field(default_factory=dict)

    def notes(self, owner: str) -> dict[int, Any]:
        """The table ``owner`` (an adapter module's name for what it records) keeps in this call, by object id."""
        return self._notes.setdefault(owner, {})


ACTIVE: ContextVar[Call | None] = ContextVar("attnpass_optimized_call", default=None)
LOCK = threading.Lock()
_PATCHES: dict[tuple[Any, str], tuple[int, Any]] = {}  # (class or module, attribute) -> (models, original)


def recorded(model: Any) -> Call:
    """The active call's records when ``model`` is the model running, else an empty record."""
    call = ACTIVE.get()
    return call if call is not None and call.model is model else Call(model)


def recorder(note: Note) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A patch of a method that runs it, then, in an active optimized call, ``note(call, result, *args,
    **kwargs)``; the original stays reachable as ``__wrapped__``."""

    def patch(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def recording(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            call = ACTIVE.get()
            if call is not None:
                note(call, result, *args, **kwargs)
            return result

        return recording

    return patch


def offset(cache: Any) -> int:
    """The write position of a cache with one offset for every stream (KVCache and its kin)."""
    return cache.offset


def fetch_recorder(position: Callable[[Any], int]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A patch of a cache class's ``update_and_fetch`` that also records its :class:`Fetch` (the write position
    read by ``position``) in the active optimized call."""

    def note(call: Call, result: Any, cache: Any, *_: Any) -> None:
        call.fetched[id(cache)] = (cache, Fetch(*result, (cache.keys, cache.values), position(cache)))

    return recorder(note)


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
    return unchanged_decline(cache, fetch, position, call)


def unchanged_decline(
    cache: Any, fetch: Fetch, position: Callable[[Any], int] = offset, call: Call | None = None
) -> Decline | None:  # fmt: skip
    """None when ``cache`` still holds the buffer and write position ``fetch`` left (a buffer array rebound to
    ``mx.depends(buffer, ...)`` in ``call`` still holds it: :func:`depended`, read on both sides, since a cache may
    rebind its own buffer so inside ``update_and_fetch``, as mlx-lm's BatchRotatingKVCache does); else why not."""
    held, buffer = (cache.keys, cache.values), fetch.buffer
    if call is not None:
        held, buffer = (tuple(depended(a, call) for a in arrays) for arrays in (held, buffer))
    if held[0] is not buffer[0] or held[1] is not buffer[1] or position(cache) != fetch.position:
        return Decline("cache_changed", "the cache changed between update_and_fetch and the attention call")
    return None


DEPENDS = "depends"  # the notes of mx.depends in a call: id(result) -> (result, the array it returns the value of)


def note_depends(call: Call, result: Any, inputs: Any, dependencies: Any) -> None:
    """What ``mx.depends(inputs, dependencies)`` returned for one array: an array of the same value as
    ``inputs`` (MLX's contract: only evaluated after ``dependencies``)."""
    if not isinstance(inputs, (list, tuple)) and not isinstance(result, (list, tuple)):
        call.notes(DEPENDS)[id(result)] = (result, inputs)


def depended(array: Any, call: Call) -> Any:
    """The array whose value ``array`` is, through the ``mx.depends`` results recorded in ``call`` (mlx-lm's
    MiniMax-M3 rebinds its cache's keys to ``mx.depends(keys, index_cache)`` after each fetch)."""
    notes = call.notes(DEPENDS)
    while id(array) in notes and notes[id(array)][0] is array:
        array = notes[id(array)][1]
    return array


def depends_patch() -> Patch:
    """The recorder of ``mx.depends`` (:func:`note_depends`), which :func:`unchanged_decline` reads."""
    import mlx.core as mx

    return (mx, "depends", recorder(note_depends))


def key_rows(keys: Any) -> int:
    """The rows of a cache's keys: an array's, or a quantized cache's (words, scales, biases)."""
    return (keys[0] if isinstance(keys, (tuple, list)) else keys).shape[2]


def string_mask_decline(call: Any) -> Decline | None:
    """A string mask other than ``"causal"`` (MLX's only one)."""
    if isinstance(call.mask, str) and call.mask != "causal":
        return Decline("string_mask", f"string mask {call.mask!r} (only 'causal' is one)", data={"mask": call.mask})
    return None


def mask_keys_decline(call: Any, keys: int) -> Decline | None:
    """An array mask over another number of keys than the call's ``keys``."""
    mask = call.mask
    if mask is not None and not isinstance(mask, str) and mask.shape[-1] != keys:
        message = f"the mask covers {mask.shape[-1]} keys, the helper has {keys}"
        return Decline("mask_keys_mismatch", message, data={"mask_keys": mask.shape[-1], "keys": keys})
    return None


def received_decline(call: Any, holds: bool, position: Callable[[Any], int] = offset) -> Decline | None:
    """Why what a helper call received is not its cache's valid prefix (None when it is): a string mask MLX
    lacks, keys/values that are not the cache's last fetch (:func:`fetch_decline`), a mask over other keys, or
    a fetch that is not the buffer's first rows (``holds``, the cache kind's own reading)."""
    n, cache = key_rows(call.keys), call.cache
    found = string_mask_decline(call) or fetch_decline(call.keys, call.values, cache, call.recorded, position)
    found = found or mask_keys_decline(call, n)
    if found is None and not holds:
        length = key_rows(cache.keys)
        message = f"{type(cache).__name__}: the keys ({n} rows) are not the buffer's valid prefix ({length} rows)"
        found = Decline("not_prefix", message, data={"rows": n, "buffer_rows": length})
    return found


@dataclass(frozen=True)
class Routed:
    """A call's program: ``program`` names a row of :data:`~.programs.PROGRAMS`, ``args``
    are its arguments (arrays and statics, what its signature is keyed on) and ``given`` the arrays its compiled
    program is called with, in order; ``streams``, when given, replaces ``given``: one such list per stream of a
    batch, the program called on each and the outputs joined on axis 0 (``args`` are then the first stream's)."""

    program: str
    args: tuple
    given: list
    streams: list[list] | None = None


@dataclass(frozen=True)
class Plan:
    """What a call would run: ``program`` (a row of :data:`~.programs.PROGRAMS`, whose ``bound`` is the plan's
    kind for :data:`~.bounds.MIN_KEYS`), the key ``rows`` its program would get (the bound's early decline reads
    them), and ``build``, which makes its :class:`Routed` arguments only when it runs; the routed program may be a
    sibling of the same bound that ``build``'s proof picks (``structured_attention`` for a mask proven a
    structure, ``dsa_attention`` for a mask proven a top-k selection)."""

    program: str
    rows: int
    build: Callable[[], Routed]


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
    "ACTIVE", "DEPENDS", "LOCK", "NOT_FETCHED", "Call", "Fetch", "Note", "Patch", "Plan", "Routed", "classes",
    "depended", "depends_patch", "fetch_decline",
    "fetch_recorder", "key_rows", "last_fetch", "mask_keys_decline", "offset", "patch", "received_decline",
    "recorded", "recorder", "string_mask_decline", "unchanged_decline", "unpatch",
]  # fmt: skip
