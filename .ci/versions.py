"""One line: the Python and key dependency versions this venv resolved (``-``: not installed)."""

import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

KEY = (
    "numpy", "ml_dtypes", "networkx", "safetensors", "mlx", "jax", "jaxlib", "mlx-lm", "mlx-vlm", "flax", "equinox",
    "torch", "transformers", "pytest", "hypothesis",
)  # fmt: skip


def resolved(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


versions = ", ".join(f"{name} {resolved(name)}" for name in KEY)
print(f"{Path(sys.prefix).name}: python {platform.python_version()}, {versions}")
