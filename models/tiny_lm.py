"""Tiny random-initialised mlx-lm models and a word-level tokenizer, built in code (no downloads).

:func:`tiny_lm` builds a model of an mlx-lm family from its ``ModelArgs``
with the attention shape this library targets: 24 query heads over 2 KV
heads (GQA 12), head dim 128; a small hidden size, few layers, a 512-token
vocabulary and untied embeddings (tied ones make a random model repeat its
input token), so greedy decoding produces varied tokens. :func:`tiny_tokenizer`
is the matching tokenizer (token ``i`` is the word ``t{i}``) for
``mlx_lm.generate`` / ``stream_generate``. Needs ``mlx-lm`` (the ``zoo`` extra).
"""

from __future__ import annotations

import importlib
from typing import Any

FAMILIES = ("llama", "qwen3")
VOCAB = 512


def tiny_lm(
    family: str = "llama",
    *,
    dtype: str = "bfloat16",
    layers: int = 2,
    hidden: int = 256,
    heads: int = 24,
    kv_heads: int = 2,
    head_dim: int = 128,
    vocab: int = VOCAB,
    seed: int = 0,
) -> Any:
    """A random ``mlx_lm.models.<family>.Model`` in ``dtype``, parameters evaluated; same seed, same weights."""
    import mlx.core as mx

    if family not in FAMILIES:
        raise ValueError(f"tiny_lm: unknown family {family!r}; families: {', '.join(FAMILIES)}")
    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = module.ModelArgs.from_dict(
        {
            "model_type": family, "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 2 * hidden,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
            "vocab_size": vocab, "max_position_embeddings": 65536, "rope_theta": 10000.0, "tie_word_embeddings": False,
        }
    )  # fmt: skip
    mx.random.seed(seed)
    model = module.Model(args)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def tiny_tokenizer(vocab: int = VOCAB) -> Any:
    """An ``mlx_lm`` TokenizerWrapper over the words ``t0 .. t{vocab-1}`` (whitespace-separated, no EOS)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece()  # joins words with spaces
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=words))


__all__ = ["FAMILIES", "VOCAB", "tiny_lm", "tiny_tokenizer"]
