"""Fixtures shared by every test; helpers live in :mod:`tests.util`."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240531)
