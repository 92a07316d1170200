"""Model libraries beyond the zoo's: imported, raised, lowered to every target and checked against the library.

The cases of ``examples/model_zoo.py`` cover mlx-lm, flax nnx and equinox. These are four more libraries,
each model tiny and random-initialised in code (no downloads), each case run by the zoo's own runner
(``model_zoo.run_case``: import, ``raise-attention``, ``head-chunk``, lowered to its backend and to the
other targets, compared with the library's output):

- penzai (JAX, its own KV cache): a llama-like ``KVCachingTransformerLM``, a decode and a verify step
  over a 32-slot cache holding 7 tokens, the step's logits and updated cache compared;
- Keras 3 on the JAX backend (``KERAS_BACKEND=jax`` in the environment before Keras is imported) and
  KerasHub: ``keras.layers.MultiHeadAttention`` (padding and causal masks), KerasHub's Llama backbone
  with a padding mask and ``LlamaCausalLM.call_with_cache`` (its own KV cache), and the Gemma, GPT-2 and
  BERT backbones, which raise-attention declines by name;
- mlx-whisper (MLX encoder-decoder): the audio encoder, the text decoder's prefill (self- and
  cross-attention) and a decode step over its own caches;
- mlx-embeddings (MLX encoders with padding masks): BERT, XLM-RoBERTa and ModernBERT (local and global
  layers), in eval mode (left in training mode their dropout draws random bits: the import says to call
  ``model.eval()``);
- MaxText 0.2.5 (Python >= 3.12, ``make zoo-jax-libraries``): its Linen model from ``pyconfig`` and
  ``from_config``, a prefill and a decode step over its own cache (Llama, Gemma-2's sliding window, DeepSeek's
  MLA and DeepSeek-V3.2's DSA), and DeepSeek-V3's yarn RoPE, declined at import (complex64);
- gemma 4.0.1 (Python >= 3.12, ``make zoo-jax-libraries``): ``gm.nn.Gemma3_1B`` and ``gm.nn.Gemma4_E2B`` with tiny
  configs, a prefill and a decode step through ``model.apply`` over the cache of ``model.init_cache``.
- EasyDeL 0.3.0 (``make zoo-easydel``: its own venv, jax 0.9 and flax 0.12.3): its Llama, Qwen3, Mistral, Gemma3 and
  DeepSeek-V3 (MLA, yarn RoPE) ``*ForCausalLM`` from their configs, a prefill and a decode step over the cache of
  ``prepare_inputs_for_generation``, float32, bfloat16, and a float32 model with EasyDeL's default bfloat16 attention.

Run: ``KERAS_BACKEND=jax .venv/bin/python examples/library_zoo.py [--everywhere] [--json] [SUBSTRING ...]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if "model_zoo" not in sys.modules:  # the zoo's runner, loaded by path as a registered module (no sys.path edit)
    _spec = importlib.util.spec_from_file_location("model_zoo", Path(__file__).with_name("model_zoo.py"))
    sys.modules["model_zoo"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["model_zoo"])
zoo = sys.modules["model_zoo"]
Case = zoo.Case

LIBRARIES = ("penzai", "keras", "keras_hub", "mlx_whisper", "mlx_embeddings", "maxtext", "gemma", "easydel")
# cases raise-attention declines, and the reason code of the remark it leaves
DECLINED = {"keras_hub.Gemma": "probabilities_changed", "keras_hub.GPT2": "probabilities_changed",
            "keras_hub.Bert": "probabilities_changed", "easydel.llama-sdpa/prefill": "mask_layout"}  # fmt: skip
# cases the import declines, and the words its error names the reason with
DECLINED_IMPORT = {"maxtext.deepseek3-yarn": "dtype complex64 is not in the IR"}
Made = tuple[Callable, tuple, Callable[[], np.ndarray]]


def _jax_dtype(dtype: str) -> Any:
    import jax.numpy as jnp

    return jnp.bfloat16 if dtype == "bf16" else jnp.float32


def _jitted(fn: Callable, *args: Any) -> Callable[[], np.ndarray]:
    import jax

    return lambda: zoo.flat_output(jax.jit(fn)(*args)).astype(np.float32)


# ----------------------------------------------------------------------------- penzai


def penzai_case(step: str, dtype: str) -> Case:
    """penzai's llama-like transformer in cached sampling mode: 2 layers, 8 query heads over 2 KV heads."""

    def make() -> Made:
        import jax
        import jax.numpy as jnp
        from penzai import pz
        from penzai.models.transformer import sampling_mode
        from penzai.models.transformer.variants import llamalike_common as lc

        config = lc.LlamalikeTransformerConfig(
            num_kv_heads=2, query_head_multiplier=4, embedding_dim=64, projection_dim=16, mlp_hidden_dim=128,
            num_decoder_blocks=2, vocab_size=128, mlp_variant="swiglu", tie_embedder_and_logits=False,
            rope_wavelength=10000, rms_norm_eps=1e-6, attention_type=lc.AttentionTypeGlobalCausal(),
            parameter_dtype=_jax_dtype(dtype), activation_dtype=_jax_dtype(dtype),
        )  # fmt: skip
        model = lc.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
        sampler = sampling_mode.KVCachingTransformerLM.from_uncached(model, cache_len=32, batch_axes={"batch": 1})
        sampler(pz.nx.wrap(jnp.asarray(zoo.TOKENS[None, :7])).tag("batch", "seq"))  # the prompt fills 7 slots
        unbound, state = pz.unbind_state_vars(sampler, freeze=True)

        def cached_step(state: Any, tokens: Any) -> Any:
            out, new_state = unbound.stateless_call(state, pz.nx.wrap(tokens).tag("batch", "seq"))
            return out.unwrap("batch", "seq", "vocabulary"), new_state

        tokens = zoo.TOKENS[None, 7 : 7 + zoo.STEPS[step]]
        return cached_step, (state, tokens), _jitted(cached_step, state, tokens)

    return Case(f"penzai.llamalike/{step}/{dtype}", "jax", dtype, 2, make)


# ----------------------------------------------------------------------------- Keras 3 and KerasHub (JAX backend)


def _keras() -> Any:
    import keras

    if keras.backend.backend() != "jax":
        raise RuntimeError(f"Keras runs on {keras.backend.backend()}: set KERAS_BACKEND=jax before importing it")
    keras.utils.set_random_seed(0)
    return keras


def _padded_batch() -> tuple[np.ndarray, np.ndarray]:
    """Token ids of two sequences, the second padded after 5 tokens, and the padding mask (True = a token)."""
    ids = np.stack([zoo.TOKENS[:8], zoo.TOKENS[8:16]]).astype(np.int32)
    mask = np.ones(ids.shape, bool)
    mask[1, 5:] = False
    return np.where(mask, ids, 0).astype(np.int32), mask


def keras_mha_case(variant: str, dtype: str) -> Case:
    """``keras.layers.MultiHeadAttention`` (4 heads of 8) over 6 tokens: a padding mask, or causal."""

    def make() -> Made:
        keras = _keras()
        mha = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, dtype="bfloat16" if dtype == "bf16" else None)
        x = zoo._tokens(dtype, (2, 6, 32), 7)
        mask = np.ones((2, 6), bool)
        mask[1, 4:] = False

        def attend(x: Any, mask: Any) -> Any:
            if variant == "causal":
                return mha(x, x, use_causal_mask=True)
            return mha(x, x, attention_mask=mask[:, None, :])

        attend(x, mask)  # the first call builds the layer (its weights), as a Keras model's first call does
        return attend, (x, mask), _jitted(attend, x, mask)

    return Case(f"keras.MultiHeadAttention/{variant}/{dtype}", "jax", dtype, 1, make)


BACKBONES = {
    "Llama": dict(num_query_heads=8, num_key_value_heads=2, hidden_dim=64, intermediate_dim=128),
    "Gemma": dict(num_query_heads=8, num_key_value_heads=2, hidden_dim=64, intermediate_dim=128, head_dim=8),
    "GPT2": dict(num_heads=4, hidden_dim=64, intermediate_dim=128, max_sequence_length=32),
    "Bert": dict(num_heads=4, hidden_dim=64, intermediate_dim=128, max_sequence_length=32),
}


def _backbone(family: str, dtype: str) -> Any:
    _keras()
    import keras_hub

    cls = getattr(keras_hub.models, f"{family}Backbone")
    return cls(vocabulary_size=zoo.VOCAB, num_layers=2, dtype="bfloat16" if dtype == "bf16" else None,
               **BACKBONES[family])  # fmt: skip


def keras_hub_case(family: str, dtype: str) -> Case:
    """A KerasHub backbone (2 layers) over a padded batch of two sequences of 8 tokens."""

    def make() -> Made:
        import jax.numpy as jnp

        backbone = _backbone(family, dtype)
        ids, mask = _padded_batch()

        def forward(ids: Any, mask: Any) -> Any:
            inputs = {"token_ids": ids, "padding_mask": mask}
            if family == "Bert":
                return backbone({**inputs, "segment_ids": jnp.zeros_like(ids)})["sequence_output"]
            return backbone(inputs)

        return forward, (ids, mask), _jitted(forward, ids, mask)

    return Case(f"keras_hub.{family}/prefill/{dtype}", "jax", dtype, 2, make)


def keras_hub_cached_case(dtype: str) -> Case:
    """``LlamaCausalLM.call_with_cache``: one token over KerasHub's own 16-slot cache holding a 7-token prompt."""

    def make() -> Made:
        import keras_hub

        lm = keras_hub.models.LlamaCausalLM(backbone=_backbone("Llama", dtype), preprocessor=None)
        prompt = np.zeros((1, 16), np.int32)
        prompt[0, :7] = zoo.TOKENS[:7]
        _hidden, cache = lm._build_cache(prompt)  # how its generate() seeds the cache

        def cached_step(token: Any, cache: Any, index: Any) -> Any:
            logits, _hidden, cache = lm.call_with_cache(token, cache, index)
            return logits, cache

        args = (zoo.TOKENS[None, 7:8], np.asarray(cache), np.int32(7))
        return cached_step, args, _jitted(cached_step, *args)

    return Case(f"keras_hub.LlamaCausalLM/decode/{dtype}", "jax", dtype, 2, make)


# ----------------------------------------------------------------------------- MaxText (Python >= 3.12)

# Tiny versions of MaxText's own model configs (configs/models/*.yml), overridden as its pyconfig takes overrides:
# 2 decoder layers, width 64, vocabulary 128, a 16-token cache of which 8 are the prefill's.
MLA = dict(base_num_query_heads=4, base_num_kv_heads=4, first_num_dense_layers=2, q_lora_rank=16, kv_lora_rank=16,
           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rope_type="default", use_mla_absorbed_mqa=True,
           mla_naive_kvcache=False)  # fmt: skip
MAXTEXT_MODELS = {
    "llama": dict(model_name="llama2-7b", base_num_query_heads=8, base_num_kv_heads=2, head_dim=8),
    "gemma2": dict(model_name="gemma2-2b", base_num_query_heads=4, base_num_kv_heads=2, head_dim=16,
                   sliding_window_size=4),  # one local (sliding-window, soft-capped) and one global layer per block
    # MLA: dense layers only, plain RoPE (below: yarn's), the absorbed latent cache of MaxText's decode mode
    "deepseek3": dict(MLA, model_name="deepseek3-tiny"),
    # DeepSeek-V3.2's DSA: the indexer's top-4 of the cached keys, applied as a dense additive mask
    "deepseek3.2": dict(MLA, model_name="deepseek3.2-671b", indexer_n_heads=2, indexer_head_dim=8, indexer_topk=4),
    # DeepSeek-V3's own yarn RoPE, which MaxText computes in complex64
    "deepseek3-yarn": dict(MLA, model_name="deepseek3-tiny", rope_type="yarn"),
}  # fmt: skip
MAXTEXT_LAYERS = {"llama": 2, "gemma2": 4, "deepseek3": 2, "deepseek3.2": 2, "deepseek3-yarn": 2}


def _maxtext(family: str, dtype: str) -> tuple[Any, Any, Any]:
    """A tiny MaxText model of ``family`` (``from_config`` of ``pyconfig.initialize``, Linen), its variables and its
    cache after prefilling 5 of 8 tokens (``model_mode="prefill"``, ``mutable=["cache"]``, as MaxEngine does)."""
    import os

    import jax
    import maxtext
    from maxtext.common.common_types import MODEL_MODE_PREFILL
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    precision = "bfloat16" if dtype == "bf16" else "float32"
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    config = pyconfig.initialize(
        ["", base], override_model_config=True, run_name="zoo", base_output_directory=os.path.join(os.getcwd(), "out"),
        base_emb_dim=64, base_mlp_dim=128, base_moe_mlp_dim=64, base_num_decoder_layers=2, vocab_size=zoo.VOCAB,
        per_device_batch_size=1, max_target_length=16, max_prefill_predict_length=8, scan_layers=False,
        attention="dot_product", dtype=precision, weight_dtype=precision, enable_checkpointing=False,
        skip_jax_distributed_system=True, enable_dropout=False, **MAXTEXT_MODELS[family],
    )  # fmt: skip
    model = model_creation_utils.from_config(config)
    ids, positions, segments = _maxtext_prompt()
    key = jax.random.PRNGKey(0)
    rngs = {"params": key, "aqt": key, "dropout": key}
    variables = model.init(rngs, ids, positions, segments, enable_dropout=False, model_mode=MODEL_MODE_PREFILL)
    params = {"params": variables["params"]}
    _logits, cache = model.apply(
        {**params, **variables}, ids, positions, segments, enable_dropout=False, model_mode=MODEL_MODE_PREFILL,
        mutable=["cache"],
    )  # fmt: skip
    return model, params, cache


def _maxtext_prompt() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MaxText's prefill inputs: 8 token slots holding a 5-token prompt, positions, segment ids (1 = a token)."""
    from maxtext.common.common_types import DECODING_ACTIVE_SEQUENCE_INDICATOR

    ids = np.zeros((1, 8), np.int32)
    ids[0, :5] = zoo.TOKENS[:5]
    segments = np.where(np.arange(8) < 5, DECODING_ACTIVE_SEQUENCE_INDICATOR, 0).astype(np.int32)[None]
    return ids, np.arange(8, dtype=np.int32)[None], segments


def maxtext_case(family: str, step: str, dtype: str) -> Case:
    """MaxText: ``prefill`` (the model over the padded 8-token prompt, its logits and the cache it writes) or
    ``decode`` (one token over that cache, ``model_mode="autoregressive"``: the prefill's cache and MaxText's own
    autoregressive cache, combined by their log-sum-exps; the logits and the updated cache)."""

    def make() -> Made:
        from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_PREFILL

        model, params, cache = _maxtext(family, dtype)
        if step == "prefill":

            def prefill(params: Any, ids: Any, positions: Any, segments: Any) -> Any:
                return model.apply(params, ids, positions, segments, enable_dropout=False,
                                   model_mode=MODEL_MODE_PREFILL, mutable=["cache"])  # fmt: skip

            args = (params, *_maxtext_prompt())
            return prefill, args, _jitted(prefill, *args)

        def decode(params: Any, cache: Any, token: Any, position: Any) -> Any:
            return model.apply({**params, **cache}, token, position, enable_dropout=False,
                               model_mode=MODEL_MODE_AUTOREGRESSIVE, mutable=["cache"])  # fmt: skip

        args = (params, cache, zoo.TOKENS[None, 5:6], np.array([[5]], np.int32))
        return decode, args, _jitted(decode, *args)

    return Case(f"maxtext.{family}/{step}/{dtype}", "jax", dtype, MAXTEXT_LAYERS[family], make)


# ----------------------------------------------------------------------------- gemma (Python >= 3.12)

GEMMA_CACHE = 16  # cache slots; the prompt is the first 5 tokens, the decode step the 6th
GEMMA_LAYERS = {"gemma3": 2, "gemma4": 4}


def _gemma_model(family: str, dtype: str) -> Any:
    """A tiny ``gm.nn.Gemma3_1B`` or ``gm.nn.Gemma4_E2B``: the library's own class, its config replaced by a tiny one
    (width 64, 4 query / 2 KV heads of 16, vocabulary 128, a sliding window of 4); ``dtype`` the params' dtype."""
    import dataclasses

    import jax.numpy as jnp
    from gemma import gm

    precision = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    tiny = dict(num_embed=zoo.VOCAB, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16, num_kv_heads=2,
                sliding_window_size=4)  # fmt: skip
    if family == "gemma3":  # one local (sliding-window) and one global layer, QK norm
        local, overall = gm.nn.AttentionType.LOCAL_SLIDING, gm.nn.AttentionType.GLOBAL
        config = dataclasses.replace(gm.nn.Gemma3_1B.config, attention_types=(local, overall), **tiny)
        return gm.nn.Gemma3_1B(config=config, dtype=precision)
    from gemma.gm.nn.gemma4 import _modules as gemma4_modules

    # local, global, local, global; the last two layers reuse the first two's KV cache (KV sharing); per-layer
    # inputs; the global layers' keys of 32 with RoPE on a quarter of them (partial RoPE)
    local, overall = gemma4_modules.AttentionType.LOCAL_SLIDING, gemma4_modules.AttentionType.GLOBAL
    base = gm.nn.Gemma4_E2B.config
    config = dataclasses.replace(
        base, attention_types=(local, overall) * 2, global_key_size=32, per_layer_input_dim=8,
        override_kv_shared_ffw_hidden=256, vision_encoder=None, audio_encoder=None,
        kv_cache_sharing_config=dataclasses.replace(base.kv_cache_sharing_config, frac_shared_layers=0.5), **tiny,
    )  # fmt: skip
    return gm.nn.Gemma4_E2B(config=config, dtype=precision)


def _gemma_prompt() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prompt's tokens, positions and attention mask over the cache (causal, as ``gm.text.Sampler``'s prefill)."""
    positions = np.arange(5, dtype=np.int32)
    mask = np.arange(GEMMA_CACHE)[None, :] <= positions[:, None]
    return zoo.TOKENS[None, :5], positions[None], mask[None]


def gemma_case(family: str, step: str, dtype: str) -> Case:
    """gemma: ``prefill`` (``model.apply`` of the prompt with the cache from ``model.init_cache``, its logits and the
    cache it writes) or ``decode`` (one token over that cache with the mask of ``gm.text.Sampler``'s step: the
    logits and the updated cache); params from ``model.init``."""

    def make() -> Made:
        import jax

        model = _gemma_model(family, dtype)
        tokens, positions, mask = _gemma_prompt()
        params = model.init(jax.random.PRNGKey(0), tokens=tokens)["params"]
        cache = model.init_cache(batch_size=1, dtype=model.dtype, cache_length=GEMMA_CACHE)

        def step_fn(params: Any, cache: Any, tokens: Any, positions: Any, mask: Any) -> Any:
            out = model.apply({"params": params}, tokens=tokens, cache=cache, positions=positions, attention_mask=mask)
            return out.logits, out.cache

        if step == "prefill":
            args = (params, cache, tokens, positions, mask)
            return step_fn, args, _jitted(step_fn, *args)
        _logits, cache = jax.jit(step_fn)(params, cache, tokens, positions, mask)
        step_mask = (np.arange(GEMMA_CACHE) < 6)[None, None]  # the sampler's attention_mask_for_step, B 1 L
        args = (params, cache, zoo.TOKENS[None, 5:6], np.array([[5]], np.int32), step_mask)
        return step_fn, args, _jitted(step_fn, *args)

    return Case(f"gemma.{family}/{step}/{dtype}", "jax", dtype, GEMMA_LAYERS[family], make)


# ----------------------------------------------------------------------------- EasyDeL (make zoo-easydel)

# Tiny configs of EasyDeL's own config classes: 2 layers, width 64, 8 query / 2 KV heads of 8, vocabulary 128; the
# cache holds 16 tokens, the prompt is the first 5, the decode step the 6th.
EASYDEL_TINY = dict(vocab_size=zoo.VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)  # fmt: skip
EASYDEL_CACHE = 16
YARN = dict(type="yarn", rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)  # fmt: skip
EASYDEL_MODELS = {  # family -> (config class, model class, the family's own settings)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    # attn_mechanism="sdpa": ejkernel's jax.nn.dot_product_attention (a bool mask and is_causal, GQA) in a shard_map
    "llama-sdpa": ("LlamaConfig", "LlamaForCausalLM", dict(attn_mechanism="sdpa")),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # QK norm
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4)),
    # a sliding-window layer of 4 and a global one
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8)),
    # MLA (8 heads, latent ranks 16), dense layers, DeepSeek-V3's yarn RoPE (its correction range floors and ceils)
    "deepseek3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                  dict(num_key_value_heads=8, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                       v_head_dim=8, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, n_group=1, topk_group=1, rope_scaling=YARN)),
}  # fmt: skip
# precisions: (params and activations, attention and cache); "f32-bf16-attention" is EasyDeL's default attn_dtype
# (bfloat16) in a float32 model, held to the bfloat16 bound since its attention rounds to bfloat16
EASYDEL_DTYPES = {"f32": ("f32", "f32"), "bf16": ("bf16", "bf16"), "f32-bf16-attention": ("f32", "bf16")}


def _easydel_model(family: str, dtype: str) -> Any:
    """A tiny EasyDeL ``*ForCausalLM`` of ``family``: its config class with :data:`EASYDEL_TINY`, random weights
    (``rngs=nnx.Rngs(0)``), ``dtype`` and ``param_dtype`` the model's, ``attn_dtype`` and ``kvdtype`` the attention's
    (:data:`EASYDEL_DTYPES`)."""
    import easydel as ed
    import jax.numpy as jnp
    from flax import nnx

    model_dtype, attention_dtype = (jnp.bfloat16 if d == "bf16" else jnp.float32 for d in EASYDEL_DTYPES[dtype])
    config_class, model_class, own = EASYDEL_MODELS[family]
    config = getattr(ed, config_class)(**{**EASYDEL_TINY, **own}, attn_dtype=attention_dtype, kvdtype=attention_dtype)
    return getattr(ed, model_class)(config=config, dtype=model_dtype, param_dtype=model_dtype, rngs=nnx.Rngs(0))


def easydel_case(family: str, step: str, dtype: str) -> Case:
    """EasyDeL: ``prefill`` (the model over the 5-token prompt with what ``prepare_inputs_for_generation`` gives it:
    EasyDeL's own cache of 16 slots, its ``MaskInfo`` and positions; the logits and the cache it writes) or ``decode``
    (one token over that cache as EasyDeL's ``generate`` loop calls the model, ``_call_generation_model_step`` on
    the inputs ``update_inputs_for_generation`` made; the logits and the updated cache). The model is split as
    EasyDeL splits it (``split_module``); each step takes the params and merges them back (``merge_module``), under
    ``with model.mesh``. "f32-bf16-attention" rows are held to the bfloat16 bound (Case dtype ``bf16``)."""

    def make() -> Made:
        import jax.numpy as jnp

        model = _easydel_model(family, dtype)
        graphdef, params, others = model.split_module()
        tokens = jnp.asarray(zoo.TOKENS[None, :5])
        with model.mesh:
            inputs = model.prepare_inputs_for_generation(tokens, max_length=EASYDEL_CACHE, pad_token_id=0)
        if step == "prefill":

            def prefill(params: Any, tokens: Any, inputs: Any) -> Any:
                with model.mesh:
                    out = model.merge_module(graphdef, params, others)(tokens, **inputs)
                return out.logits, out.past_key_values

            args = (params, tokens, inputs)
            return prefill, args, _jitted(prefill, *args)

        with model.mesh:
            inputs = model.update_inputs_for_generation(model(tokens, **inputs), dict(inputs))

        def decode(params: Any, token: Any, inputs: Any) -> Any:
            with model.mesh:
                merged = model.merge_module(graphdef, params, others)
                out = model._call_generation_model_step(merged, token, inputs)
            return out.logits, out.past_key_values

        args = (params, jnp.asarray(zoo.TOKENS[None, 5:6]), inputs)
        return decode, args, _jitted(decode, *args)

    bound = "f32" if dtype == "f32" else "bf16"
    return Case(f"easydel.{family}/{step}/{dtype}", "jax", bound, 2, make)


# ----------------------------------------------------------------------------- mlx-whisper


def _whisper(dtype: str) -> tuple[Any, Any, Any]:
    """A tiny Whisper (16 mels, 12 audio frames, width 32, 4 heads, 2 + 2 layers), its encoded audio and the
    decoder's caches after a 3-token prompt."""
    import mlx.core as mx
    from mlx_whisper.whisper import ModelDimensions, Whisper

    mx.random.seed(0)
    dims = ModelDimensions(
        n_mels=16, n_audio_ctx=12, n_audio_state=32, n_audio_head=4, n_audio_layer=2,
        n_vocab=zoo.VOCAB, n_text_ctx=16, n_text_state=32, n_text_head=4, n_text_layer=2,
    )  # fmt: skip
    mx_dtype = mx.bfloat16 if dtype == "bf16" else mx.float32
    model = Whisper(dims, mx_dtype)
    model.set_dtype(mx_dtype)
    mx.eval(model.parameters())
    mel = mx.array(zoo._tokens("f32", (1, 24, 16), 11)).astype(mx_dtype)
    audio = model.encoder(mel)
    _logits, cache, _qk = model.decoder(mx.array(zoo.TOKENS[None, :3]), audio)
    mx.eval(audio, cache)
    return model, mel, (audio, cache)


def whisper_case(part: str, dtype: str) -> Case:
    """mlx-whisper: ``encoder`` (2 self-attention layers), ``decoder/prefill`` and ``decoder/decode`` (2 layers of
    causal self-attention and cross-attention to the audio, the decode step over the caches of the prompt)."""

    def make() -> Made:
        import mlx.core as mx

        model, mel, (audio, cache) = _whisper(dtype)

        def reference(fn: Callable, *args: Any) -> Callable[[], np.ndarray]:
            return lambda: zoo.flat_output(fn(*args)).astype(np.float32)

        if part == "encoder":
            encode = model.encoder.__call__
            return encode, (mel,), reference(encode, mel)
        if part == "decoder/prefill":

            def prefill(tokens: Any, audio: Any) -> Any:
                return model.decoder(tokens, audio)[0]

            tokens = mx.array(zoo.TOKENS[None, :3])
            return prefill, (tokens, audio), reference(prefill, tokens, audio)

        def decode(tokens: Any) -> Any:
            logits, _cache, _qk = model.decoder(tokens, audio, kv_cache=[(kv, cross) for kv, cross in cache])
            return logits

        tokens = mx.array(zoo.TOKENS[None, 3:4])
        return decode, (tokens,), reference(decode, tokens)

    return Case(f"mlx_whisper.{part}/{dtype}", "mlx", dtype, 2 if part == "encoder" else 4, make)


# ----------------------------------------------------------------------------- mlx-embeddings


def embeddings_case(family: str, dtype: str) -> Case:
    """An mlx-embeddings encoder (2 layers, 4 heads of 8) over a batch padded by its attention mask: its hidden
    states and mean-pooled, normalised embeddings."""

    def make() -> Made:
        import mlx.core as mx

        module = importlib.import_module(f"mlx_embeddings.models.{family}")
        mx.random.seed(0)
        options = dict(model_type=family, num_hidden_layers=2, num_attention_heads=4, hidden_size=32,
                       intermediate_size=64, max_position_embeddings=64, vocab_size=zoo.VOCAB,
                       global_attn_every_n_layers=2, local_attention=4)  # fmt: skip
        fields = module.ModelArgs.__dataclass_fields__
        model = module.Model(module.ModelArgs(**{k: v for k, v in options.items() if k in fields}))
        model.set_dtype(mx.bfloat16 if dtype == "bf16" else mx.float32)
        mx.eval(model.parameters())
        model.eval()  # no dropout
        ids, mask = (mx.array(a.astype(np.int32)) for a in _padded_batch())

        def embed(ids: Any, mask: Any) -> Any:
            out = model(ids, attention_mask=mask)
            return out.last_hidden_state, out.text_embeds

        return embed, (ids, mask), lambda: zoo.flat_output(embed(ids, mask)).astype(np.float32)

    return Case(f"mlx_embeddings.{family}/{dtype}", "mlx", dtype, 2, make)


def cases() -> list[Case]:
    out = [penzai_case(step, d) for step in ("decode", "verify") for d in zoo.DTYPES]
    out += [keras_mha_case("padding", d) for d in zoo.DTYPES] + [keras_mha_case("causal", "f32")]
    out += [keras_hub_case("Llama", d) for d in zoo.DTYPES] + [keras_hub_cached_case(d) for d in zoo.DTYPES]
    out += [keras_hub_case(family, "f32") for family in ("Gemma", "GPT2", "Bert")]
    out += [whisper_case(part, d) for part in ("encoder", "decoder/prefill", "decoder/decode") for d in zoo.DTYPES]
    out += [embeddings_case(family, "f32") for family in ("bert", "xlm_roberta", "modernbert")]
    out += [embeddings_case("bert", "bf16")]
    out += [maxtext_case(f, step, d) for f in MAXTEXT_MODELS if f != "deepseek3-yarn" for step in ("prefill", "decode")
            for d in zoo.DTYPES]  # fmt: skip
    out += [maxtext_case("deepseek3-yarn", "prefill", "f32")]
    out += [gemma_case(f, step, d) for f in GEMMA_LAYERS for step in ("prefill", "decode") for d in zoo.DTYPES]
    plain = [f for f in EASYDEL_MODELS if f != "llama-sdpa"]
    out += [easydel_case(f, step, d) for f in plain for step in ("prefill", "decode") for d in zoo.DTYPES]
    out += [easydel_case(f, "decode", "f32-bf16-attention") for f in plain]
    out += [easydel_case("llama-sdpa", step, "f32") for step in ("prefill", "decode")]
    return out


def library(case: Case) -> str:
    """The package a case needs: one of :data:`LIBRARIES`."""
    return case.name.split(".")[0]


def dropin_jit_error(case: Case) -> float:
    """Max |out - library| of the case's function under attnpass's drop-in ``jit`` (``strict=True``: imported and
    rewritten, never the ``jax.jit`` fallback), over the same flattened outputs as the zoo compares."""
    from attnpass.backends.jax import jit

    fn, args, reference = case.make()
    got = zoo.flat_output(jit(fn, strict=True)(*args)).astype(np.float64)
    expected = reference().astype(np.float64)
    return float(np.max(np.where(got == expected, 0.0, np.abs(got - expected))))


def import_declined(case: Case) -> str | None:
    """The reason :data:`DECLINED_IMPORT` gives a case the import declines, or None."""
    return next((reason for prefix, reason in DECLINED_IMPORT.items() if case.name.startswith(prefix)), None)


def handled(row: Any) -> bool:
    """Within the tolerances, or declined at import by the reason :data:`DECLINED_IMPORT` names."""
    reason = import_declined(row.case)
    return row.ok if reason is None else row.imported.startswith("no: ") and reason in row.imported


def declined_reason(case: Case) -> str | None:
    return next((reason for prefix, reason in DECLINED.items() if case.name.startswith(prefix)), None)


def row_json(row: Any) -> str:
    """One row as a JSON line (``--json``): what the tests read from a subprocess."""
    fields = {f.name: getattr(row, f.name) for f in dataclasses.fields(row) if f.name != "case"}
    return json.dumps({"name": row.case.name, "layers": row.case.layers, "ok": row.ok, **fields})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="run the cases whose name contains one of these")
    parser.add_argument("--everywhere", action="store_true", help="also lower each case to the other targets")
    parser.add_argument("--json", action="store_true", help="print one JSON object per case instead of the table")
    options = parser.parse_args(argv)
    selected = [c for c in cases() if not options.only or any(s in c.name for s in options.only)]
    if not options.json:
        print(zoo.HEADER)
    failed = 0
    for case in selected:
        row = zoo.run_case(case, zoo.TARGETS if options.everywhere else ())
        failed += not handled(row)
        print(row_json(row) if options.json else zoo.format_row(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
