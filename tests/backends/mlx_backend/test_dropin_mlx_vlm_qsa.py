"""``optimize`` on mlx-vlm's Qwen4-Exp (backends/mlx/caches/qsa.py): QSA calls gathered over the model's own selection.

A tiny random ``qwen4_exp.language.LanguageModel`` with the real structure
(hybrid layers: three Gated-DeltaNet layers then a QSA layer, twice; the QSA
indexer; budget 16 tokens at ratio 4, so past 20 tokens the selection is
sparse) decodes greedily with its own caches, plainly and under ``optimize``:
the tokens must be the same, every prefill, decode and verify call routed
through a gather program (counted; the prefill through qsa-gather's tiles, its
logits within 1e-4 in float32, and declined by name with a pipeline whose
qsa-gather has no prefill tile), a 5-row verify step's logits within 1e-4, and a speculative verify
rolled back (the caches trimmed) must go on decoding the same tokens. With the QSA caches quantized
(``QSAQuantizedKVCache``, 8 bits) every decode and verify call gathers the selected cells' packed rows and
decodes the plain model's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.util import assert_bits_equal, lazy_import, requires

pytestmark = requires("mlx.core", "mlx_vlm")

mx = lazy_import("mlx.core")
language = lazy_import("mlx_vlm.models.qwen4_exp.language")
vlm_config = lazy_import("mlx_vlm.models.qwen4_exp.config")

PROMPT, STEPS, QSA_LAYERS, VOCAB = 40, 10, 2, 64


PREFILL_KEPT = "too_many_rows"  # qsa-gather's own code for a prefill it keeps masked


@pytest.fixture(scope="module")
def model():
    config = vlm_config.TextConfig(
        model_type="qwen4_exp", hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=2, num_experts_per_tok=1,
        shared_expert_intermediate_size=16, moe_intermediate_size=16, rms_norm_eps=1e-6, vocab_size=VOCAB,
        max_position_embeddings=4096, indexer_budget=16, indexer_compress_ratio=4, indexer_head_dim=32, hc_lowrank=8,
    )  # fmt: skip
    assert config.layer_types.count("qwen_sparse_attention") == QSA_LAYERS
    full = vlm_config.ModelConfig(text_config=config, vision_config=vlm_config.VisionConfig(), model_type="qwen4_exp")
    mx.random.seed(3)
    lm = language.LanguageModel(config, full)
    mx.eval(lm.parameters())
    return lm


def _prompt(length: int = PROMPT):
    return mx.array(np.random.default_rng(0).integers(0, VOCAB, (1, length)), dtype=mx.int32)


def _greedy(lm, cache, token, steps: int) -> list[int]:
    """``steps`` greedy decode steps from ``token`` with the model's own cache (single-token calls)."""
    out = []
    for _ in range(steps):
        out.append(token)
        logits = lm(mx.array([[token]], dtype=mx.int32), cache=cache).logits
        token = int(mx.argmax(logits[0, -1]).item())
    return out


def _chunked_prefill(lm, after, length: int = 300, step: int = 64):
    """A ``length``-token prompt prefilled as ``mlx_vlm.generate`` does, in chunks of ``step`` tokens over the
    growing caches (``after(cache)`` returns the caches the next chunk uses), then 4 greedy tokens: the chunks'
    logits and the tokens."""
    prompt, cache, logits = _prompt(length), lm.make_cache(), []
    for s in range(0, length, step):
        logits.append(np.array(lm(prompt[:, s : s + step], cache=cache).logits))
        cache = after(cache)
    return np.concatenate(logits, axis=1), _greedy(lm, cache, int(np.argmax(logits[-1][0, -1])), 4)


def _run(lm, prompt: int = PROMPT):
    """Prefill, greedy decode, then a 5-row verify step's logits (plain model call) and the tokens after it."""
    cache = lm.make_cache()
    first = int(mx.argmax(lm(_prompt(prompt), cache=cache).logits[0, -1]).item())
    tokens = _greedy(lm, cache, first, STEPS)
    verify = lm(mx.array([tokens[-5:]], dtype=mx.int32), cache=cache).logits
    return tokens, np.array(verify), cache


@pytest.mark.parametrize("prompt", [PROMPT, 12], ids=["sparse-from-the-prompt", "crossing-the-budget"])
def test_greedy_tokens_and_a_verify_step_match_the_plain_model_with_every_qsa_call_routed(model, prompt):
    from mlx_vlm.models.qwen4_exp import qsa_kernel

    from attnpass.backends.mlx import optimize

    tokens, verify, plain = _run(model, prompt)
    with optimize(model) as opt:
        got, got_verify, cache = _run(model, prompt)
    assert got == tokens
    # the indexer's keys and positions, appended in place into buffers: the model's concatenation, bit for bit in
    # the first QSA layer (its inputs are the plain model's); the second one's keys follow the first's routed output
    for layer in (3, 7):
        assert cache[layer]._attnpass_index.length == cache[layer].offset
        assert "_attnpass_index" not in vars(plain[layer])
        assert_bits_equal(np.array(cache[layer].index_position_ids), np.array(plain[layer].index_position_ids))
    assert_bits_equal(np.array(cache[3].index_keys), np.array(plain[3].index_keys))
    np.testing.assert_allclose(np.array(cache[7].index_keys), np.array(plain[7].index_keys), rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_verify, verify, rtol=0, atol=1e-4)
    # per QSA layer: the decode calls past the budget (more than 4 complete blocks: below it the indexer selects
    # nothing and the layer attends densely, no QSA call), the verify call and the prefill (tiled) are routed
    sparse_decodes = sum(1 for keys in range(prompt + 1, prompt + STEPS + 1) if keys // 4 > 4)
    assert sparse_decodes == (STEPS if prompt == PROMPT else 3)
    assert opt.routed == QSA_LAYERS * (sparse_decodes + 2) and not opt.declined
    compiled = [e for e in opt.programs["qsa_attention"].specializations if e.compiled]
    assert {e.signature.split(", ")[0] for e in compiled} == {
        "queries:f32[1,4,1,32]",
        "queries:f32[1,4,5,32]",
        f"queries:f32[1,4,{prompt},32]",
    }
    for entry in compiled:  # a routed call is a gather over 4 blocks * 4 + 3 tail cells, never the masked form
        assert entry.ops["qsa_cells"] == 1 and "qsa_mask" not in entry.ops and "keys:f32[1,2,256,32]" in entry.signature
        assert any("W=19" in r.message and "distinct ids promised by the caller" in r.message for r in entry.remarks)
    # restored: the dispatch, and the recorders of the cache's fetch and the indexer's selection
    assert language.dispatch_qsa_attention is qsa_kernel.dispatch_qsa_attention
    assert "update_and_fetch" not in vars(language.QSAKVCache) and not hasattr(
        language.QSAKVCache.update_and_fetch, "__wrapped__"
    )
    assert not hasattr(language.Qwen4ExpQSAIndexer.select_from_projected, "__wrapped__")
    assert cache[3].offset == prompt + STEPS + 5 and cache[3].index_keys.shape[1] == cache[3].offset


def test_prefill_is_routed_through_tiles_with_its_logits_near_the_models_own(model):
    from attnpass.backends.mlx import optimize

    def prefill():
        cache = model.make_cache()
        return np.array(model(_prompt(), cache=cache).logits)

    plain = prefill()
    with optimize(model) as opt:
        got = prefill()
    np.testing.assert_allclose(got, plain, rtol=0, atol=1e-4)
    assert opt.routed == QSA_LAYERS and not opt.declined
    (entry,) = [e for e in opt.programs["qsa_attention"].specializations if e.compiled]
    assert entry.ops["qsa_cells"] == 1 and entry.ops["qsa_gather"] == 2 * 3 and "qsa_mask" not in entry.ops
    (remark,) = [r.message for r in entry.remarks if r.pass_name == "qsa-gather"]
    assert remark.startswith(f"prefill tiled: 1 stream(s) x {PROMPT} rows in 3 tile(s) of 16 row(s)")
    assert "W=19" in remark and f"FLOP ratio vs dense W/n_kv = {19 / 256:.4f}" in remark
    with optimize(model, "qsa-gather,decompose-sdpa{device=cpu},dce") as opt:  # no prefill tile: kept by name
        kept = prefill()
    assert opt.routed == 0 and opt.declined == {PREFILL_KEPT: QSA_LAYERS}
    assert_bits_equal(kept, plain)  # a declined call is the model's own dispatch


def test_a_prompt_prefilled_in_chunks_as_mlx_vlm_generate_does_is_routed_chunk_by_chunk(model):
    # mlx_vlm.generate prefills in chunks of prefill_step_size tokens over the growing caches: every chunk is a
    # routed prefill (tiles over W = 19 cells, deeper than 2 * W), its logits within 1e-4 of the plain model's
    from attnpass.backends.mlx import optimize

    def evaluated(cache):
        mx.eval([c.state for c in cache])
        return cache

    plain, tokens = _chunked_prefill(model, evaluated)
    with optimize(model) as opt:
        got, got_tokens = _chunked_prefill(model, evaluated)
    np.testing.assert_allclose(got, plain, rtol=0, atol=1e-4)
    assert got_tokens == tokens and len(set(tokens)) > 1
    assert opt.routed == QSA_LAYERS * (5 + 4) and not opt.declined  # 5 chunks (4 of 64 rows, one of 44), 4 decodes
    signatures = {e.signature.split(", ")[0] for e in opt.programs["qsa_attention"].specializations if e.compiled}
    assert {"queries:f32[1,4,64,32]", "queries:f32[1,4,44,32]"} <= signatures
    for entry in opt.programs["qsa_attention"].specializations:
        if entry.compiled and ",64,32]" in entry.signature.split(", ")[0]:
            (remark,) = [r.message for r in entry.remarks if r.pass_name == "qsa-gather"]
            assert remark.startswith("prefill tiled: 1 stream(s) x 64 rows in 4 tile(s) of 16 row(s)")


def test_speculative_verify_is_routed_and_its_rollback_trims_the_caches_consistently(model):
    from attnpass.backends.mlx import optimize

    def run():
        cache = model.make_cache()
        first = int(mx.argmax(model(_prompt(), cache=cache).logits[0, -1]).item())
        tokens = _greedy(model, cache, first, 4)
        draft = mx.array([[tokens[-1], 5, 9, 11, 2]], dtype=mx.int32)
        hidden, _, rollback = model.speculative_verify_hidden(draft, cache)
        hidden = np.array(hidden)
        rollback.commit([2])  # keep two of the five positions: every cache trimmed by three
        assert cache[3].offset == PROMPT + 4 + 2
        return hidden, _greedy(model, cache, 9, 6)

    hidden, tokens = run()
    with optimize(model) as opt:
        got_hidden, got = run()
    np.testing.assert_allclose(got_hidden, hidden, rtol=0, atol=1e-4)
    assert got == tokens
    # the verifier splits five rows into pairs (2, 2, 1); 4 decode steps before it, 6 after the rollback
    assert opt.routed == QSA_LAYERS * (1 + 4 + 3 + 6) and not opt.declined


def test_a_prompt_cache_saved_and_loaded_decodes_the_same_tokens(model):
    # what a prompt cache file holds and loading restores: every cache's state (QSA: keys, values, raw indexer
    # keys, positions, pooled block keys) set on fresh caches, whose buffers are then exactly the saved length
    from attnpass.backends.mlx import optimize

    cache = model.make_cache()
    first = int(mx.argmax(model(_prompt(), cache=cache).logits[0, -1]).item())
    _greedy(model, cache, first, 3)
    saved = [c.state for c in cache]
    mx.eval(saved)

    def resume():
        loaded = model.make_cache()
        for c, state in zip(loaded, saved):
            c.state = list(state) if isinstance(state, list) else state  # ArraysCache keeps the list it is given
        return _greedy(model, loaded, 11, 6)

    tokens = resume()
    with optimize(model) as opt:
        got = resume()
    assert got == tokens and opt.routed == QSA_LAYERS * 6 and not opt.declined


def test_bfloat16_qsa_calls_run_routed_and_near_the_models_own(model):
    # MLX's CPU GatherMM (the MoE blocks) is float32 only, so the QSA layer's attention runs alone in bfloat16,
    # inside the optimized model's active call as in its forward
    from attnpass.backends.mlx import optimize

    attention = model.model.layers[3].self_attn
    attention.set_dtype(mx.bfloat16)
    try:
        cache = language.QSAKVCache()
        attention(mx.random.normal((1, PROMPT, 64)).astype(mx.bfloat16), mask="causal", cache=cache)
        state = cache.state
        outputs = []
        for optimized in (False, True):
            cache.state = state
            steps = [mx.random.normal((1, 1, 64), key=mx.random.key(i)).astype(mx.bfloat16) for i in range(3)]
            if optimized:
                with optimize(model) as opt, opt.active():
                    outputs.append([np.array(attention(x, cache=cache).astype(mx.float32)) for x in steps])
            else:
                outputs.append([np.array(attention(x, cache=cache).astype(mx.float32)) for x in steps])
        assert (
            opt.routed == 3
            and not opt.declined
            and opt.programs["qsa_attention"].specializations[0].signature.startswith("queries:bf16")
        )
        # outputs up to ~0.16: 4e-3 is four bf16 steps there
        np.testing.assert_allclose(np.stack(outputs[1]), np.stack(outputs[0]), rtol=0, atol=4e-3)
    finally:
        attention.set_dtype(mx.float32)


def _quantized_run(lm, kv_dtype=None):
    """The plain model's prefill, its QSA caches quantized as mlx-vlm quantizes them (8 bits, groups of 32; from
    K/V cast to ``kv_dtype`` if given, so scales and biases of that dtype), greedy decode steps' logits and tokens,
    then a 5-row verify step's logits."""
    cache = lm.make_cache()
    token = int(mx.argmax(lm(_prompt(), cache=cache).logits[0, -1]).item())
    for c in cache:
        if kv_dtype is not None and isinstance(c, language.QSAKVCache):
            c.keys, c.values = c.keys.astype(kv_dtype), c.values.astype(kv_dtype)
    cache = [c.to_quantized(group_size=32, bits=8) if isinstance(c, language.QSAKVCache) else c for c in cache]
    tokens, logits = [], []
    for _ in range(STEPS):
        tokens.append(token)
        logits.append(np.array(lm(mx.array([[token]], dtype=mx.int32), cache=cache).logits))
        token = int(np.argmax(logits[-1][0, -1]))
    verify = np.array(lm(mx.array([tokens[-5:]], dtype=mx.int32), cache=cache).logits)
    return tokens, np.stack(logits), verify, cache


def test_a_quantized_qsa_cache_decodes_the_plain_models_tokens_with_every_qsa_call_gathered(model):
    # QSAQuantizedKVCache: plain mlx-vlm attends the whole packed cache (its quantized helper under the selection's
    # mask); routed, each call gathers the selected cells' packed rows, scales and biases and attends only those
    from attnpass.backends.mlx import optimize

    tokens, logits, verify, plain = _quantized_run(model)
    with optimize(model) as opt:
        got, got_logits, got_verify, cache = _quantized_run(model)
    assert got == tokens and len(set(tokens)) > 1
    # not bit for bit: the softmax and P @ V reduce over the W gathered cells instead of the whole cache
    np.testing.assert_allclose(got_logits, logits, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got_verify, verify, rtol=0, atol=1e-5)
    # the prefill (on the float cache) through qsa, every decode and the verify call through the quantized program
    assert opt.routed == QSA_LAYERS * (1 + STEPS + 1) and not opt.declined
    compiled = [e for e in opt.programs["qsa_quantized_attention"].specializations if e.compiled]
    assert {e.signature.split(", ")[0] for e in compiled} == {"queries:f32[1,4,1,32]", "queries:f32[1,4,5,32]"}
    for entry in compiled:  # the whole buffer given (words as int32), 6 gathers, no mask, nothing dequantized
        assert "kq:i32[1,2,256,8], ks:f32[1,2,256,1], kb:f32[1,2,256,1], vq:i32[1,2,256,8]" in entry.signature
        assert "group_size=32, bits=8" in entry.signature
        assert entry.ops["qsa_gather"] == 6 and entry.ops["quantized_sdpa"] == 1
        assert not {"qsa_mask", "dequantize", "sdpa"} & set(entry.ops)
        (remark,) = [r.message for r in entry.remarks if r.pass_name == "qsa-gather" and r.kind == "applied"]
        assert "W=19" in remark and "words, scales and biases" in remark and "distinct ids promised" in remark
    # the indexer state stays float, appended in place, and is the plain model's in the first QSA layer
    for layer in (3, 7):
        assert type(cache[layer]) is language.QSAQuantizedKVCache and cache[layer].index_keys.dtype == mx.float32
        assert cache[layer]._attnpass_index.length == cache[layer].offset == PROMPT + STEPS + 5
    assert_bits_equal(np.array(cache[3].index_keys), np.array(plain[3].index_keys))
    # restored: the quantized cache's fetch and the indexer update are mlx-vlm's own again
    assert not hasattr(language.QSAQuantizedKVCache.update_indexer, "__wrapped__")
    assert not hasattr(language.QSAQuantizedKVCache.update_and_fetch, "__wrapped__")


def test_float32_queries_over_a_bfloat16_quantized_qsa_cache_are_routed_as_mlx_promotes_them(model):
    # mlx-vlm's Qwen4-Exp in bfloat16 hands float32 hidden states to its QSA layers: float32 queries over a cache
    # whose scales and biases are bfloat16. MLX's quantized_matmul casts them to float32; the program does the same
    from attnpass.backends.mlx import optimize

    tokens, logits, verify, _ = _quantized_run(model, mx.bfloat16)
    with optimize(model) as opt:
        got, got_logits, got_verify, cache = _quantized_run(model, mx.bfloat16)
    assert cache[3].keys[1].dtype == mx.bfloat16 and got == tokens and len(set(tokens)) > 1
    # the gathered cells' reduction order: up to 2e-5 measured after 10 steps (the float32 cache's: under 1e-5)
    np.testing.assert_allclose(got_logits, logits, rtol=0, atol=1e-4)
    np.testing.assert_allclose(got_verify, verify, rtol=0, atol=1e-4)
    assert opt.routed == QSA_LAYERS * (1 + STEPS + 1) and not opt.declined
    compiled = [e for e in opt.programs["qsa_quantized_attention"].specializations if e.compiled]
    assert compiled and all("queries:f32" in e.signature and "ks:bf16" in e.signature for e in compiled)
    assert all(e.ops["qsa_gather"] == 6 and e.ops["quantized_sdpa"] == 1 for e in compiled)


def test_a_prompt_prefilled_in_chunks_into_a_quantized_cache_is_routed_through_quantized_tiles(model):
    # the caches quantized after the first 64-row chunk (mlx-vlm quantizes once past quantized_kv_start): the
    # later chunks are prefills on a QSAQuantizedKVCache, tiled by qsa-gather (6 gathers and one quantized_sdpa
    # per tile of 16 rows), their logits within 1e-4 of the plain model's and the tokens after them the same
    from attnpass.backends.mlx import optimize

    def quantized(cache):
        return [c.to_quantized(group_size=32, bits=8) if type(c) is language.QSAKVCache else c for c in cache]

    plain, tokens = _chunked_prefill(model, quantized)
    with optimize(model) as opt:
        got, got_tokens = _chunked_prefill(model, quantized)
    np.testing.assert_allclose(got, plain, rtol=0, atol=1e-4)  # as the float chunked prefill: 300 rows, 2 QSA layers
    assert got_tokens == tokens and opt.routed == QSA_LAYERS * (5 + 4) and not opt.declined
    ops = {
        e.signature.split(", ")[0]: e.ops for e in opt.programs["qsa_quantized_attention"].specializations if e.compiled
    }
    assert ops.keys() == {"queries:f32[1,4,64,32]", "queries:f32[1,4,44,32]", "queries:f32[1,4,1,32]"}
    for rows, tiles in ((64, 4), (44, 3)):
        assert ops[f"queries:f32[1,4,{rows},32]"]["qsa_gather"] == 6 * tiles
        assert ops[f"queries:f32[1,4,{rows},32]"]["quantized_sdpa"] == tiles


def test_a_quantized_qsa_call_left_masked_is_declined_by_name_and_runs_the_models_dispatch_bit_for_bit(model):
    from attnpass.backends.mlx import optimize

    tokens, logits, _, _ = _quantized_run(model)
    with optimize(model, "decompose-sdpa{device=cpu},dce") as opt:  # no qsa-gather: the masked form stays
        got, got_logits, _, _ = _quantized_run(model)
    assert got == tokens
    assert_bits_equal(got_logits, logits)
    assert opt.routed == 0 and opt.declined == {"no_gather_pass": QSA_LAYERS * (2 + STEPS)}


def test_arrays_that_are_not_the_indexers_selection_are_declined(model):
    from mlx_vlm.models.qwen4_exp.qsa_kernel import dispatch_qsa_attention

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.clients import QSA_DISPATCH

    route_qsa = QSA_DISPATCH.trampoline()

    attention = model.model.layers[3].self_attn
    cache = language.QSAKVCache()
    x = mx.random.normal((1, PROMPT, 64))
    attention(x, mask="causal", cache=cache)
    step = mx.random.normal((1, 1, 64))
    with optimize(model) as opt, opt.active():
        selection = attention.indexer.select(step, cache, None)
        q, k, v = attention.q_proj(step), attention.k_proj(step), attention.v_proj(step)
        queries, keys, values, _, _ = attention._prepare_projected_qkv(q, k, v, cache, None, None, None)
        options = {"cache": cache, "scale": attention.scale, "block_size": 4, "causal": True, "mask": None,
                   "mask_factory": lambda: attention.indexer.build_mask(selection)}  # fmt: skip
        copied = mx.array(selection.selected_blocks)
        got = route_qsa(queries, keys, values, copied, selection.query_ends, **options)
        routed = route_qsa(queries, keys, values, selection.selected_blocks, selection.query_ends, **options)
        masked = {**options, "causal": False, "mask": attention.indexer.build_mask(selection)}
        combined = route_qsa(queries, keys, values, selection.selected_blocks, selection.query_ends, **masked)
    assert opt.declined == {"not_selected": 1, "model_mask": 1} and opt.routed == 1
    np.testing.assert_allclose(np.array(combined), np.array(got), rtol=0, atol=1e-6)  # the same cells, masked
    want = dispatch_qsa_attention(queries, keys, values, copied, selection.query_ends, **options)
    assert_bits_equal(np.array(got), np.array(want))  # the declined call is the model's dispatch
    np.testing.assert_allclose(np.array(routed), np.array(got), rtol=0, atol=1e-5)


def test_two_optimized_models_share_the_patches_until_the_last_restores(model):
    from mlx_vlm.models.qwen4_exp import qsa_kernel

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.clients import QSA_DISPATCH

    route_qsa = QSA_DISPATCH.trampoline()

    other = language.LanguageModel(model.args, model.config)
    first, second = optimize(model), optimize(other)
    first.restore()
    assert language.dispatch_qsa_attention is route_qsa  # the other model still routes
    cache = model.make_cache()
    model(_prompt(), cache=cache)
    model(mx.array([[3]], dtype=mx.int32), cache=cache)
    assert first.routed == second.routed == 0 and not first.declined  # a restored model's calls go to mlx-vlm
    second.restore()
    assert language.dispatch_qsa_attention is qsa_kernel.dispatch_qsa_attention
    assert not hasattr(language.QSAKVCache.update_and_fetch, "__wrapped__")


def test_multimodal_rope_positions_decode_the_same_tokens(model):
    # M-RoPE: an image-like grid of 24 tokens between text; the indexer keeps [3, B, T] positions, rotates its
    # queries and pooled keys with them, and selects: the router takes that selection as it is
    from attnpass.backends.mlx import optimize

    config = vlm_config.TextConfig(**{
        **{k: getattr(model.args, k) for k in model.args.__dataclass_fields__},
        "num_hidden_layers": 4, "layer_types": None,
        "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000,
                            "partial_rotary_factor": 0.25},
    })  # fmt: skip
    full = vlm_config.ModelConfig(text_config=config, vision_config=vlm_config.VisionConfig(), model_type="qwen4_exp")
    mx.random.seed(5)
    lm = language.LanguageModel(config, full)
    mx.eval(lm.parameters())
    t = np.concatenate([np.arange(8), np.full(24, 8), 14 + np.arange(8)])
    h = np.concatenate([np.arange(8), 8 + np.repeat(np.arange(4), 6), 14 + np.arange(8)])
    w = np.concatenate([np.arange(8), 8 + np.tile(np.arange(6), 4), 14 + np.arange(8)])
    positions = mx.array(np.stack([t, h, w])[:, None, :], dtype=mx.int32)

    def run():
        cache = lm.make_cache()
        token = int(mx.argmax(lm(_prompt(), cache=cache, position_ids=positions).logits[0, -1]).item())
        tokens = []
        for step in range(8):
            tokens.append(token)
            at = mx.full((3, 1, 1), 22 + step, dtype=mx.int32)
            token = int(mx.argmax(lm(mx.array([[token]]), cache=cache, position_ids=at).logits[0, -1]).item())
        assert cache[3].index_position_ids.shape == (3, 1, PROMPT + 8)
        return tokens

    tokens = run()
    with optimize(lm) as opt:
        got = run()
    assert got == tokens and opt.routed == 1 + 8 and not opt.declined


def test_a_whole_vlm_routes_the_language_model_calls_mlx_vlm_generate_makes(model):
    # mlx_vlm.generate decodes through model.language_model(...), past the top-level model's __call__
    from mlx_vlm.models.qwen4_exp import qwen4_exp

    from attnpass.backends.mlx import optimize

    vision = vlm_config.VisionConfig(depth=1, hidden_size=16, intermediate_size=16, out_hidden_size=64, num_heads=2)
    vlm = qwen4_exp.Model(vlm_config.ModelConfig(text_config=model.args, vision_config=vision, model_type="qwen4_exp"))
    vlm.language_model = model
    inner = type(model)
    with optimize(vlm) as opt:
        cache = model.make_cache()
        model(_prompt(), cache=cache)
        model(mx.array([[3]], dtype=mx.int32), cache=cache)
        with pytest.raises(ValueError, match="LanguageModel is already optimized"):
            optimize(model)
    assert opt.routed == 2 * QSA_LAYERS and not opt.declined
    assert type(model) is inner and type(vlm) is qwen4_exp.Model


def test_the_indexer_buffers_regrow_and_are_rebuilt_after_a_trim(model, monkeypatch):
    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.caches import qsa as vlm

    monkeypatch.setattr(vlm, "STEP", 4)  # capacity: the length rounded down to 4, plus 8
    rebuilds = []
    rebuild = vlm._rebuild
    monkeypatch.setattr(vlm, "_rebuild", lambda *a: rebuilds.append(a[0].shape[1]) or rebuild(*a))

    def run():
        cache = model.make_cache()
        first = int(mx.argmax(model(_prompt(), cache=cache).logits[0, -1]).item())
        tokens = _greedy(model, cache, first, 10)
        for c in cache:
            c.trim(3) if isinstance(c, language.QSAKVCache) else None
        return tokens, cache

    plain_tokens, plain = run()
    with optimize(model):
        tokens, cache = run()
        after = _greedy(model, cache, 5, 3)  # the trimmed views are not the buffers': rebuilt, then appended
    assert tokens == plain_tokens and after == _greedy(model, plain, 5, 3)
    # per QSA layer: built by the prefill (40 keys, room for 48), regrown at 49, rebuilt after the trim (47 + 1)
    assert rebuilds == [40, 40, 49, 49, 48, 48]
    assert_bits_equal(np.array(cache[3].index_keys), np.array(plain[3].index_keys))
