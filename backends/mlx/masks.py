"""The masks a route hands a program: a cache's valid rows, a mask padded over a buffer, a mask proven a structure.

:class:`Masks` keeps one model's last mask of each kind, since every layer of a step shares its mask: the valid
rows of a buffer cut (:meth:`Masks.valid`), a client's mask extended over the cut's padding rows
(:meth:`Masks.over_buffer`) and the proof that a bool mask is, on every one of its pairs, a causal kind with a
window or chunk (:meth:`Masks.structure`), which the program then takes as ``sdpa``'s ``causal`` and ``window``
attributes instead of the array. :func:`own_keys` plans a call over its own keys that way, :func:`masked` and
:func:`structured` make the attention programs' arguments.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnpass.passes.analysis.mask_structure import interval_structure

from .calls import Plan, Routed

Structure = tuple[str, "int | None", "int | None", "int | None"]  # (causal, left, right, chunk) of a sdpa
CAUSAL: Structure = ("bottom_right", None, None, None)  # MLX's "causal" string mask


def pad_last(mask: Any, count: int) -> Any:
    """``mask`` extended by ``count`` masked-out keys: False for bool masks, -inf for additive ones."""
    import mlx.core as mx

    fill = False if mask.dtype == mx.bool_ else float("-inf")
    return mx.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, count)], constant_values=fill)


class Masks:
    """One optimized model's masks, each kind remembered for the next layer of the same step."""

    def __init__(self) -> None:
        self._last_valid: tuple[tuple, Any] | None = None
        self._last_structure: tuple[Any, tuple[int, Structure] | None] | None = None

    def over_buffer(self, mask: Any, rows: int, n: int, length: int) -> Any:
        """The call's mask over a buffer of ``length`` rows whose first ``n`` are its keys: the valid rows (and
        causal, for ``"causal"``) when it has none, else its own padded with masked-out rows."""
        if mask is None or isinstance(mask, str):
            return self.valid(rows, n, length, causal=mask is not None)  # also when all valid: one signature
        return pad_last(mask, length - n) if length > n else mask

    def valid(self, rows: int, offset: int, length: int, *, causal: bool) -> Any:
        """bool ``[1, 1, rows|1, length]``: key ``j`` valid below ``offset``, and causal (bottom-right) if asked."""
        import mlx.core as mx

        key = (rows, offset, length, causal)
        last = self._last_valid
        if last is not None and last[0] == key:
            return last[1]
        positions = mx.arange(length)
        if causal:
            mask = positions[None] <= (offset - rows + mx.arange(rows))[:, None]
        else:
            mask = (positions < offset)[None]
        mask = mask[None, None]
        self._last_valid = (key, mask)
        return mask

    def structure(self, mask: Any, rows: int, keys: int) -> tuple[int, Structure] | None:
        """``(first, structure)`` when the bool ``mask`` is, on every one of its pairs, ``structure`` over the keys
        from ``first`` on (keys before are hidden from every row); None when it is no such structure.

        Each row's keys must be one interval (checked against the whole mask in MLX, one pass), every row must
        see one, and the intervals must be a causal kind's, window's or chunk's (:func:`interval_structure`)."""
        import mlx.core as mx

        last = self._last_structure
        if last is not None and last[0] is mask:
            return last[1]
        found = None
        if mask.size == rows * keys and mask.shape[-1] == keys:
            plane = mask.reshape(rows, keys)
            lo, count = mx.argmax(plane.astype(mx.uint8), axis=-1), plane.sum(axis=-1)
            j = mx.arange(keys)[None]
            one = mx.array_equal((j >= lo[:, None]) & (j < (lo + count)[:, None]), plane)
            lo, count = np.array(lo, np.int64), np.array(count, np.int64)
            if one.item() and (count > 0).all():
                first = int(lo.min())
                shape = interval_structure(lo - first, lo + count - first, keys - first)
                if not isinstance(shape, str) and (shape[0] != "none" or shape[1] is not None):
                    causal, window = shape
                    left, right, chunk = window if window is not None else (None, None, None)
                    found = first, (causal, left, right, chunk)
        self._last_structure = (mask, found)
        return found


def own_keys(call: Any) -> Plan:
    """The plan over the helper's own keys (a prefill, a windowed cache's step of several rows, a call without a
    cache): a ``"causal"`` mask, or a bool mask proven a causal kind with a window or chunk (:meth:`Masks.
    structure`), goes to the program as its structure; the keys before the first one any row sees are left out.
    Any other mask is passed as it is."""
    return Plan("attention", call.keys.shape[2], lambda: own_keys_routed(call))


def own_keys_routed(call: Any) -> Routed:
    """The arguments of :func:`own_keys`' plan."""
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


def structured(call: Any, keys: Any, values: Any, structure: Structure) -> Routed:
    """The structured attention program over ``keys``/``values``: the mask as ``sdpa``'s causal kind and window."""
    args = (call.queries, keys, values, call.sinks, call.scale, structure)
    return Routed("structured_attention", args, [a for a in args[:4] if a is not None])


def masked(call: Any, keys: Any, values: Any, mask: Any) -> Routed:
    """The attention program over ``keys``/``values`` with an array mask (or none)."""
    args = (call.queries, keys, values, mask, call.sinks, call.scale)
    return Routed("attention", args, [a for a in args[:5] if a is not None])


__all__ = ["CAUSAL", "Masks", "Structure", "masked", "own_keys", "own_keys_routed", "pad_last", "structured"]
