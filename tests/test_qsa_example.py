"""The QSA decode example: traced at n_kv = 141,312, rewritten, the signature and bytes it reports."""

from __future__ import annotations

import pytest

from attnpass.ir import DType, TensorType
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, gather_pipeline
from tests.util import load_example, requires

example = load_example("qwen38_qsa_decode")

N_KV = 141_312
SMALL = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=32, mask_rows=4, rotary_dim=8)


def test_traffic_at_depth_drops_the_padded_mask_to_one_row(capsys):
    before, after = example.traffic(QSAConfig(), N_KV)
    mask_full, mask_row = 64 * N_KV * 2, N_KV * 2
    small = 24 * 256 * 4 + 4 * 128 * 4 + 4  # q, idx_q, positions
    assert (before, after) == (small + mask_full, small + mask_row) == (18_114_564, 309_252)
    out = capsys.readouterr().out
    assert "qsa_mask:bool[1,1,1,141312]" in out  # the masked graph
    assert (
        "sdpa_gather:f32[1,24,1,256] = sdpa[scale=0.0625, causal='none'] q k_gathered v_gathered mask=gather_mask"
        in out
    )
    assert "[narrow-inputs] applied mask:" in out and "18087936 -> 282624 bytes per call" in out
    assert "  mask: f16[1,1,141312] (streamed)" in out


def test_lowered_signature_says_what_a_caller_provides():
    graph = gather_pipeline().run(build_layer(QSAConfig(), N_KV)).graph
    signature = lower(graph, "numpy").signature()
    assert [(name, role) for name, _, role in signature] == [
        ("q", "streamed"), ("k_cache", "resident"), ("v_cache", "resident"), ("idx_q", "streamed"),
        ("idx_keys", "resident"), ("idx_q_norm", "resident"), ("idx_k_norm", "resident"),
        ("rope_cos", "resident"), ("rope_sin", "resident"), ("positions", "streamed"), ("mask", "streamed"),
    ]  # fmt: skip
    assert dict((n, t) for n, t, _ in signature)["mask"] == TensorType((1, 1, N_KV), DType.float16)
    assert sum(t.nbytes for _, t, role in signature if role == "streamed") == graph.input_nbytes() == 309_252


@requires("mlx.core", "jax")
def test_numerics_agree_on_every_target():
    errors = example.numerics(SMALL, 96)
    assert set(errors) == {f"{t} {p}" for t in ("numpy", "mlx", "jax") for p in ("masked", "gather")}
    assert max(errors.values()) <= example.TOLERANCE


def test_bad_configurations_are_rejected():
    with pytest.raises(ValueError, match="ratio=3 does not divide the budget 2048"):
        QSAConfig(ratio=3)
    with pytest.raises(ValueError, match="do not fit the padded mask's 64 rows"):
        build_layer(QSAConfig(), 1024, rows=65)
