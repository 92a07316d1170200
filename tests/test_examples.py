"""The newcomer's first script runs end to end and its outputs match the reference."""

from __future__ import annotations

import numpy as np

from tests.util import load_example, requires

demo = load_example("qwen38_attention")


@requires("mlx.core", "jax")
def test_demo_runs_and_prints_ir_and_counts(capsys):
    demo.main(q_len=5, kv_len=64)
    out = capsys.readouterr().out
    assert "graph attention(q:bf16[1,24,5,256]" in out
    assert "mx.fast.scaled_dot_product_attention" in out
    assert "jax.nn.dot_product_attention" in out
    assert "mlx primitives: {" in out and "'Softmax': 1" in out
    assert "jax primitives: {" in out and "'exp': 1" in out
    before, after = out.split("== after HeadChunkSDPA ==")
    assert "predicted Metal route of sdpa: fallback" in before
    # q_len 5, gqa 12: plan (6, 4) -> 4 subcalls of 6 heads, each on the vector kernel
    assert after.count("= sdpa[") == 4 and "concat[axis=1]" in after
    assert "'Softmax': 4" in after and "'exp': 4" in after
    assert after.count(": vector (") == 4


def test_demo_mask_is_bottom_right_causal():
    *_, mask = demo.example_inputs(q_len=3, kv_len=6)
    expected = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(mask[0, 0], expected)
