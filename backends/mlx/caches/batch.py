"""mlx-lm's ``BatchKVCache`` (``batch_generate``, the server): ``B`` left-padded streams in one buffer.

The buffer ``[B, H, capacity, D]`` grows in steps of 256 rows; ``_idx`` rows are written (the same count for every
stream), ``offset`` and ``left_padding`` are per-stream arrays, and ``update_and_fetch`` returns the buffer's first
``_idx`` rows. A call is routed when its keys and values are the cache's fetch in this model call and the cache
still holds that buffer and ``_idx``; its mask is an array over ``_idx`` keys (the streams' left padding is only in
the model's mask, so a call without one is declined, ``no_array_mask``); and every query row sees a key (a row
that sees none, the padding rows of a left-padded prefill, gets a device-defined value from mlx-lm's helper which
the padded buffer would change: ``rows_without_keys``). Whether a mask that ``make_mask`` returned in this model
call has such a row is read from the padding and write position recorded when it was made (no evaluation: a host
sync would stall MLX's asynchronous decode); any other bool mask is evaluated. Each stream's program gets its
rows of the buffer's cut (a buffer shorter than the cut grown to it first, :func:`~..routing.grow`, as
:class:`~.kv.KVCache`'s) and of the model's mask padded over the unwritten rows of the cut: one signature per cut,
whatever the batch size (:func:`per_stream`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from attnpass.passes import Decline

from ..buffers import buffer_rows, first_rows, grow
from ..calls import (
    Call,
    Note,
    Patch,
    classes,
    fetch_decline,
    fetch_recorder,
    mask_keys_decline,
    recorder,
    string_mask_decline,
)
from ..masks import masked, pad_last
from .base import MLX_LM, CacheAdapter, HelperCall, Plan, Routed, register


def written(cache: Any) -> int:
    """A batched cache's write position: ``_idx``, the rows written for every stream."""
    return cache._idx


MADE_MASKS = "batch masks"  # the notes of the masks make_mask returned: id -> (mask, every query row sees a key)


def mask_note(sees: Callable[[Any, int], bool]) -> Note:
    """A recorder's note of what a batched cache's ``make_mask(N, window_size=..., return_array=...)`` returned
    and whether every query row of it sees a key (``sees(cache, N)``, read from the cache's padding now); a mask
    made with other options, or options given by position, is not noted (it is evaluated when used)."""

    def note(call: Call, mask: Any, cache: Any, N: int, *positional: Any, **options: Any) -> None:
        window = options.get("window_size")
        if not positional and set(options) <= {"window_size", "return_array"} and (window is None or window >= 1):
            call.notes(MADE_MASKS)[id(mask)] = (mask, sees(cache, N))  # a row's own position is in its window

    return note


note_mask = mask_note(lambda cache, N: sees_every_row(cache._idx, cache.left_padding.tolist()))


def sees_every_row(written: int, left_padding: list[int]) -> bool:
    """Whether every query row of ``create_causal_mask(N, offset=written, left_padding=...)`` sees a key: row
    ``i`` of stream ``b`` sees keys ``left_padding[b] .. written + i``, so the first row is the test."""
    return max(left_padding, default=0) <= written


def has_blind_row(mask: Any, call: Call) -> bool:
    """Whether a bool mask has a query row with no visible key: as noted in ``call`` when ``make_mask`` made it,
    else :func:`evaluated_blind_row`."""
    made, sees = call.notes(MADE_MASKS).get(id(mask), (None, False))
    if made is mask:
        return not sees
    return evaluated_blind_row(mask)


def evaluated_blind_row(mask: Any) -> bool:
    """Whether a bool mask has a query row with no visible key, by evaluating it (a host sync)."""
    import mlx.core as mx

    return mask.dtype == mx.bool_ and not mx.all(mx.any(mask, axis=-1)).item()


def array_mask_decline(call: HelperCall, keys: int) -> Decline | None:
    """A batched cache's call without an array mask (the streams' padding is only in the model's mask), or with
    one over another number of keys than ``keys``."""
    if call.mask is None or isinstance(call.mask, str):
        name = type(call.cache).__name__
        return Decline("no_array_mask", f"a {name} call without an array mask (the streams' left padding is only "
                       "in the model's mask)")  # fmt: skip
    return mask_keys_decline(call, keys)


def blind_row_decline(call: HelperCall) -> Decline | None:
    """A call whose bool mask has a query row that sees no key (:func:`has_blind_row`)."""
    if has_blind_row(call.mask, call.recorded):
        message = (
            "a query row of the bool mask sees no key (a left-padded prefill's padding rows): mlx-lm's helper "
            "gives such a row a value of its own, the padded buffer would average its unwritten rows too"
        )
        return Decline("rows_without_keys", message)
    return None


def per_stream(call: HelperCall, keys: Any, values: Any, mask: Any) -> Routed:
    """The attention program over ``keys``/``values`` with ``mask``, once per stream (batch 1 each, outputs joined):
    the signature names no batch size, so a server's changing batches share the cuts' signatures. Each stream's
    rows are computed as in the batched call (attention has no term across the batch axis)."""
    streams = call.queries.shape[0]

    def stream(b: int) -> Routed:
        rows = mask[b : b + 1] if mask.shape[0] == streams else mask
        return masked(
            dataclasses.replace(call, queries=call.queries[b : b + 1]), keys[b : b + 1], values[b : b + 1], rows
        )

    if streams == 1:
        return masked(call, keys, values, mask)
    given = [stream(b) for b in range(streams)]
    return Routed(given[0].program, given[0].args, given[0].given, [routed.given for routed in given])


@register
class BatchKVCache(CacheAdapter):
    module, name = MLX_LM, "BatchKVCache"

    def patches(self) -> list[Patch]:
        cls = classes(self.module, self.name)[0]
        return [(cls, "update_and_fetch", fetch_recorder(written)), (cls, "make_mask", recorder(note_mask))]

    def plan(self, call: HelperCall) -> Decline | Plan:
        cache = call.cache
        found = string_mask_decline(call) or fetch_decline(call.keys, call.values, cache, call.recorded, written)
        if found is not None:
            return found
        found = array_mask_decline(call, cache._idx) or blind_row_decline(call)
        if found is not None:
            return found
        length = buffer_rows(cache._idx)
        return Plan("attention", length, lambda: self.over_cut(call, length))

    def over_cut(self, call: HelperCall, length: int) -> Routed:
        """Each stream's arguments over the buffer cut to ``length`` rows (grown to them first)."""
        cache = call.cache
        grow(cache, length, call.recorded)
        extra = length - cache._idx
        keys, values = (first_rows(a, length) for a in (cache.keys, cache.values))
        return per_stream(call, keys, values, pad_last(call.mask, extra) if extra else call.mask)


__all__ = [
    "MADE_MASKS", "BatchKVCache", "array_mask_decline", "blind_row_decline", "evaluated_blind_row", "has_blind_row",
    "mask_note", "note_mask", "per_stream", "sees_every_row", "written",
]  # fmt: skip
