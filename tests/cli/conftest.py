"""Fixtures shared by the CLI tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from attnpass.cli.main import main


@pytest.fixture
def cli(capsys) -> Callable[..., tuple[int, str, str]]:
    """Run ``attnpass ARGS`` in process: (exit status, stdout, stderr)."""

    def call(*argv) -> tuple[int, str, str]:
        status = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return status, out, err

    return call
