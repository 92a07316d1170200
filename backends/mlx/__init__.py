"""MLX backend facts and drop-in use.

- :func:`compile`: ``mx.compile`` with attnpass's pipeline in front, per input signature (:mod:`.compiled`);
- :func:`sdpa_route` / :func:`sdpa_routes`: where MLX routes an SDPA call on Metal (:mod:`.route`).
"""

from .compiled import compile
from .route import Route, sdpa_route, sdpa_routes

__all__ = ["Route", "compile", "sdpa_route", "sdpa_routes"]
