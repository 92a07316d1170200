"""The code is formatted as `ruff format` writes it (pyproject.toml's [tool.ruff]); CI fails otherwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.util import requires

ROOT = Path(__file__).resolve().parent.parent


@requires("ruff")
def test_ruff_format_leaves_every_file_as_it_is():
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert found.returncode == 0, f"run `ruff format .` (ruff pinned in the dev extra):\n{found.stdout}{found.stderr}"
