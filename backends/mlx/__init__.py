"""MLX backend facts and drop-in use.

- :func:`compile`: ``mx.compile`` with attnpass's pipeline in front, per input signature (:mod:`.compiled`);
- :func:`optimize`: an mlx-lm model's attention, and mlx-vlm Qwen4-Exp's QSA calls, through compiled attnpass
  programs (:mod:`.optimized`; one adapter per cache kind in :mod:`.caches`);
- :func:`sdpa_route` / :func:`sdpa_routes`: where MLX routes an SDPA call on Metal (:mod:`.metal_route`).
"""

from .compiled import compile
from .metal_route import Route, sdpa_route, sdpa_routes
from .optimized import OptimizedModel, optimize

__all__ = ["OptimizedModel", "Route", "compile", "optimize", "sdpa_route", "sdpa_routes"]
