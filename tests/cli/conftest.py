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


@pytest.fixture(scope="session")
def saved_lm(tmp_path_factory):
    """(model, draft model) directories in mlx-lm's format: a 2-layer float32 tiny llama, a 1-layer one of another
    seed, each with an EOS it never generates (mlx-lm 0.31's server needs one), as real models have one (needs
    mlx-lm: use it from tests marked ``requires("mlx.core", "mlx_lm")``)."""
    from attnpass.models import save_tiny_lm

    root = tmp_path_factory.mktemp("saved_lm")
    return save_tiny_lm(root / "model", dtype="float32", eos=True), save_tiny_lm(
        root / "draft", dtype="float32", layers=1, seed=1, eos=True
    )
