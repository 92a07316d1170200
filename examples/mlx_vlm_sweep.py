"""The mlx-vlm sweep: every model family's language model in the installed mlx-vlm, one row each.

The mlx-lm sweep's machinery (``examples/mlx_lm_sweep.py``: its cases, drop-in checks, verdicts, processes, time
boxes and table), run on mlx-vlm's language models. Every package of ``mlx_vlm.models`` whose language model is
found (:func:`language_class`: its ``language`` module's ``LanguageModel``, else the one the package or its
``Model``'s module imports) is a family; the others are listed with why: helper modules, and packages that are no
language model (:data:`NOT_LANGUAGE`: vision encoders, embedders, image generators, detectors, OCR heads without a
decoder). Each language model is built alone, seeded, from a tiny configuration generated from its
``TextConfig`` (or ``ModelConfig`` for a text-only family; :func:`tiny_configs`): the mlx-lm sweep's ``TINY``
and ``FILL`` by field name, with :data:`SIZES`, then the mlx-lm sweep's hand-written ``OVERRIDES`` and this
sweep's :data:`OVERRIDES` of the family whose language model it is and of the family itself; a language model that
takes the family's ``ModelConfig`` too (the vision configuration its positions read: mRoPE's merge sizes) gets one
around the text configuration, its other sub-configurations generated the same way.

As mlx-vlm's ``generate`` runs it (``mlx_vlm/generate/ar.py``: ``cache.make_prompt_cache(model.language_model)``,
then ``model.language_model(ids, cache=...)`` on the prompt and on each new token, the logits read from its
``LanguageModelOutput``), a language model is called through :func:`text_model`: token ids in, logits out, its
own caches (its ``make_cache()``, else mlx-vlm's ``KVCache`` per layer). The prompt is text only: no image, so
no ``inputs_embeds`` from a vision tower; where the family's ``Model`` sets its language model's positions from the
prompt in ``get_input_embeddings`` (``_set_position_state``: minicpmo, the minicpmv4 family), a sequence's first
call sets them first, as that does. What a ``Model`` attaches to its language model when it builds it
(:data:`ATTACHED`) is attached too. mlx-lm's ``generate_step`` and ``speculative_generate_step`` then drive it as
they drive an mlx-lm model (the drop-in checks, declined by name for the families they cannot drive:
:data:`UNDRIVEN`; the speculative one where every cache trims). Each family's process runs with torch hidden
(:func:`main`).

Run: ``.venv/bin/python examples/mlx_vlm_sweep.py [--write docs/mlx_vlm_families.md] [FAMILY ...]``
(``make zoo-vlm``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import pkgutil
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

_SPEC = importlib.util.spec_from_file_location("mlx_lm_sweep", Path(__file__).resolve().parent / "mlx_lm_sweep.py")
lm = sys.modules["mlx_lm_sweep"] = importlib.util.module_from_spec(_SPEC)  # registered: its dataclasses resolve
_SPEC.loader.exec_module(lm)
zoo = lm.zoo

# Packages of mlx_vlm.models that hold no language model to generate with: no row, the reason on the page.
NOT_LANGUAGE: dict[str, str] = {
    **dict.fromkeys(("bert", "modernbert", "xlm_roberta", "gliner2_5", "lfm2_encoder"), "a text encoder, no decoder"),
    **dict.fromkeys(
        ("colidefics3", "colqwen2_5", "embedding_gemma2", "gemma3_embedding", "lfm2_colbert", "lfm2_embedding",
         "llama_bidirec", "llama_nemotron_vl_embedding", "ministral3_embedding", "qwen3_embedding",
         "qwen3_vl_embedding", "laya"),
        "an embedder (pooled or per-token vectors), no generation",
    ),
    **dict.fromkeys(("dinov2", "sapiens2", "moge3", "video_depth_anything"), "a vision encoder (features, depth)"),
    **dict.fromkeys(
        ("flux2", "flux3", "ernie_image", "ideogram4", "llada_image", "mage_flow", "ming_image", "minimax_h3",
         "moss_image", "qwen_image", "z_image", "bonsai"),
        "an image or video generator (diffusion), no language model",
    ),
    **dict.fromkeys(
        ("rfdetr", "rt_detr_v2", "yolo11", "pp_doclayout_v3", "sam3", "sam3_1", "sam3d_body", "sam3d_objects"),
        "a detector or segmenter (boxes, masks, layouts), no language model",
    ),
    "openai_privacy_filter": "a token classifier (PII spans), no generation",
    "decider2": "a classifier over an encoder, no generation",
    "d1_omni": "a decision head over an encoder trunk (answers chosen, not generated), no language model",
    "siglip": "a contrastive image-text encoder, no decoder",
    "nemotron_voicechat": "a duplex speech model around nemotron_h's decoder (its own row: nemotron_h)",
    "mistral4": "layers only, no LanguageModel (mistral3's language model is built from them: its own row)",
    "nemotron_parse": "an OCR encoder-decoder: its decoder reads the image encoder's outputs, no text-only prompt",
}  # fmt: skip

# Sizes beyond the mlx-lm sweep's TINY, set on every family (every configuration) that has the field.
SIZES: dict[str, Any] = {
    "sliding_window_pattern": 2,  # sliding and global layers within the 2 layers (defaults of 4 to 6 put none)
    "attention_head_dim": zoo.HEAD_DIM, "top_k_experts": 2,
    "vocab_size_per_layer_input": zoo.VOCAB, "hidden_size_per_layer_input": 8,  # per-layer embeddings (gemma4)
    "depth": 2, "patch_size": 14,  # vision configurations' required sizes (glm4v)
    "block_ff_dim": 128, "embedding_size": zoo.VOCAB, "conv_dim": zoo.HIDDEN, "conv_dim_out": zoo.HIDDEN,
    "block_dim": zoo.HIDDEN,  # lfm2's model width for its feed-forward blocks (lfm2_vl's default 1024, not its hidden)
}  # fmt: skip

# Where generation cannot work: each family's fields beyond SIZES, TINY, FILL and the mlx-lm sweep's overrides, each
# with its reason.
OVERRIDES: dict[str, dict[str, Any]] = {
    "lfm2_vl": dict(layer_types=["conv", "full_attention"]),  # mlx-lm's name is lfm2-vl: one conv, one attention
    "gemma3n": dict(intermediate_size=[128] * zoo.LAYERS),  # per layer
    # it requires NoPE MLA with as many KV heads as query heads, its top-k a multiple of its pooling; one linear-attention
    # layer, then the sparse one (its default puts one every 4 layers: none in 2); the top 2 pools of 2 (TINY's top-k
    # 4) and the partial tail: of the prompt's 5 pools and 7 to 16 keys, some dropped
    "glm5_next": dict(num_key_value_heads=zoo.HQ, qk_rope_head_dim=0, mla_use_nope=True, index_kpool=2,
                      layer_types=["linear_attention", "deepseek_sparse_attention"]),
    # its xdrope sections (4 axes) cover half the head dim
    "hunyuan_vl": dict(rope_scaling={"type": "xdrope", "xdrope_section": [1, 1, 1, 1], "alpha": 1000.0,
                                     "factor": 1.0}),
    "ernie4_5_moe_vl": dict(mrope_section=[1, 1, 2]),  # mRoPE sections (h, w interleaved: equal; t): half the head dim
    "limite": dict(rope_n_pairs=2),  # rotated pairs within the head dim
    # its per-head value scales assume as many KV heads as query heads; its rotated dims (32) within the head dim
    "moondream3": dict(num_key_value_heads=zoo.HQ, rope_dim=4),
    # its n-gram tables (engram) are 384M rows of 256 by default (393 GB: MLX segfaults allocating them); small ones at
    # layer 1 (the language model alone has no tokenizer, so it hashes no n-grams and never reads them), a small
    # output rank; its FP8 fake quantization works in blocks of 32 of the last axis: head dim and query rank 32. Layer 1
    # compresses pairs of tokens (its default ratios start with 2 window-only layers) and selects from them (its own
    # compressed KV and index keys: its source layers default to 2, 8, ...), the top 2 of the 3 to 8 entries (and the
    # window of 8: TINY's), so every case drops some; its index keys are fake-quantized in blocks of 32 too
    "deepseek_v41": dict(engram_layer_ids=[1], engram_num_embeddings=[96], engram_vocab_size=16, engram_n_heads=2,
                         engram_head_dim=8, engram_max_ngram_size=3, o_lora_rank=16, head_dim=32, q_lora_rank=32,
                         compress_ratios=[0, 2], kv_source_layer_ids=[1], index_source_layer_ids=[1], index_topk=2,
                         index_head_dim=32),
    # layer 1 sparse (compressing by 4 and selecting the top entry; its default ratios for 2 layers are [0, 0], window
    # only): a cached step sees 3 or 4 entries (a prefill of 7 tokens makes 1: compressed, not selected, attention)
    "deepseek_v4": dict(compress_ratios=[0, 4], index_topk=1),
    # layer 0 sparse (as mlx-lm's: its layer_types name the sparse layers), blocks of 2 and the top 2 (with the local
    # block): 4 of the 7 to 16 keys (a sparse layer runs where the keys exceed top-k times block)
    "minimax_m3_vl": dict(layer_types=["minimax_m3_sparse", "full_attention"], index_block_size=2,
                          index_topk_blocks=2, index_local_blocks=1),
    # the text model's type: llama's, the one these support
    **{f: dict(model_type="llama") for f in ("llava", "llava_next", "multi_modality")},
    # as mlx-lm's qwen3_5 (their language models are its, in their own modules): one linear-attention layer, one
    # full-attention layer
    **{f: dict(full_attention_interval=2) for f in ("qwen3_5_text", "qwen3_5_moe_text", "minicpmv4_6")},
    # and image/video token ids outside the vocabulary (None by default: it compares the tokens with them)
    "minicpmv4_7": dict(full_attention_interval=2, image_token_id=zoo.VOCAB, video_token_id=zoo.VOCAB + 1),
    "nemotron_nas": lm.OVERRIDES["nemotron-nas"],  # mlx-lm's name is nemotron-nas: its blocks one by one
    "mimo_v2": lm.OVERRIDES["mimo_v2_flash"],  # its language model is mimo_v2_flash's: per-layer lists
    "nemotron_h_nano_omni": lm.OVERRIDES["nemotron_h"],  # its language model is nemotron_h's: one Mamba layer
    # hybrid: one linear-attention (gated delta) layer, then the QSA attention layer; its indexer small
    "qwen4_exp": dict(layer_types=["linear_attention", "full_attention"], indexer_budget=16, indexer_compress_ratio=4,
                      indexer_head_dim=8, indexer_n_heads=4, indexer_kv_heads=1, hc_lowrank=8),
}  # fmt: skip

HELPER_REASON = "a helper module, not a model family"


def _jina_vlm_head(language_model: Any, text: Any) -> None:
    import mlx.nn as nn

    language_model.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)


# What a family's Model does to its language model after building it (as its __init__ does), each with where.
ATTACHED: dict[str, Callable[[Any, Any], None]] = {
    "jina_vlm": _jina_vlm_head,  # its lm_head: the Model attaches it (jina_vlm.py:173), its LanguageModel reads it
}

# Families that mlx-lm's generate_step cannot drive, with why: their drop-in checks are declined with it, not run.
UNDRIVEN: dict[str, str] = {
    # mlx-vlm's generate routes it to its diffusion path (a ModelConfig with canvas_length): never token by token
    "diffusion_gemma": "not autoregressive: mlx-vlm generates with it by denoising a canvas "
    "(stream_diffusion_generate); its call decodes a fresh random canvas (mx.random.randint), not the next token",
    # mlx-lm's phi3small writes out[..., ids] (the vocabulary axis)
    "phi3small": "module: its logits mask writes -inf at rows 100256-100351 of the batch axis (out[ids] = -inf, "
    "language.py:263), out of bounds for any batch: MLX's CPU scatter does not check, the process segfaults",
}


# ----------------------------------------------------------------------------- the families


def language_class(family: str) -> type | None:
    """``family``'s language-model class: its ``language`` module's ``LanguageModel``, else the one its package
    or its ``Model``'s module exports (its ``Model`` where that is a placeholder, not callable); None if none."""
    package = importlib.import_module(f"mlx_vlm.models.{family}")
    if importlib.util.find_spec(f"mlx_vlm.models.{family}.language"):
        found = getattr(importlib.import_module(f"mlx_vlm.models.{family}.language"), "LanguageModel", None)
        if found is not None and "__call__" in dir(found):
            return found
    model = getattr(package, "Model", None)
    owners = [package] + ([sys.modules[model.__module__]] if model is not None else [])
    found = next((o.LanguageModel for o in owners if hasattr(o, "LanguageModel")), None)
    return model if found is not None and "__call__" not in dir(found) else found  # phi3_v's is a placeholder


@functools.cache
def families() -> tuple[list[str], dict[str, str]]:
    """``(families, skipped)``: the installed ``mlx_vlm.models`` packages with a language model, sorted, and the
    other modules with why (importing every package: once a process)."""
    import mlx_vlm.models

    found, skipped = [], {}
    for info in sorted(pkgutil.iter_modules(mlx_vlm.models.__path__), key=lambda i: i.name):
        if not info.ispkg:
            skipped[info.name] = HELPER_REASON
        elif info.name in NOT_LANGUAGE:
            skipped[info.name] = NOT_LANGUAGE[info.name]
        else:
            try:
                language = language_class(info.name)
            except BaseException as exc:  # noqa: BLE001  (an optional dependency missing: it does not import)
                skipped[info.name] = f"does not import: {lm._short(exc)}"
                continue
            if language is None:
                skipped[info.name] = "no LanguageModel in the package"
            else:
                found.append(info.name)
    return found, skipped


# ----------------------------------------------------------------------------- tiny configurations


def _config_classes(family: str) -> tuple[type | None, type | None]:
    """``(TextConfig, ModelConfig)`` of ``family`` (None where it has none): its package's, else its ``config``
    module's."""
    package = importlib.import_module(f"mlx_vlm.models.{family}")
    has_config = importlib.util.find_spec(f"{package.__name__}.config") is not None
    config = importlib.import_module(f"{package.__name__}.config") if has_config else package
    return tuple(getattr(package, n, None) or getattr(config, n, None) for n in ("TextConfig", "ModelConfig"))


def _fields(family: str, config: type) -> dict[str, Any]:
    """Keywords of the dataclass ``config`` for a tiny ``family``: ``lm.tiny_fields`` with :data:`SIZES`, then the
    mlx-lm sweep's overrides and :data:`OVERRIDES` of the family whose language model it is (clef's is
    qwen3_5's), then of ``family``; a required ``model_type`` is the family's name."""
    owner = language_class(family).__module__.split(".")[2]  # whose language model it is: smolvlm's is idefics3's
    overrides = dict(SIZES)
    for name in dict.fromkeys((owner, family)):
        overrides.update({**lm.OVERRIDES.get(name, {}), **OVERRIDES.get(name, {})})
    args = lm.tiny_fields(family, config, overrides)
    if any(f.name == "model_type" and _required(f) for f in dataclasses.fields(config)):
        args.setdefault("model_type", family)
    return args


def _model_config(family: str, model_config: type, text: Any) -> Any:
    """The family's ``ModelConfig`` around the tiny ``text`` configuration; each other sub-configuration
    (``vision_config``, ...: a language model reads its merge sizes; phi3_v's is built with it) generated as the
    text one is, from its dataclass, where that fills its required fields or it has no default."""
    args = _fields(family, model_config)
    hints = typing.get_type_hints(model_config)
    for field in dataclasses.fields(model_config):
        config = _dataclass(hints.get(field.name))
        if field.name == "text_config":
            args[field.name] = text
        elif field.name not in args and config is not None:
            sub = _fields(family, config)
            if _required(field) or all(f.name in sub for f in dataclasses.fields(config) if _required(f)):
                args[field.name] = config(**sub)  # else its default: one this sweep cannot fill (llama4's vision)
    return model_config(**args)


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _dataclass(hint: Any) -> type | None:
    """The dataclass a type hint names (``VisionConfig``, ``Optional[VisionConfig]``), else None."""
    found = [h for h in (hint, *typing.get_args(hint)) if isinstance(h, type) and dataclasses.is_dataclass(h)]
    return found[0] if found else None


def tiny_configs(family: str) -> tuple[type, list[Any]]:
    """``(LanguageModel, its positional configurations)`` for a tiny ``family``. A parameter typed with the family's
    ``ModelConfig`` (or, after the first, with any ``ModelConfig``, or untyped and required) gets the family's
    model configuration around the tiny text one (:func:`_model_config`; as mlx-vlm's ``Model`` passes its own:
    clef's language model is qwen3_5's), even where it is optional (a language model reads its vision
    configuration from it); the first parameter otherwise gets the text configuration (whatever its type: got's
    language model is qwen2's, typed with qwen2's ``ModelConfig``); a later one typed with another configuration
    that configuration around the text one (qwen3_omni_moe's ``ThinkerConfig``). A text-only family's language
    model gets its tiny ``ModelConfig`` instead of the text one. An untyped parameter with a default ends them."""
    language = language_class(family)
    text_config, model_config = _config_classes(family)
    if text_config is None:
        text = model_config(**_fields(family, model_config))
        whole = functools.cache(lambda: text)
    else:
        text = text_config(**_fields(family, text_config))
        whole = functools.cache(lambda: _model_config(family, model_config, text))  # only where one is taken
    hints = typing.get_type_hints(language.__init__)
    args: list[Any] = []
    parameters = list(inspect.signature(language.__init__).parameters.values())[1:]
    for i, parameter in enumerate(p for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD):
        hint = _dataclass(hints.get(parameter.name))
        named = hint is not None and hint.__name__ == "ModelConfig"
        if hint is model_config or (i > 0 and (named or (hint is None and parameter.default is parameter.empty))):
            args.append(whole())
        elif i == 0:
            args.append(text)
        elif hint is not None:  # another configuration around the text one (qwen3_omni_moe's ThinkerConfig)
            args.append(_model_config(family, hint, text))
        else:
            break
    return language, args


# ----------------------------------------------------------------------------- the models


@functools.cache
def text_model() -> type:
    """The class calling a language model as mlx-vlm's ``generate`` does: ``TextModel(language_model)(ids,
    cache)`` is the logits; ``make_cache()`` mlx-vlm's ``cache.make_prompt_cache(language_model)``. An
    ``mlx.nn.Module`` holding it as ``language_model`` (what ``optimize`` enters, as for a VLM). A new cache, or
    none, starts a new sequence: the mRoPE positions a language model keeps from the last one are reset first
    (:data:`SEQUENCE_STATE`, as ``generate_step`` resets them), else they would be sliced for this one. ``start``:
    the family's ``Model._set_position_state`` where it has one (its ``get_input_embeddings`` sets the language
    model's positions from the prompt's ids, which mlx-vlm's ``generate`` runs before the prompt's call), run as
    that does on a sequence's first call."""
    import mlx.nn as nn

    class TextModel(nn.Module):
        def __init__(self, language_model: Any, start: Callable[[Any, Any], None] | None = None) -> None:
            super().__init__()
            self.language_model = language_model
            self.start = start

        def __call__(self, inputs: Any, cache: Any = None) -> Any:
            if cache is None:
                self.reset()
            if self.start is not None and self.language_model._position_ids is None:  # a sequence's first call
                self.start(self, inputs)  # on a Model's behalf: it reads its language_model, as this holds it
            out = self.language_model(inputs, cache=cache)
            return getattr(out, "logits", out)  # a LanguageModelOutput; some language models return the logits

        def make_cache(self) -> list[Any]:
            from mlx_vlm.models.cache import make_prompt_cache

            self.reset()
            return make_prompt_cache(self.language_model)

        def reset(self) -> None:
            for name in SEQUENCE_STATE:
                if hasattr(self.language_model, name):
                    setattr(self.language_model, name, None)

    return TextModel


SEQUENCE_STATE = ("_position_ids", "_rope_deltas")  # a language model's attributes that hold its last sequence's


@functools.lru_cache(maxsize=None)
def vlm_model(family: str, dtype: str, configure: Callable[[str], tuple[type, list[Any]]] = tiny_configs) -> Any:
    """The tiny ``family``'s language model (weights seeded, evaluated) in a :func:`text_model`."""
    import mlx.core as mx

    language, args = configure(family)
    mx.random.seed(0)
    language_model = language(*args)
    if family in ATTACHED:
        ATTACHED[family](language_model, args[0])
    owner = getattr(importlib.import_module(f"mlx_vlm.models.{family}"), "Model", None)
    model = text_model()(language_model, getattr(owner, "_set_position_state", None))
    model.set_dtype(mx.bfloat16 if dtype == "bf16" else mx.float32)
    model.eval()  # inference mode, as mlx_vlm.load leaves it (GLM-5-Next, DeepSeek-V4, MoE layers branch on it)
    mx.eval(model.parameters())
    return model


MLX_VLM = lm.Library(
    package="mlx_vlm", name="mlx-vlm", script=str(Path(__file__).resolve()), target="zoo-vlm", families=families,
    configure=tiny_configs, build=vlm_model, undriven=UNDRIVEN,
    configurations="Configurations are generated from each language model's `TextConfig` (a text-only family's "
    "`ModelConfig`) by field name (the mlx-lm sweep's `TINY` and `FILL`, this sweep's `SIZES`), then the mlx-lm "
    "sweep's `OVERRIDES` of the family whose language model it is and of the family (they share names); this "
    f"sweep's `OVERRIDES` sets fields by hand for {len(OVERRIDES)} families, each with its reason in a comment. A "
    "language model that takes the `ModelConfig` too gets one around the text configuration, its other "
    "sub-configurations (vision, audio) generated the same way where that fills their required fields.",
    unlisted="Modules of `mlx_vlm.models` without a row:",
)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """The mlx-lm sweep's command line (``lm.main``) over mlx-vlm's families. A family's process (``--child``) runs
    with torch hidden: mlx-vlm imports transformers, which imports torch when it finds it (3 of a process's 4 s
    of start), and no language model uses it."""
    if "--child" in (sys.argv if argv is None else argv):
        sys.modules.setdefault("torch", None)  # transformers then finds no torch; importing it raises ImportError
    return lm.main(argv, MLX_VLM)


if __name__ == "__main__":
    raise SystemExit(main())
