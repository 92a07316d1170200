"""The lowering package's error: a graph that cannot be lowered to the requested target."""

from __future__ import annotations

from attnpass.ir import AttnpassError


class LoweringError(AttnpassError):
    """A graph cannot be lowered to the requested target."""
