"""Against mlx-lm's own math: DeepseekV3Attention and DeepseekV32Attention with more than one query row.

Each module (tiny config, random weights) runs a call of ``L`` rows on a cache filled by an earlier call. The
same call's attention core is the traced expanded form (tests/passes/rewrites/mla_graphs.py, the form the
router traces: docs/mla.md), rewritten by the cpu wrapper pipeline with the router's promises, lowered to MLX
and fed what the module computes before its attention (the nope queries, the cache's latent, the rope scores
under the model's causal mask and, for V3.2, the indexer's top-k); the module's ``o_proj`` of the result must be
the module's own output within the bound (test_mla_absorb.BOUND).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnpass.ir import DType
from attnpass.lowering import lower
from attnpass.passes import DSAGather, MLAAbsorb, PassManager, default_pipeline
from tests.passes.rewrites.mla_graphs import Geometry, mla_graph
from tests.passes.rewrites.test_mla_absorb import BOUND, PROMISED, relative
from tests.util import lazy_import, requires

pytestmark = requires("mlx.core", "mlx_lm")
mx = lazy_import("mlx.core")
v3 = lazy_import("mlx_lm.models.deepseek_v3")
v32 = lazy_import("mlx_lm.models.deepseek_v32")
base = lazy_import("mlx_lm.models.base")
cache_lib = lazy_import("mlx_lm.models.cache")

CONFIG = dict(
    vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    v_head_dim=8, qk_nope_head_dim=8, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
)  # fmt: skip
DSA = dict(index_head_dim=8, index_n_heads=2, index_topk=4)
PREFIX, ROWS = 12, 3  # a call of 3 rows over 15 cached cells: more than index_topk, so V3.2 selects


def _module(dsa: bool, dtype):
    mx.random.seed(0)
    if dsa:
        attn = v32.DeepseekV32Attention(v32.ModelArgs(model_type="deepseek_v32", **CONFIG, **DSA))
        cache = cache_lib.CacheList(cache_lib.KVCache(), cache_lib.KVCache())
    else:
        attn = v3.DeepseekV3Attention(v3.ModelArgs(model_type="deepseek_v3", **CONFIG))
        cache = cache_lib.KVCache()
    attn.set_dtype(dtype)
    return attn, cache


def _attention_inputs(attn, x, mask, cache, dsa: bool) -> dict:
    """What the module computes before its attention call (its own code, step by step)."""
    b, rows, _ = x.shape
    qr = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(qr).reshape(b, rows, attn.num_heads, attn.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    latent, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(b, rows, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(attn.kv_a_layernorm(latent), axis=1)
    kv = cache[0] if dsa else cache
    q_pe, k_pe = attn.rope(q_pe, kv.offset), attn.rope(k_pe, kv.offset)
    latent, k_pe = kv.update_and_fetch(latent, k_pe)
    scores = (q_pe * attn.scale) @ k_pe.swapaxes(-1, -2)
    inputs = {
        "q": q_nope, "latent": latent, "w_uk": attn.embed_q.weight, "w_uv": attn.unembed_out.weight,
        "mask": mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype)),
    }  # fmt: skip
    if dsa:
        inputs["idx"] = attn.indexer(x, qr, mask, cache=cache[1]).astype(mx.int32)
    return inputs


def _pipeline(absorb: bool) -> list:
    """The cpu wrapper pipeline with the router's promises (absorbed, or the expansion kept)."""
    factor = {"crossover_factor": 1e6 if absorb else 1e-6}
    promised = {MLAAbsorb: {**PROMISED, **factor}, DSAGather: PROMISED}
    passes = default_pipeline("cpu", keep_signature=True, target="mlx")
    return [dataclasses.replace(p, **promised[type(p)]) if type(p) in promised else p for p in passes]


@pytest.mark.parametrize("absorb", [True, False], ids=["absorbed", "expanded"])
@pytest.mark.parametrize("dsa", [True, False], ids=["deepseek_v32", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=lambda d: d.short)
def test_the_rewritten_program_computes_the_modules_attention(dsa, absorb, dtype):
    native = getattr(mx, dtype.value)
    attn, cache = _module(dsa, native)
    mine = _module(dsa, native)[1]
    rng = np.random.default_rng(0)
    prefix = mx.array(rng.standard_normal((1, PREFIX, 32)).astype(np.float32)).astype(native)
    for c in (cache, mine):  # the same earlier call fills both caches
        mx.eval(attn(prefix, base.create_attention_mask(prefix, c[0] if dsa else c, return_array=True), c))
    x = mx.array(rng.standard_normal((1, ROWS, 32)).astype(np.float32)).astype(native)
    mask = base.create_attention_mask(x, cache[0] if dsa else cache, return_array=True)
    want = attn(x, mask, cache)

    inputs = _attention_inputs(attn, x, mask, mine, dsa)
    top_k = DSA["index_topk"] if dsa else None
    g = Geometry(b=1, h=4, rows=ROWS, t=PREFIX + ROWS, r=16, dn=8, dv=8, top_k=top_k, dtype=dtype, scale=attn.scale)
    graph = mla_graph(g)
    result = PassManager(_pipeline(absorb)).run(graph)
    applied = {r.pass_name for r in result.applied()}
    assert ("mla-absorb" in applied) == absorb and ("dsa-gather" in applied) == dsa
    assert result.graph.inputs == graph.inputs  # the signature the router calls with
    out = lower(result.graph, "mlx")(**inputs)
    got = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, ROWS, -1))
    assert relative(np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32))) <= BOUND[dtype]
