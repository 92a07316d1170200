"""A tiny random mlx-vlm Qwen4-Exp, built in code or saved in mlx-vlm's format (no downloads).

:func:`tiny_qwen4_exp` is the whole ``mlx_vlm.models.qwen4_exp.Model`` (a one-block vision tower and the
language model) with the real structure: hybrid layers, three Gated-DeltaNet layers then a QSA layer, twice;
4 query / 2 KV heads of dim 32; the QSA indexer with a budget of 16 tokens at ratio 4, so past 20 tokens the
selection is sparse. :func:`save_tiny_qwen4_exp` writes it with a byte-level tokenizer (each byte a token:
transformers loads a Qwen4-Exp tokenizer as Qwen3.5's byte-level BPE whatever ``tokenizer.json`` declares),
which ``mlx_vlm.load`` and mlx-vlm's command line read. Needs ``mlx-vlm`` (the ``clients`` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BYTES = 256  # the token ids of the byte-level tokenizer; the 4 vision tokens follow
TEXT = {
    "model_type": "qwen4_exp", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "linear_num_value_heads": 2, "linear_num_key_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 2,
    "num_experts_per_tok": 1, "shared_expert_intermediate_size": 16, "moe_intermediate_size": 16,
    "rms_norm_eps": 1e-6, "vocab_size": BYTES + 4, "max_position_embeddings": 4096, "indexer_budget": 16,
    "indexer_compress_ratio": 4, "indexer_head_dim": 32, "indexer_n_heads": 4, "indexer_kv_heads": 1,
    "hc_lowrank": 8,
}  # fmt: skip
VISION = {
    "model_type": "qwen4_exp", "depth": 1, "hidden_size": 32, "intermediate_size": 32, "out_hidden_size": 64,
    "num_heads": 2, "num_position_embeddings": 16, "fullatt_block_indexes": [],
}  # fmt: skip
CONFIG = {
    "model_type": "qwen4_exp", "text_config": TEXT, "vision_config": VISION, "vocab_size": BYTES + 4,
    "image_token_id": BYTES, "video_token_id": BYTES + 1, "vision_start_token_id": BYTES + 2,
    "vision_end_token_id": BYTES + 3,
}  # fmt: skip


def tiny_qwen4_exp(*, seed: int = 3) -> Any:
    """The random ``mlx_vlm.models.qwen4_exp.Model`` of :data:`CONFIG` in float32, parameters evaluated."""
    import mlx.core as mx
    from mlx_vlm.models.qwen4_exp import config, qwen4_exp

    text, vision = config.TextConfig.from_dict(TEXT), config.VisionConfig.from_dict(VISION)
    mx.random.seed(seed)
    model = qwen4_exp.Model(config.ModelConfig.from_dict({**CONFIG, "text_config": text, "vision_config": vision}))
    mx.eval(model.parameters())
    return model


def save_tiny_qwen4_exp(directory: str | Path, *, seed: int = 3) -> Path:
    """:func:`tiny_qwen4_exp` and a byte-level tokenizer (with a chat template), saved to ``directory``."""
    from mlx_lm.utils import save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, tiny_qwen4_exp(seed=seed))
    (path / "config.json").write_text(json.dumps(CONFIG, indent=1) + "\n")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet))}, []))
    tokens.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokens.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokens)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL)})  # ids BYTES.. in this order
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


SPECIAL = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
# mlx-vlm's messages hold a list of parts ({"type": "text", "text": ...}); mlx-lm's a string
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n{% endfor %}"
)

__all__ = ["CHAT_TEMPLATE", "CONFIG", "SPECIAL", "save_tiny_qwen4_exp", "tiny_qwen4_exp"]
