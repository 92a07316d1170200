"""Benchmarks run end to end on small settings (a benchmark that breaks at its summary measures nothing): the
decode benchmark prints its table, floor line and explanation; the indexer and row-loop benchmarks their bit-for-bit
verdicts; the speculative one its identical tokens with calls routed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import requires

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(script: str, *args: str) -> str:
    """The stdout of ``benchmarks/<script>`` run with ``args``, which must exit 0 within 10 minutes."""
    found = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True, timeout=600
    )
    assert found.returncode == 0, found.stderr[-3000:]
    return found.stdout


def speculative_row(stdout: str, context: int) -> str:
    """The float32 row of the speculative benchmark's table at ``context``, its tokens identical, calls routed."""
    [row] = [line for line in stdout.splitlines() if line.startswith(f"| float32 | {context} |")]
    assert "| identical |" in row and "DIFFERENT" not in stdout, stdout
    assert int(row.rsplit("|", 2)[-2].split("/")[0]) > 0, row  # routed calls
    return row


@requires("mlx.core", "mlx_lm")
def test_the_decode_benchmark_runs_to_its_summary():
    out = run_benchmark("mlx_lm_decode.py", "--quick", "--dtype", "float32")
    assert "minimum paired ratio" in out
    assert "float32: pipeline raise-attention," in out and "optimize(Model): routed" in out


@requires("mlx.core")
def test_the_indexer_benchmark_finds_the_tiled_form_bit_for_bit():
    out = run_benchmark("dsa_indexer.py", "--rows", "4", "--context", "4100", "--tile", "1024", "--reps", "1")
    assert "tiled scores bit for bit the model form's: True; top-2048 identical: True" in out


@requires("mlx.core", "mlx_lm", "mlx_vlm")
def test_the_sparse_layer_benchmark_routes_both_families_within_the_gathered_bound():
    """One 4-row call per family at 4,096 keys (above the 2,048 each row keeps): every optimized call routed, the
    outputs within the gathered programs' float32 bound."""
    out = run_benchmark("sparse_layers.py", "--contexts", "4096", "--rows", "4", "--reps", "1")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| minimax_m3") or
            line.startswith("| longcat")]  # fmt: skip
    assert len(rows) == 2 and all(float(row[8]) < 1e-5 for row in rows)
    assert "minimax_m3 float32: routed 2, declined {}" in out
    assert "longcat float32: routed 2, declined {}" in out


@requires("mlx.core", "mlx_lm", "mlx_vlm")
def test_the_row_loop_benchmark_batches_glm5_nexts_rows_bit_for_bit():
    out = run_benchmark(
        "row_loop.py", *"--contexts 2048 --heads 2 --rows 2 4 --reps 1 --dtype float32 bfloat16".split()
    )
    assert out.count("bit for bit") == 4 and "DIFFERENT" not in out, out


@requires("mlx.core", "mlx_lm")
def test_the_speculative_benchmark_gives_minimax_m3s_own_tokens_with_its_sparse_calls_routed():
    out = run_benchmark(
        "sparse_speculative.py", "--contexts", "2048", "--tokens", "4", "--reps", "1", "--hidden", "256"
    )
    speculative_row(out, 2048)


@requires("mlx.core", "mlx_lm", "mlx_vlm")
@pytest.mark.parametrize("family", ["longcat", "hy_v4"])
def test_the_speculative_benchmark_gives_the_mlx_vlm_sparse_models_own_tokens_with_their_calls_routed(family):
    """2,304 keys: above the 2,048 each row keeps, so every indexer call selects (the models attend densely up to
    it)."""
    out = run_benchmark(
        "sparse_speculative.py", "--family", family, *"--contexts 2304 --tokens 4 --reps 1 --hidden 256".split()
    )
    assert f"; {family} (" in out, out
    speculative_row(out, 2304)
