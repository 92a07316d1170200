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
  ``model.eval()``).

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

LIBRARIES = ("penzai", "keras", "keras_hub", "mlx_whisper", "mlx_embeddings")
# cases raise-attention declines, and the reason code of the remark it leaves
DECLINED = {"keras_hub.Gemma": "probabilities_changed", "keras_hub.GPT2": "probabilities_changed",
            "keras_hub.Bert": "probabilities_changed"}  # fmt: skip
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
    return out


def library(case: Case) -> str:
    """The package a case needs: ``penzai``, ``keras``, ``keras_hub``, ``mlx_whisper`` or ``mlx_embeddings``."""
    return case.name.split(".")[0]


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
        failed += not row.ok
        print(row_json(row) if options.json else zoo.format_row(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
