"""benchmarks/maxtext_sparse.py end to end on a small cache (MaxText: .venv-jax-libraries only): both one-layer
MaxText models (DeepSeek-V3.2 DSA, Gemma-2 sliding window) decode one token over a cache filled to 4,096 keys under
plain ``jax.jit`` and attnpass's strict ``jit``; the logits agree within the float32 bound, and each row names what
the sparse passes did."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.util import requires

ROOT = Path(__file__).resolve().parent.parent.parent


@requires("jax", "maxtext")
def test_the_maxtext_sparse_benchmark_agrees_with_jax_jit_and_names_each_route():
    found = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "maxtext_sparse.py"), "--contexts", "4096", "--window", "1024",
         "--reps", "1"],
        check=False, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr[-3000:]
    rows = [line.split("|") for line in found.stdout.splitlines() if line.startswith(("| dsa ", "| window "))]
    assert len(rows) == 2, found.stdout
    for row in rows:
        assert float(row[7]) < 1e-5, row  # max |diff| / max |logit|, float32
        assert "dsa-gather" in row[8] and "block-sparse" in row[8], row  # applied or declined, by code
