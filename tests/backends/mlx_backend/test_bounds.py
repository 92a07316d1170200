"""backends/mlx/bounds.py: the fewest key rows routed, as data; each decision a reason code with its figures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnpass.backends.mlx.bounds import MIN_KEYS, bound_decline, known_short, precision, too_short
from attnpass.ir import DType, TensorSpec, ops, trace
from attnpass.backends.mlx.reasons import ROUTER_REASONS
from attnpass.passes.analysis.devices import DEVICES

FLOATS = (DType.float32, DType.bfloat16, DType.float16)


def attention(dtype: DType, keys: int):
    """A rewritten attention program's result: queries first, the cut's keys second."""
    spec = TensorSpec((1, 2, 1, 8), dtype.value)
    kv = TensorSpec((1, 2, keys, 8), dtype.value)
    return SimpleNamespace(graph=trace(lambda q, k, v: ops.sdpa(q, k, v), spec, kv, kv))


def test_every_program_kind_and_float_precision_has_a_row():
    assert set(MIN_KEYS) == {(kind, dtype) for kind in ("float", "quantized") for dtype in FLOATS}


def test_the_bounds_are_the_cpu_rows_and_every_other_device_routes_every_depth():
    assert MIN_KEYS is DEVICES["cpu"].min_keys
    assert {name: dict(facts.min_keys) for name, facts in DEVICES.items() if name != "cpu"} == {
        "metal": {}, "gpu": {}, "tpu": {}
    }  # fmt: skip


@given(st.sampled_from(sorted(MIN_KEYS, key=str)), st.integers(0, 4096))
def test_a_bound_declines_exactly_the_calls_under_it_with_its_figures(row, rows):
    kind, dtype = row
    least = MIN_KEYS[row]
    found = bound_decline(kind, dtype, least, rows)
    if least is None:
        assert found.reason == "quantized_tie" and found.data == {"dtype": dtype.value}
    elif rows < least:
        assert found.reason == "short_context"
        assert found.data == {"rows": rows, "min_keys": least, "dtype": dtype.value}
        assert f"{rows} key rows, fewer than the {least}" in found.message
    else:
        assert found is None
    assert found is None or found.reason in ROUTER_REASONS


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
def test_a_signature_decides_once_and_later_shorter_calls_are_declined_before_their_arguments(dtype):
    bounds = {}
    hook = too_short("float", None, MIN_KEYS, bounds)
    least = MIN_KEYS["float", dtype]
    assert hook(attention(dtype, least)) is None
    assert bounds == {("float", dtype.value): (least, dtype)}
    assert known_short(bounds, "float", dtype.value, least - 1).reason == "short_context"
    assert known_short(bounds, "float", dtype.value, least) is None
    assert known_short(bounds, "quantized", dtype.value, 1) is None  # another kind: not decided yet
    assert hook(attention(dtype, least - 1)).data["rows"] == least - 1


def test_min_keys_given_replaces_the_table_and_zero_routes_every_depth():
    bounds = {}
    assert too_short("float", 0, MIN_KEYS, bounds)(attention(DType.float32, 1)) is None
    assert too_short("float", 64, MIN_KEYS, bounds)(attention(DType.float32, 63)).data["min_keys"] == 64
    assert too_short("float", None, {}, {})(attention(DType.float32, 1)) is None  # off CPU: the table is empty


def test_the_precision_is_the_queries_dtype_without_a_quantized_sdpa():
    assert precision(attention(DType.bfloat16, 4).graph) is DType.bfloat16
