"""A call of an attention helper without a cache: the keys are the call's own, nothing to prove about a buffer.

The program attends the call's keys (:func:`~.base.own_keys`): a ``"causal"`` mask or a bool mask proven a
causal kind with a window goes in as the ``sdpa``'s structure, so that ``block-sparse`` can tile it.
"""

from __future__ import annotations

from attnpass.passes import Decline

from ..calls import string_mask_decline
from ..masks import own_keys
from .base import CacheAdapter, HelperCall, Plan, register


@register
class Uncached(CacheAdapter):
    module, name = "builtins", "NoneType"

    def plan(self, call: HelperCall) -> Decline | Plan:
        return string_mask_decline(call) or own_keys(call)


__all__ = ["Uncached"]
