"""The dtype sweep (examples/mlx_lm_dtypes.py) and its committed table (docs/mlx_lm_dtypes.md).

The table lists every family of the installed mlx-lm in float16, bfloat16 and float32; a fixed fast subset is
rerun here and must end, in every dtype, with the status the table records, so a regression or an improvement
shows up as a failing test (then ``make zoo-dtypes``). The comparison is checked on its own: one differing bit
fails, a bound holds only where a routed program states one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.util import lazy_import, load_example, requires

dtypes = load_example("mlx_lm_dtypes")
mx = lazy_import("mlx.core")
TABLE = Path(__file__).resolve().parents[2] / "docs" / "mlx_lm_dtypes.md"

# Seconds in all: dense GQA, float32 queries over half-float keys and values (phi, stablelm, cohere2: its
# sliding-window layers rotate), an MoE with attention sinks, MLA (its calls declined), DSA (routed within its bound
# in float16 and float32), and two declines: no module calls mlx-lm's helper, a Metal kernel.
SUBSET = ("llama", "phi", "stablelm", "cohere2", "gpt_oss", "deepseek_v3", "deepseek_v32", "gemma2", "bitnet")

mlx_lm_only = requires("mlx.core", "mlx_lm")


@mlx_lm_only
def test_the_table_lists_every_installed_family_in_every_dtype():
    found, _skipped = dtypes.sweep.families()
    statuses = dtypes.committed(TABLE)
    assert list(statuses) == [(f, d) for f in found for d in dtypes.DTYPES], "run `make zoo-dtypes`"
    assert set(statuses.values()) <= set(dtypes.STATUSES)


@mlx_lm_only
@pytest.mark.parametrize("family", SUBSET)
def test_a_family_reaches_the_status_the_table_records_in_each_dtype(family):
    recorded = dtypes.committed(TABLE)
    records = dtypes.run_family(family)
    assert [r["dtype"] for r in records] == list(dtypes.DTYPES)
    for record in records:
        assert record["status"] == recorded[family, record["dtype"]], f"{family}/{record['dtype']}: {record['reason']}"
        if record["status"] == "handled":
            cells = [record["steps"][step] for step in dtypes.STEPS]
            assert all(c in ("identical", "n/a") or c.startswith("within ") for c in cells), cells
    if family == "deepseek_v32":  # DSA's latent form: not bit for bit where its last bits show
        assert [r["steps"]["cache"].split(" (")[0] for r in records] == ["within 0.02", "identical", "within 1e-05"]


@mlx_lm_only
def test_one_differing_bit_fails_and_a_bound_holds_only_where_stated():
    plain = mx.array([1.0, -2.0, 3.0], dtype=mx.float16)
    bumped = (plain.view(mx.uint16) + mx.array([0, 1, 0], dtype=mx.uint16)).view(mx.float16)  # one ulp, one element
    assert dtypes.compare([plain], [plain], {}) == ("identical", "")
    cell, failure = dtypes.compare([plain, bumped], [plain, plain], {})
    assert cell == "**FAIL**" and failure.startswith("output 1: 1 of 3 element(s) differ") and "bit for bit" in failure
    assert dtypes.compare([bumped], [plain], {"float16": 2e-2}) == ("within 0.02 (max 0.002)", "")  # 2**-9 at 2
    assert dtypes.compare([bumped], [plain], {"bfloat16": 2e-2})[0] == "**FAIL**"  # a bound for another dtype
    assert dtypes.compare([plain], [plain, plain], {})[1] == "1 outputs where the plain model gives 2"


def _record(family, dtype, status, reason=""):
    steps = dict.fromkeys(dtypes.STEPS, "identical" if status == "handled" else "**FAIL**")
    return dict(family=family, dtype=dtype, status=status, reason=reason, steps=steps, routed=3, declined={"x": 1})


@mlx_lm_only
def test_the_table_round_trips_each_status_and_counts_them_per_dtype(tmp_path):
    statuses = {"float16": "failed", "bfloat16": "declined", "float32": "handled"}
    records = [_record("a", d, s, "r|s" if s != "handled" else "") for d, s in statuses.items()]
    text = dtypes.table(records, "make zoo-dtypes", 60.0, (1.5, 2.0))
    (tmp_path / "t.md").write_text(text)
    assert dtypes.committed(tmp_path / "t.md") == {("a", d): s for d, s in statuses.items()}
    assert "float16: 0 handled, 0 declined, 1 failed; bfloat16: 0 handled, 1 declined, 0 failed" in text
    assert "load average 1.5 at the start, 2.0 at the end" in text
    assert "| `a` | float16 | failed | **FAIL** | **FAIL** | **FAIL** | 3 | x 1 | r\\|s |" in text
    assert "| `a` | float32 | handled | identical | identical | identical | 3 | x 1 |  |" in text


def test_steps_with_the_same_reason_are_named_together():
    assert dtypes._joined([("cache", "A"), ("no cache", "B"), ("rotating", "A")]) == "cache, rotating: A; no cache: B"
    assert dtypes._joined([]) == ""


@mlx_lm_only
def test_a_check_error_under_optimize_fails_the_dtype_and_is_quoted_whole(monkeypatch):
    """llama routes its decode steps (its 80-row calls are declined fused_kernel_serves), so its cache step fails."""
    import attnpass.backends.mlx.optimized as optimized

    monkeypatch.setattr(optimized, "difference", lambda out, expected, numerics: "planted")  # every routed call
    record = dtypes.run_dtype("llama", "float32")
    assert record["status"] == "failed" and record["steps"]["cache"] == "**FAIL**"
    assert record["reason"].startswith("cache: CheckError: optimize(check=True): the attention call of model.layers.0.")
    assert record["reason"].endswith(": planted")
