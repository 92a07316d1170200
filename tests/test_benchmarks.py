"""The decode benchmark runs end to end on its quick settings (a benchmark that breaks at its summary measures
nothing): its table, the floor line and the optimized model's explanation are printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.util import requires

ROOT = Path(__file__).resolve().parent.parent


@requires("mlx.core", "mlx_lm")
def test_the_decode_benchmark_runs_to_its_summary():
    found = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "mlx_lm_decode.py"), "--quick", "--dtype", "float32"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr[-3000:]
    assert "minimum paired ratio" in found.stdout
    assert "float32: pipeline raise-attention," in found.stdout and "optimize(Model): routed" in found.stdout
