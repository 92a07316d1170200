"""The buffer cut: how many rows of a cache's buffer a decode program is given, and growing a buffer to them.

A CPU program costs in proportion to its rows, so a decode call gets its cache's buffer cut a little past the
valid rows (:func:`buffer_rows`), one signature per cut rather than per token; a buffer shorter than its cut is
grown to it (:func:`grow`), as the cache's own ``update_and_fetch`` grows it. :func:`cut_plan` and
:func:`over_cut` make the plan and arguments of such a call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from collections.abc import Callable

from .calls import Call, Plan, Routed, key_rows
from .masks import masked

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

    if key_rows(cache.keys) >= rows:
        return
    if isinstance(cache.keys, (tuple, list)):
        kind = type(cache.keys)
        cache.keys, cache.values = kind(map(grown, cache.keys)), kind(map(grown, cache.values))
    else:
        cache.keys, cache.values = grown(cache.keys), grown(cache.values)
    held, fetch = call.fetched.get(id(cache), (None, None))
    if held is cache:
        call.fetched[id(cache)] = (cache, dataclasses.replace(fetch, buffer=(cache.keys, cache.values)))


def cut_plan(
    call: Any, program: str, grows: bool, arguments: Callable[[Any, int, bool], Routed] | None = None
) -> Plan:  # fmt: skip
    """The plan of a decode call over its cache's buffer cut (:func:`buffer_rows` of its valid rows, at most the
    buffer unless it ``grows``): ``program`` on ``arguments(call, length, grows)`` (:func:`over_cut`'s by
    default)."""
    length = buffer_rows(key_rows(call.keys), None if grows else key_rows(call.cache.keys))
    return Plan(program, length, lambda: (arguments or over_cut)(call, length, grows))


def over_cut(call: Any, length: int, grows: bool) -> Routed:
    """The attention program's arguments over the buffer cut to ``length`` rows (grown to them first if it
    ``grows``) and the call's mask over that cut."""
    cache = call.cache
    if grows:
        grow(cache, length, call.recorded)
    keys, values = first_rows(cache.keys, length), first_rows(cache.values, length)
    return masked(call, keys, values, call.masks.over_buffer(call.mask, call.rows, key_rows(call.keys), length))


def first_rows(array: Any, length: int) -> Any:
    """A buffer's first ``length`` rows (axis 2): the buffer itself when it has no more."""
    return array if array.shape[2] == length else array[:, :, :length]


def words(array: Any) -> Any:
    """A program argument: packed uint32 words as int32 of the same bits (the IR's type), the rest as they are."""
    import mlx.core as mx

    return array.view(mx.int32) if array.dtype == mx.uint32 else array


__all__ = [
    "CUTS_PER_OCTAVE", "CUT_ROWS", "buffer_rows", "cut_plan", "cuts_bound", "first_rows", "grow", "over_cut",
    "padding_bound", "words",
]  # fmt: skip
