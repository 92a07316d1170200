"""Optional dependencies: an entry point that needs one imports it through :func:`import_extra`, so that its
absence is one :class:`MissingExtraError` naming the entry point and the pyproject extras that install it."""

from __future__ import annotations

import importlib
from types import ModuleType

from .types import AttnpassError


class MissingExtraError(AttnpassError, ImportError):
    """An entry point needs an optional dependency that does not import (an ImportError too, so code that
    catches a missing module still catches it)."""


def import_extra(module: str, where: str, extras: str) -> ModuleType:
    """``module`` imported, else a MissingExtraError: ``tiny_lm needs mlx_lm.models.llama, from the extras
    mlx,zoo: pip install "attnpass[mlx,zoo]" (No module named 'mlx_lm')``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f'{where} needs {module}, from the extras {extras}: pip install "attnpass[{extras}]" ({exc})'
        ) from None


__all__ = ["MissingExtraError", "import_extra"]
