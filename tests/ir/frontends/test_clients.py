"""Real clients: mlx-vlm's Qwen4ExpAttention (MLX) and a jax.nn.dot_product_attention layer (JAX).

Each is imported, raised to sdpa, head-chunked and lowered back; the program must
reproduce the client's own output and its primitive counts must show the
chunked subcalls. mlx-vlm is installed by ``make test`` (the ``clients`` extra);
without it those tests skip. No network: the model is random-initialised from a
config object with the real head geometry (24 query heads, 2 KV heads, head dim 256).
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import count_primitives, run
from attnpass.ir import from_jax, from_mlx
from attnpass.lowering import lower
from attnpass.passes import HeadChunkSDPA, PassManager, RaiseAttention, head_chunk_plan
from tests.util import lazy_import, requires

mx = lazy_import("mlx.core")
language = lazy_import("mlx_vlm.models.qwen4_exp.language")
vlm_config = lazy_import("mlx_vlm.models.qwen4_exp.config")
jax = lazy_import("jax")

HQ, HKV, HEAD_DIM, HIDDEN = 24, 2, 256, 64
PIPELINE = PassManager([RaiseAttention(), HeadChunkSDPA(enabled=True)])


def _sdpa_count(graph) -> int:
    return sum(1 for n in graph.nodes() if n.op == "sdpa")


# ----------------------------------------------------------------------------- mlx-vlm


@pytest.fixture(scope="module")
def qwen4_attention():
    config = vlm_config.TextConfig(
        model_type="qwen4_exp", hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=HQ,
        num_key_value_heads=HKV, head_dim=HEAD_DIM, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=2,
        num_experts_per_tok=1, shared_expert_intermediate_size=16, moe_intermediate_size=16, rms_norm_eps=1e-6,
        vocab_size=32, max_position_embeddings=4096, indexer_budget=16, indexer_compress_ratio=4,
    )  # fmt: skip
    mx.random.seed(7)
    attention = language.Qwen4ExpAttention(config)
    mx.eval(attention.parameters())
    return mx, language, attention


def _step(mx, language, attention, q_len: int, past: int):
    """A cache filled by a prefill of ``past`` tokens, and the step function of ``q_len`` new tokens."""
    cache = language.QSAKVCache()
    attention(mx.random.normal((1, past, HIDDEN)), mask="causal", cache=cache)
    state = cache.state[:4]  # keys, values, indexer keys, indexer positions
    mx.eval(state)

    def step(x, keys, values, index_keys, index_positions):
        fresh = language.QSAKVCache()
        fresh.state = (keys, values, index_keys, index_positions)
        return attention(x, mask="causal" if q_len > 1 else None, cache=fresh)

    return step, [mx.random.normal((1, q_len, HIDDEN)), *state]


@requires("mlx.core", "mlx_vlm")
@pytest.mark.parametrize("q_len, past", [(1, 8), (5, 8), (5, 40)], ids=["decode", "verify", "verify-sparse"])
def test_qwen4_exp_attention_round_trips_bit_exactly(qwen4_attention, q_len, past):
    mx, language, attention = qwen4_attention
    step, args = _step(mx, language, attention, q_len, past)
    imported = from_mlx(step, *args)
    traced = []
    counted = mx.compile(lambda a: traced.append(1) or a + 1)
    counted(args[0]), counted(args[0])
    assert traced == [1]  # the import (which exports with compilation off) turned compilation back on
    result = PIPELINE.run(imported.graph)
    plan = head_chunk_plan(q_len, HQ, HKV)
    chunks = plan[1] if plan else 1
    assert _sdpa_count(result.graph) == chunks
    assert [r.rule for r in result.applied() if r.rule in ("softmax", "attention")] == ["attention"]
    program = lower(result.graph, "mlx")
    np.testing.assert_array_equal(run(program, *args, **imported.params), np.array(step(*args)))
    counts = count_primitives(program, *args, **imported.params)
    assert counts["Softmax"] == chunks  # one unfused fallback per subcall on CPU
    assert count_primitives(lower(imported.graph, "mlx"), *args, **imported.params)["Softmax"] == 1


# ----------------------------------------------------------------------------- a JAX layer


@requires("jax", "mlx.core")
def test_jax_attention_layer_round_trips_through_jax_and_mlx(rng):
    s, t = 5, 13
    wq = (rng.standard_normal((HIDDEN, HQ * HEAD_DIM)) / 8).astype(np.float32)
    wk = (rng.standard_normal((HIDDEN, HKV * HEAD_DIM)) / 8).astype(np.float32)
    wv = (rng.standard_normal((HIDDEN, HKV * HEAD_DIM)) / 8).astype(np.float32)
    wo = (rng.standard_normal((HQ * HEAD_DIM, HIDDEN)) / 64).astype(np.float32)

    def layer(x, memory, mask):
        q = (x @ wq).reshape(1, s, HQ, HEAD_DIM)
        k = (memory @ wk).reshape(1, t, HKV, HEAD_DIM)
        v = (memory @ wv).reshape(1, t, HKV, HEAD_DIM)
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=HEAD_DIM**-0.5)
        return out.reshape(1, s, HQ * HEAD_DIM) @ wo

    x = rng.standard_normal((1, s, HIDDEN)).astype(np.float32)
    memory = rng.standard_normal((1, t, HIDDEN)).astype(np.float32)
    mask = np.tril(np.ones((s, t), bool), k=t - s)[None, None]
    imported = from_jax(layer, x, memory, mask)
    assert len(imported.params) == 4  # the projection weights travel as resident inputs
    result = PIPELINE.run(imported.graph)
    assert _sdpa_count(result.graph) == head_chunk_plan(s, HQ, HKV)[1] == 4
    expected = np.asarray(layer(x, memory, mask))
    for target in ("jax", "mlx"):
        program = lower(result.graph, target)
        np.testing.assert_allclose(run(program, x, memory, mask, **imported.params), expected, rtol=2e-5, atol=2e-5)
    mlx_counts = count_primitives(lower(result.graph, "mlx"), x, memory, mask, **imported.params)
    assert mlx_counts["Softmax"] == 4
