"""The drop-in tests run in ``optimize``'s shadow mode: every routed call is also computed by the client's
function, and a difference beyond the program's stated numerics raises (``optimize(check=None)`` reads
:data:`~attnpass.backends.mlx.check.CHECK_ENV`)."""

from __future__ import annotations

import pytest

from attnpass.backends.mlx.check import CHECK_ENV


@pytest.fixture(autouse=True)
def shadow_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_ENV, "1")
