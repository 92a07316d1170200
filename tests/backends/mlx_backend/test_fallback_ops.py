"""The router's ``fallback_ops`` decline: on CPU a float32 program that would be only MLX's CPU fallback's own ops
(decompose-sdpa's fused rounding, no rewrite that cuts work) runs mlx-lm's helper instead, at every depth: the
helper computes the same ops over the valid keys, the program over the buffer's longer cut (docs/benchmarks.md,
"Float32 decode on CPU"). bfloat16 keeps the route (the GQA fold is faster there), a float32 program that cuts work
(block-sparse's causal tiles) keeps it too, and an explicit ``min_keys`` replaces the measured decision."""

from __future__ import annotations

import io

import numpy as np
import pytest

from tests.util import assert_bits_equal, lazy_import, requires

pytestmark = requires("mlx", "mlx_lm")
mx = lazy_import("mlx.core")

HEADS, KV_HEADS, DIM = 4, 2, 64


def raw(a) -> np.ndarray:
    """The raw bits (bfloat16 as uint16)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def decode(keys: int, dtype, min_keys: int | None = None):
    """One decode step over ``keys`` keys of a ``KVCache`` under ``optimize`` with the device's own pipeline: the
    optimized probe's output, mlx-lm's helper's on the same arrays, the handle and the signature's entry."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache

    from attnpass.backends.mlx import optimize
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe

    mx.random.seed(keys)
    probe, kv = Probe(), KVCache()
    kv.update_and_fetch(*mx.random.normal((2, 1, KV_HEADS, keys - 1, DIM)).astype(dtype))
    q = mx.random.normal((1, HEADS, 1, DIM)).astype(dtype)
    k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM)).astype(dtype)
    with optimize(probe, strict=True, min_keys=min_keys) as opt:
        out = probe(q, k, v, kv)
    received, values, _ = probe.received
    expected = base.scaled_dot_product_attention(q, received, values, cache=kv, scale=SCALE, mask=None)
    (entry,) = opt.programs["attention"].specializations
    return out, expected, opt, entry


def test_only_the_cpu_row_declines_the_fallbacks_ops_and_only_in_float32():
    from attnpass.ir import DType
    from attnpass.passes.analysis.devices import DEVICES

    assert {name: set(facts.fallback_declined) for name, facts in DEVICES.items()} == {
        "cpu": {DType.float32}, "metal": set(), "gpu": set(), "tpu": set()
    }  # fmt: skip


@pytest.mark.parametrize("keys", [193, 1000, 4100])
def test_a_float32_decode_call_of_only_the_fallbacks_ops_is_declined_at_every_depth(keys):
    out, expected, opt, entry = decode(keys, mx.float32)
    assert_bits_equal(raw(out), raw(expected))  # mlx-lm's helper itself
    assert opt.routed == 0 and opt.declined == {"fallback_ops": 1}
    assert entry.declined.reason == "fallback_ops" and entry.declined.data == {"dtype": "float32"}
    assert entry.program is None and not entry.compiled
    remarks = [r for r in entry.remarks if r.pass_name == "decompose-sdpa" and r.kind == "applied"]
    assert [r.data for r in remarks] == [{"rounding": "fused", "dtype": "float32"}]
    text = io.StringIO()
    opt.explain(file=text)
    assert (
        "declined fallback_ops x1: a float32 call whose program would be MLX's own CPU fallback ops" in text.getvalue()
    )
    # an explicit min_keys replaces the measured decision: routed, still mlx-lm's bits
    out, expected, opt, entry = decode(keys, mx.float32, min_keys=0)
    assert opt.routed == 1 and not opt.declined and entry.compiled
    assert_bits_equal(raw(out), raw(expected))


@pytest.mark.parametrize("keys", [193, 4100])
def test_a_bfloat16_decode_call_keeps_its_route(keys):
    out, expected, opt, entry = decode(keys, mx.bfloat16)
    assert opt.routed == 1 and not opt.declined and entry.compiled
    assert_bits_equal(raw(out), raw(expected))


def test_a_float32_program_that_cuts_work_is_routed():
    """A causal prefill of 1,024 rows: block-sparse leaves out the key tiles above the diagonal, so the program is
    not the fallback's ops and the call is routed in float32."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache

    from attnpass.backends.mlx import optimize
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe

    rows = 1024
    probe, kv = Probe(), KVCache()
    q = mx.random.normal((1, HEADS, rows, DIM))
    k, v = mx.random.normal((2, 1, KV_HEADS, rows, DIM))
    with optimize(probe, strict=True) as opt:
        out = probe(q, k, v, kv, "causal")
    assert opt.routed == 1 and not opt.declined
    [entry] = [e for c in opt.programs.values() for e in c.specializations]
    assert any(r.pass_name == "block-sparse" and r.kind == "applied" for r in entry.remarks)
    received, values, _ = probe.received
    expected = base.scaled_dot_product_attention(q, received, values, cache=kv, scale=SCALE, mask="causal")
    np.testing.assert_allclose(np.array(out), np.array(expected), rtol=0, atol=1e-5)
