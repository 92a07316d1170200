"""Tiny random-initialised mlx-lm models and a word-level tokenizer, built in code (no downloads).

:func:`tiny_lm` builds a model of an mlx-lm family from its ``ModelArgs``
with the attention shape this library targets: 24 query heads over 2 KV
heads (GQA 12), head dim 128; a small hidden size, few layers, a 512-token
vocabulary and untied embeddings (tied ones make a random model repeat its
input token), so greedy decoding produces varied tokens. :func:`tiny_tokenizer`
is the matching tokenizer (token ``i`` is the word ``t{i}``) for
``mlx_lm.generate`` / ``stream_generate``. :func:`save_tiny_lm` writes a model
and its tokenizer to a directory in mlx-lm's format (``config.json``,
safetensors, a tokenizer that loads offline), which ``mlx_lm.load`` and
mlx-lm's command line read. Needs MLX and ``mlx-lm`` (the ``mlx`` and ``zoo`` extras: without them each
function raises a :class:`~attnpass.ir.core.extras.MissingExtraError` saying so).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attnpass.ir.core.arguments import require_choice
from attnpass.ir.core.extras import import_extra

FAMILIES = ("llama", "qwen3")
VOCAB = 512
DTYPES = ("float32", "float16", "bfloat16")
EXTRAS = "mlx,zoo"  # pyproject's extras that install MLX and mlx-lm


def tiny_config(
    family: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 24,
    kv_heads: int = 2,
    head_dim: int = 128,
    vocab: int = VOCAB,
) -> dict[str, Any]:
    """The ``config.json`` of a tiny model of ``family`` (what its ``ModelArgs.from_dict`` reads)."""
    require_choice("tiny_lm", "family", family, FAMILIES)
    return {
        "model_type": family, "hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 2 * hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
        "vocab_size": vocab, "max_position_embeddings": 65536, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }  # fmt: skip


def tiny_lm(family: str = "llama", *, dtype: str = "bfloat16", seed: int = 0, **shape: int) -> Any:
    """A random ``mlx_lm.models.<family>.Model`` in ``dtype``, parameters evaluated; same seed, same weights.

    ``shape``: :func:`tiny_config`'s sizes (``layers``, ``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``vocab``).
    """
    config = tiny_config(family, **shape)
    require_choice("tiny_lm", "dtype", dtype, DTYPES)
    module = import_extra(f"mlx_lm.models.{family}", "tiny_lm", EXTRAS)
    import mlx.core as mx  # mlx-lm's own dependency

    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    model.eval()  # inference mode, as mlx_lm.load leaves it
    mx.eval(model.parameters())
    return model


def save_tiny_lm(
    directory: str | Path,
    family: str = "llama",
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    eos: bool = False,
    **shape: int,
) -> Path:
    """:func:`tiny_lm` with its :func:`tiny_tokenizer`, saved in mlx-lm's format to ``directory`` (created).

    ``hidden`` defaults to 384 here: transformers' tokenizer loader validates ``config.json`` and requires the
    hidden size to be a multiple of the query heads. The tokenizer has a chat template that joins the messages'
    contents (``mlx_lm.chat`` and the server's chat endpoint need one). ``eos``: the tokenizer also has an
    end-of-sequence word ``</s>``, of id ``vocab``, past the model's logits, so never generated (mlx-lm 0.31's
    server needs an EOS: its stop-sequence state machine fails on none); without it, ``config.json`` says there is
    none (``eos_token_id: []``: mlx-lm 0.31's loader would take the missing one as the id ``None``). Returns the
    directory.
    """
    save_model = import_extra("mlx_lm.utils", "save_tiny_lm", EXTRAS).save_model
    shape.setdefault("hidden", 384)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, tiny_lm(family, dtype=dtype, seed=seed, **shape))
    vocab = shape.get("vocab", VOCAB)
    config = {**tiny_config(family, **shape), "eos_token_id": [vocab] if eos else []}
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    words = _words(vocab, eos=eos)
    words.chat_template = CHAT_TEMPLATE
    words.save_pretrained(path)
    return path


CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def _words(vocab: int, eos: bool = False) -> Any:
    """A transformers fast tokenizer over the words ``t0 .. t{vocab-1}`` (``eos``: and ``</s>``, id ``vocab``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {f"t{i}": i for i in range(vocab)} | ({"</s>": vocab} if eos else {})
    words = Tokenizer(models.WordLevel(ids, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece()  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=words, **({"eos_token": "</s>"} if eos else {}))


def tiny_tokenizer(vocab: int = VOCAB) -> Any:
    """An ``mlx_lm`` TokenizerWrapper over the words ``t0 .. t{vocab-1}`` (whitespace-separated, no EOS)."""
    wrapper = import_extra("mlx_lm.tokenizer_utils", "tiny_tokenizer", EXTRAS).TokenizerWrapper
    # no EOS ids given: mlx-lm 0.31's wrapper would take the tokenizer's missing one as {None} (0.32's as {})
    return wrapper(_words(vocab), eos_token_ids=[])


__all__ = ["CHAT_TEMPLATE", "FAMILIES", "VOCAB", "save_tiny_lm", "tiny_config", "tiny_lm", "tiny_tokenizer"]
