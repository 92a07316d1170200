"""Tiny random mlx-vlm models of a few families, built in code or saved in mlx-vlm's format (no downloads).

:func:`tiny_vlm` is the whole ``mlx_vlm.models.<family>.Model`` (a one-block vision tower and the language model)
of :data:`FAMILIES`, built as ``mlx_vlm.load`` builds it from the family's ``config.json``; :func:`save_tiny_vlm`
writes it with a byte-level tokenizer (each byte a token, then the family's special tokens) and whatever else the
family's processor reads, which ``mlx_vlm.load`` and mlx-vlm's command line and server read offline. Each family
has 64-wide language layers of 4 query / 2 KV heads and a 260-token vocabulary:

- ``qwen4_exp``: hybrid layers, three Gated-DeltaNet layers then a QSA layer, twice; heads of dim 32; the QSA
  indexer with a budget of 16 tokens at ratio 4, so past 20 tokens the selection is sparse (its own kernel's
  calls, with its own caches).
- ``qwen2_vl``: two layers of heads of dim 16 with mRoPE, calling mlx-vlm's attention helper with plain
  ``KVCache``\\ s.
- ``gemma3``: a sliding-window layer (a ``RotatingKVCache`` of 16 tokens, so a longer prompt rotates it) then a
  global one (a ``KVCache``), heads of dim 16; its embeddings tied, as mlx-vlm loads them.

Needs ``mlx-vlm`` (the ``clients`` extra).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnpass.ir.core.arguments import require_choice

BYTES = 256  # the token ids of the byte-level tokenizer; a family's special tokens follow


@dataclass(frozen=True)
class Family:
    """What a tiny model of a family is saved as: its ``config.json``, its special tokens (ids :data:`BYTES`, ...
    in this order), the one of them that pads (a processor that pads a batch needs one), the tokenizer attributes
    that name some of them (gemma3's processor reads ``tokenizer.image_token``), and the other JSON files its
    processor reads."""

    config: dict[str, Any]
    special: tuple[str, ...]
    pad: str | None = None
    named: dict[str, str] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)


_QWEN4_TEXT = {
    "model_type": "qwen4_exp", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "linear_num_value_heads": 2, "linear_num_key_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 2,
    "num_experts_per_tok": 1, "shared_expert_intermediate_size": 16, "moe_intermediate_size": 16,
    "rms_norm_eps": 1e-6, "vocab_size": BYTES + 4, "max_position_embeddings": 4096, "indexer_budget": 16,
    "indexer_compress_ratio": 4, "indexer_head_dim": 32, "indexer_n_heads": 4, "indexer_kv_heads": 1,
    "hc_lowrank": 8,
}  # fmt: skip
_QWEN4_VISION = {
    "model_type": "qwen4_exp", "depth": 1, "hidden_size": 32, "intermediate_size": 32, "out_hidden_size": 64,
    "num_heads": 2, "num_position_embeddings": 16, "fullatt_block_indexes": [],
}  # fmt: skip
_QWEN_SPECIAL = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")

FAMILIES: dict[str, Family] = {
    "qwen4_exp": Family(
        {"model_type": "qwen4_exp", "text_config": _QWEN4_TEXT, "vision_config": _QWEN4_VISION,
         "vocab_size": BYTES + 4, "image_token_id": BYTES, "video_token_id": BYTES + 1,
         "vision_start_token_id": BYTES + 2, "vision_end_token_id": BYTES + 3},
        _QWEN_SPECIAL,
    ),
    "qwen2_vl": Family(  # the text configuration at the top level, as Qwen2-VL's checkpoints have it
        {"model_type": "qwen2_vl", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": BYTES + 5,
         "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "image_token_id": BYTES,
         "video_token_id": BYTES + 1, "vision_start_token_id": BYTES + 2,
         "vision_config": {"model_type": "qwen2_vl", "depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                           "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}},
        (*_QWEN_SPECIAL, "<|endoftext|>"),
        "<|endoftext|>",
    ),
    "gemma3": Family(
        {"model_type": "gemma3", "vocab_size": BYTES + 4, "image_token_index": BYTES, "hidden_size": 64,
         "pad_token_id": BYTES + 3,
         "text_config": {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
                         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                         "vocab_size": BYTES + 4, "query_pre_attn_scalar": 16, "sliding_window": 16,
                         "sliding_window_pattern": 2, "mm_tokens_per_image": 4},
         "vision_config": {"model_type": "siglip_vision_model", "num_hidden_layers": 1, "hidden_size": 32,
                           "intermediate_size": 32, "num_attention_heads": 2, "patch_size": 14, "image_size": 28}},
        ("<image_soft_token>", "<start_of_image>", "<end_of_image>", "<pad>"),
        "<pad>",
        {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
        {"preprocessor_config.json": {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 28,
                                      "width": 28}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
         "processor_config.json": {"processor_class": "Gemma3Processor", "image_seq_length": 4}},
    ),
}  # fmt: skip


def tiny_vlm(family: str = "qwen4_exp", *, seed: int = 3) -> Any:
    """The random ``mlx_vlm.models.<family>.Model`` of :data:`FAMILIES` in float32, parameters evaluated: built
    from its configuration as ``mlx_vlm.load`` builds it, its weights passed through the family's ``sanitize`` as
    ``load`` passes them (gemma3 ties its head to its embeddings there), so the saved model loads back equal."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm import utils

    require_choice("tiny_vlm", "family", family, tuple(FAMILIES))
    config = json.loads(json.dumps(FAMILIES[family].config))  # a copy: mlx-vlm's from_dict edits it
    module, _ = utils.get_model_and_args(config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = module.ModelConfig.from_dict(config)
    model_config = utils.update_module_configs(model_config, module, config, ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    weights = utils.sanitize_weights(model, dict(tree_flatten(model.parameters())))
    for part, name in (("VisionModel", "vision_config"), ("LanguageModel", "text_config")):  # as load_model does
        if hasattr(module, part) and hasattr(model_config, name):
            weights = utils.sanitize_weights(getattr(module, part), weights, getattr(model_config, name))
    model.load_weights(list(weights.items()))
    model.eval()  # inference mode, as mlx_vlm.load leaves it
    mx.eval(model.parameters())
    return model


def save_tiny_vlm(directory: str | Path, family: str = "qwen4_exp", *, seed: int = 3) -> Path:
    """:func:`tiny_vlm` of ``family``, its tokenizer (with :data:`CHAT_TEMPLATE`) and its processor's files, saved
    to ``directory`` (created). Returns the directory."""
    from mlx_vlm.utils import save_weights
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_vlm(family, seed=seed)
    spec = FAMILIES[family]
    path = Path(directory)
    save_weights(path, model)
    (path / "config.json").write_text(json.dumps(spec.config, indent=1) + "\n")
    for name, content in spec.files.items():
        (path / name).write_text(json.dumps(content, indent=1) + "\n")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet))}, []))
    tokens.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokens.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokens, extra_special_tokens=dict(spec.named))
    tokenizer.add_special_tokens({"additional_special_tokens": list(spec.special)})  # ids BYTES.. in this order
    tokenizer.pad_token = spec.pad
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


# mlx-vlm's messages hold a list of parts ({"type": "text", "text": ...}); mlx-lm's a string
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}"
)

__all__ = ["BYTES", "CHAT_TEMPLATE", "FAMILIES", "Family", "save_tiny_vlm", "tiny_vlm"]
