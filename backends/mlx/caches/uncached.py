"""A call of mlx-lm's helper without a cache: the keys are the call's own, nothing to prove about a buffer.

The program attends the call's keys (:func:`~.base.own_keys`): a ``"causal"`` mask or a bool mask proven a
causal kind with a window goes in as the ``sdpa``'s structure, so that ``block-sparse`` can tile it.
"""

from __future__ import annotations

from attnpass.passes import Decline

from .base import CacheAdapter, HelperCall, Routed, own_keys, register, string_mask_decline


@register
class Uncached(CacheAdapter):
    module, name = "builtins", "NoneType"

    def decline(self, call: HelperCall) -> Decline | None:
        return string_mask_decline(call)

    def route(self, call: HelperCall) -> Routed:
        return own_keys(call)

    def most_rows(self, call: HelperCall) -> int:
        return call.keys.shape[2]


__all__ = ["Uncached"]
