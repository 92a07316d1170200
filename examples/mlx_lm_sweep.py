"""The sweep: every model family of the installed mlx-lm, imported, raised, lowered and checked, one row each.

Every module of ``mlx_lm.models`` that defines ``Model`` and ``ModelArgs`` is a family (helper modules are listed
with why they are skipped). Each gets a tiny random configuration generated from its ``ModelArgs``
(:func:`tiny_args`: fields filled by name from :data:`TINY` and :data:`FILL`, the model zoo's sizes;
:data:`OVERRIDES` only where generation cannot work), then the model zoo's cases (``examples/model_zoo.py``):
prefill, verify and decode, float32 and bfloat16, through ``from_mlx`` -> ``raise-attention`` -> ``head-chunk`` ->
MLX, compared with the module; and two drop-in checks (:data:`DROP_INS`), each under its own ``optimize(model,
min_keys=0)``, against the plain model's greedy tokens (float32, 8 tokens, ``generate_step``): its greedy tokens,
and mlx-lm's ``speculative_generate_step`` with a plain draft of the same weights (multi-row verify calls on a
warm cache; ``n/a`` where mlx-lm refuses it, a cache not trimmable, or itself gives other tokens than greedy).

A family ends as **handled** (every case imports, raises all its attention layers and matches; the drop-in
checks' tokens identical), **declined** (a case's import raised ``ModelImportError``, or raise-attention declined
a layer with a remark, or the module itself needs Metal (:func:`needs_metal`), or a case mismatches only the
module's compiled run (``module:``, :func:`mismatch`: with ``mx.compile`` off it matches; the module computes
otherwise compiled than its code says, which the import follows): the reason, quoted) or **failed** (any other
exception, a mismatch beyond the zoo's tolerance, a layer left unraised without a remark, different tokens from a
drop-in check, a timeout, or a configuration that does not build).
Each family runs in its own process, each case under :data:`CASE_TIMEOUT`.
Its softmax-attention layers are counted by structure, by raise-attention's
own matcher on the float32 prefill's import (:func:`attention_layers`; where
that import declines, each case that imports counts its own): a
softmax that no matmul contracts with V (an MoE router, a mixing or pooling
weight) is not attention; a layer left unraised must have a declined remark.

Run: ``.venv/bin/python examples/mlx_lm_sweep.py [--write docs/mlx_lm_families.md] [FAMILY ...]`` (``make zoo``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import functools
import importlib
import importlib.util
import json
import pkgutil
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

from attnpass.ir import Graph, ModelImportError, from_mlx
from attnpass.passes import PassManager, parse_pipeline
from attnpass.passes.analysis.attention_match import match_attention


def _sibling(name: str) -> Any:
    """``examples/<name>.py`` as a module (registered, so its dataclasses resolve), wherever this file runs from."""
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


zoo = _sibling("model_zoo")  # the zoo's machinery: configurations, cases, tolerance

CASE_TIMEOUT = 60  # seconds per case; the family's process gets one per case, layer count and drop-in check
OPTIMIZE_TOKENS = 8
DRAFT_TOKENS = 3  # drafted per speculative verify step: 4-row verify calls
STATUSES = ("handled", "declined", "failed")
DROP_INS = ("optimize", "speculative")  # the drop-in checks of a family, in its record and the table's columns

# Sizes: set on every family that has the field, whatever its default (the zoo's COMMON and a few MoE/MLA/hybrid
# sizes, small).
TINY: dict[str, Any] = {
    **zoo.COMMON,
    **zoo.MOE,
    "num_experts": 4, "num_experts_per_token": 2, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "n_shared_experts": 1, "num_kv_shared_layers": 0,
    "num_shared_experts": 1, "num_shared_expert": 1, "moe_topk": 2, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "expert_ffn_hidden_size": 32, "ffn_hidden_size": 128, "ff_intermediate_size": 128, "intermediate_size_mlp": 128,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "n_embd": zoo.HIDDEN, "n_head": zoo.HQ, "n_layer": zoo.LAYERS, "n_positions": 512, "n_ctx": 512, "n_inner": 128,
    "num_layers": zoo.LAYERS, "n_layers": zoo.LAYERS, "num_heads": zoo.HQ, "n_heads": zoo.HQ, "num_kv_heads": zoo.HKV,
    "n_kv_heads": zoo.HKV, "d_model": zoo.HIDDEN, "model_dim": zoo.HIDDEN, "hidden_dim": 128,
    "num_query_heads": zoo.HQ, "num_attention_groups": zoo.HKV,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4, "conv_kernel": 4, "conv1d_width": 4, "state_size": 8, "ssm_state_size": 8,
    "mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 1,
    "time_step_rank": 8, "index_head_dim": 8, "index_n_heads": 2, "index_topk": 4,
    "swa_num_attention_heads": zoo.HQ, "swa_num_key_value_heads": zoo.HKV, "swa_head_dim": zoo.HEAD_DIM,
    "swa_v_head_dim": zoo.HEAD_DIM, "sliding_window": 8, "sliding_window_size": 8, "attention_window_size": 8,
    "model_max_length": 512, "rotary_dim": 4,
}  # fmt: skip

# Values for required fields (no default) that are not sizes.
FILL: dict[str, Any] = {
    "layer_norm_epsilon": 1e-5, "layer_norm_eps": 1e-5, "norm_eps": 1e-5, "layernorm_epsilon": 1e-5,
    "attention_bias": False, "use_bias": False, "mlp_bias": False, "use_qkv_bias": False, "conv_bias": True,
    "use_conv_bias": True, "norm_topk_prob": True, "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5,
    "rotary_pct": 0.5, "rope_scaling": None, "rope_parameters": None, "topk_method": "greedy",
    "scoring_func": "softmax", "mlp_only_layers": [], "decoder_sparse_step": 1, "moe_layer_freq": 1,
    "use_qk_norm": False, "qk_norm": False, "logits_scaling": 1.0, "attention_multiplier": 0.125,
    "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "hidden_act": "silu", "rotary_emb_base": 10000.0,
    "swa_rope_theta": 10000.0, "dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 1.0, "logits_soft_cap": 30.0,
    "post_norm": False, "use_expert_bias": False, "mla_scale_q_lora": False, "mla_scale_kv_lora": False,
    "time_step_limit": (0.0, float("inf")), "conv_L_cache": 3, "conv_window": 4, "block_size": 8,
    "sliding_window_pattern": 2, "layer_group_size": 1, "group_norm_size": 1, "num_kv_reuse_layers": 0,
    "layer_types": ["sliding_attention", "full_attention"], "is_moe_layer": [False, True], "use_mixed_mlp_moe": False,
    "use_cla": False, "cla_share_factor": 1, "attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1,
    "expert_layer_period": 2, "block_dim": zoo.HIDDEN, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False, "num_dense_layers": 1, "zero_expert_type": "identity", "zero_expert_num": 1,
    "hybrid_layer_pattern": [0, 1], "add_swa_attention_sink_bias": False, "add_full_attention_sink_bias": False,
    "mamba_proj_bias": False, "linear_allow_neg_eigval": False, "dense_attention_every_n_layers": 2,
    "gegelu_limit": 20.0, "a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8, "decay_low_rank_dim": 8,
}  # fmt: skip
# FILL values that are a choice among a family's options: not given to a wrapper's inner model (text_config), whose
# own defaults then hold.
CHOICES = ("topk_method", "scoring_func", "rope_scaling", "rope_parameters", "layer_types", "is_moe_layer")

# Kimi's linear-attention layers: layer 1 linear (KDA), layer 2 full attention (1-based layer numbers).
KDA = {"kda_layers": [1], "full_attn_layers": [2], "head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4}
# Where generation cannot work: each family's fields beyond TINY and FILL, each with its reason.
OVERRIDES: dict[str, dict[str, Any]] = {
    **{family: dict(args) for family, args in zoo.FAMILIES.items()},  # the zoo's hand-written configurations
    # hybrids: one layer of each kind in the 2 layers (their defaults put the first attention layer past layer 2)
    **{f: dict(full_attention_interval=2) for f in ("qwen3_next", "qwen3_5", "qwen3_5_moe")},
    **{f: dict(layer_types=["conv", "full_attention"]) for f in ("lfm2", "lfm2_moe", "lfm2-vl")},
    "nemotron_h": dict(hybrid_override_pattern=["M", "*"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "olmo3": dict(layer_types=["sliding_attention", "full_attention"]),
    "olmo_hybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "exaone4": dict(sliding_window_pattern="LG"),  # a string of L(ocal)/G(lobal) per layer
    "llama4_text": dict(no_rope_layers=[1, 0]),  # 1: the layer uses RoPE
    # RoPE parameters these families read without a default
    "mellum": dict(rope_parameters={t: {"rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")}),
    "hunyuan": dict(rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}),
    **{f: dict(rope_parameters={"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1, "rope_type": "default",
                                "original_max_position_embeddings": 512}) for f in ("ministral3", "mistral4")},
    "glm_moe_dsa": dict(rope_parameters={"rope_theta": 10000.0}, topk_method="noaux_tc"),  # its only router
    "gemma3n": dict(  # its text model's required fields (per-layer inputs, AltUp, Laurel): small values
        vocab_size_per_layer_input=zoo.VOCAB, rope_local_base_freq=10000.0, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"], activation_sparsity_pattern=[0.0, 0.0],
        hidden_size_per_layer_input=8, altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
        altup_active_idx=0, laurel_rank=8,
    ),
    "muse_spark": dict(  # MoE layers only (it rejects shared experts and dense layers)
        post_norm_eps=1e-5, layer_rope_theta=[10000.0] * zoo.LAYERS, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention"], output_multiplier=1.0, moe_hidden_size=32,
        rope_parameters={"rope_theta": 10000.0}, num_shared_experts=0,
    ),
    # one attention block with GQA 12, one without attention (a no-op): its blocks are configured one by one
    "nemotron-nas": dict(block_configs=[
        {"attention": {"n_heads_in_group": zoo.HQ // zoo.HKV}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
    ]),
    # a Hadamard pack: its schema-2 namespace, 2-bit weights, one packed module (a dense MLP down projection, width 512
    # for a 512-wide rotation block), qwen3_5's hybrid layout
    "prism_hadamard_qwen35": dict(
        schema_version=2, tensor_namespace="mlx-vlm-qwen3_5", quantization={"bits": 2, "group_size": 128,
        "mode": "affine"}, full_attention_interval=2, intermediate_size=512, num_experts=0,
        modules=[{"path": "model.layers.1.mlp.down_proj", "embedding": False, "dtype": "float16", "block": 512}],
    ),
    # the model writes -inf at fixed token ids up to 100351 (phi3small.py:298, `out[..., ids] = -inf`): a smaller
    # vocabulary makes that scatter write out of bounds, and MLX's CPU Scatter crashes (SIGSEGV) instead of raising
    "phi3small": dict(vocab_size=100352),
    # one linear-attention (GLA) layer, then the attention layer: with groups of 1 every layer is attention, and
    # create_ssm_mask then asks the KVCache of layer 0 for an SSM mask (make_mask without its arguments: TypeError)
    **{f: dict(layer_group_size=2) for f in ("bailing_moe_linear", "bailing_hybrid")},
    "phi": dict(partial_rotary_factor=0.5),  # its default 0.4 of head dim 8 is an odd RoPE width
    "qwen": dict(kv_channels=zoo.HEAD_DIM),  # its head dim, default 128
    "afm7": dict(hidden_dim=zoo.HIDDEN),  # its model width (TINY's hidden_dim is an FFN width elsewhere)
    "baichuan_m1": dict(sliding_window_layers=[0], conv_window=2, tie_word_embeddings=False),  # asserts a window of 2
    "minicpm3": dict(  # LongRoPE parameters, read without a default
        rope_scaling={"original_max_position_embeddings": 512, "short_factor": 1.0, "long_factor": 1.0}
    ),
    "kimi_k3": dict(hidden_act="situ", linear_attn_config=KDA),  # situ: the only activation it accepts
    # mla_scale_*=False leaves an attribute the attention reads unset
    **{f: dict(attention_method="MLA", mla_scale_q_lora=True, mla_scale_kv_lora=True)
       for f in ("longcat_flash", "longcat_flash_ngram")},
    "step3p5": dict(moe_top_k=2, share_expert_dim=32),  # its default top-k 8 is over TINY's 4 experts
    # its model reads layer 3's cache: 4 layers
    "llama4": dict(attention_chunk_size=8, interleave_moe_layer_step=1, rope_scaling=None, num_experts_per_tok=1,
                   num_hidden_layers=4),
    "dbrx": dict(  # its required MoE and attention sub-configurations
        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
        attn_config={"kv_n_heads": zoo.HKV, "clip_qkv": 8.0, "rope_theta": 10000.0},
    ),
    "openelm": dict(num_transformer_layers=zoo.LAYERS, ffn_dim_divisor=8, num_query_heads=[zoo.HQ] * zoo.LAYERS,
                    num_kv_heads=[zoo.HKV] * zoo.LAYERS, ffn_multipliers=[1.0] * zoo.LAYERS),  # per-layer lists
    # hybrid: one Mamba layer (its sizes are None by default), one attention layer
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], mamba_n_heads=24, mamba_d_head=16, mamba_d_state=8,
                             mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True, mamba_proj_bias=False),
    "kimi_linear": dict(linear_attn_config=KDA),  # required, no default
    # per-layer lists: layer 0 sliding window / dense MLP, layer 1 full attention / MoE
    "mimo_v2_flash": dict(moe_layer_freq=[0, 1], hybrid_layer_pattern=[1, 0], topk_method="noaux_tc"),
    # per-layer lists; minimax_m3_vl's layers not "full_attention" (layer 0) select key blocks once a block size is set
    # (None by default: no layer sparse): blocks of 2, the top 2 (with the local block), 4 of the 7 to 16 keys (spark2_5
    # has no such fields)
    **{f: dict(moe_layer_freq=[0, 1], layer_types=["sliding_attention", "full_attention"],
               rope_parameters={t: {"rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")},
               index_block_size=2, index_topk_blocks=2)
       for f in ("minimax_m3_vl", "spark2_5")},
    # layer 1 compresses pairs of tokens, with its own index keys, and selects the top 2 of the 3 to 8 entries beside the
    # window of 8 (its defaults compress nothing: the window only)
    "deepseek_v41": dict(compress_ratios=(0, 2), kv_source_layer_ids=(1,), index_source_layer_ids=(1,), index_topk=2),
}  # fmt: skip

# Helper modules of mlx_lm.models: no Model/ModelArgs, so no row (the reason is printed in the table's notes).
HELPER_REASON = "no Model and ModelArgs (a helper module)"


def tiny_args(family: str, module: Any) -> dict[str, Any]:
    """``ModelArgs`` keywords for a tiny ``family``: :func:`tiny_fields` with its :data:`OVERRIDES`."""
    args = tiny_fields(family, module.ModelArgs, OVERRIDES.get(family, {}))
    args.pop("model_type", None)
    return args


def tiny_fields(family: str, config: type, overrides: dict[str, Any]) -> dict[str, Any]:
    """Keywords of the dataclass ``config`` for a tiny ``family``: sizes from :data:`TINY` on every field that has
    one, :data:`FILL` for the remaining required fields, ``overrides`` last (the fields it has); ``text_config`` (a
    wrapper's inner model) gets the same, as a dict its inner ``ModelArgs.from_dict`` filters."""
    args: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if field.name in TINY:
            args[field.name] = TINY[field.name]
        elif field.name == "text_config":
            inner = {k: v for k, v in FILL.items() if k not in CHOICES}
            args[field.name] = {**inner, **TINY, "model_type": family, **overrides}
        elif required and field.name in FILL:
            args[field.name] = FILL[field.name]
    names = {field.name for field in dataclasses.fields(config)}
    args.update({k: v for k, v in overrides.items() if k in names})
    return args


# ----------------------------------------------------------------------------- the families


def families() -> tuple[list[str], dict[str, str]]:
    """``(families, skipped)``: the installed ``mlx_lm.models`` modules with ``Model`` and ``ModelArgs``, sorted,
    and the others with why."""
    import mlx_lm.models

    found, skipped = [], {}
    for info in sorted(pkgutil.iter_modules(mlx_lm.models.__path__), key=lambda i: i.name):
        try:
            module = importlib.import_module(f"mlx_lm.models.{info.name}")
        except BaseException as exc:  # noqa: BLE001  (olmo calls sys.exit when its optional package is missing)
            skipped[info.name] = f"does not import: {_short(exc)}"
            continue
        if hasattr(module, "Model") and hasattr(module, "ModelArgs"):
            found.append(info.name)
        else:
            skipped[info.name] = HELPER_REASON
    return found, skipped


@dataclasses.dataclass(frozen=True)
class Library:
    """What a sweep runs over (mlx-lm's, or another library's language models through this machinery): its
    families and their tiny models, the script run once per family, and how its page names them."""

    package: str  # the Python package: its model code's frames are the library's, its version on the page
    name: str  # as the page names it
    script: str  # run as ``script --child FAMILY``, one process per family
    target: str  # the make target that regenerates the page
    families: Callable[[], tuple[list[str], dict[str, str]]]  # (families, skipped modules with why)
    configure: Any  # zoo.Configure: (family, module) -> the tiny configuration's keywords
    configurations: str  # the page's sentence on how configurations are made
    unlisted: str  # what the page's list of modules without a row lists
    build: Any = zoo.mlx_model  # zoo.Build: (family, dtype, configure) -> the model, cached (__wrapped__: fresh)
    # families that generate_step cannot drive, with why (a named reason): their drop-in checks are declined with it,
    # not run
    undriven: dict[str, str] = dataclasses.field(default_factory=dict)

    def model(self, family: str, dtype: str = "f32") -> Any:
        """The tiny ``family`` in ``dtype`` (the same object on each call)."""
        return self.build(family, dtype, self.configure)

    def fresh(self, family: str) -> Any:
        """A second float32 instance of ``family``: the same weights (the same seed), not the cached object."""
        return self.build.__wrapped__(family, "f32", self.configure)

    def case(self, family: str, step: str, dtype: str, layers: int = zoo.LAYERS) -> Any:
        """The zoo's case of ``family`` (``zoo.mlx_case``) on this library's model."""
        return zoo.mlx_case(family, step, dtype, self.configure, layers, self.build)


MLX_LM = Library(
    package="mlx_lm", name="mlx-lm", script=str(Path(__file__).resolve()), target="zoo", families=families,
    configure=tiny_args,
    configurations="Configurations are generated from each `ModelArgs` by field name (`TINY`, `FILL` in the sweep); "
    f"`OVERRIDES` sets fields by hand for {len(set(OVERRIDES) - set(zoo.FAMILIES))} families beyond the model "
    f"zoo's {len(zoo.FAMILIES)}, each with its reason in a comment.",
    unlisted="Modules of `mlx_lm.models` without a row:",
)  # fmt: skip
LIBRARIES = ("mlx_lm", "mlx_vlm")  # model code: a frame in it is the library's (the model's), not attnpass's
EXAMPLES = Path(__file__).resolve().parent  # the sweeps' and the zoo's own code


def _short(exc: BaseException, limit: int = 160) -> str:
    text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


@contextlib.contextmanager
def time_box(seconds: int) -> Iterator[None]:
    """``TimeoutError`` after ``seconds`` (checked when Python code runs; the parent kills a process that hangs)."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def counting_fused() -> Iterator[list[int]]:
    """Counts ``mx.fast.scaled_dot_product_attention`` calls (mlx-lm's attention helper calls it)."""
    import mlx.core as mx

    fused = mx.fast.scaled_dot_product_attention
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return fused(*args, **kwargs)

    mx.fast.scaled_dot_product_attention = counted
    try:
        yield calls
    finally:
        mx.fast.scaled_dot_product_attention = fused


def candidates(graph: Graph) -> int:
    """Softmax-attention layers of an imported graph, counted by structure: after ``raise-attention``, its ``sdpa``
    nodes and the matmuls its matcher (:func:`~attnpass.passes.analysis.attention_match.match_attention`) still takes for
    ``P·V`` of a softmax (declined ones). A softmax that no matmul contracts with V (a router, a mixing or pooling
    weight) is not attention."""
    raised = PassManager(parse_pipeline("raise-attention")).run(graph).graph
    return sum(n.op == "sdpa" or (n.op == "matmul" and match_attention(raised, n) is not None) for n in raised.nodes())


def attention_layers(
    family: str, library: Library = MLX_LM, step: str = "prefill", dtype: str = "f32", fused: bool = True
) -> int | None:  # fmt: skip
    """Softmax-attention layers of the tiny ``family``: :func:`candidates` of a case (its float32 prefill: the
    family's count) as ``from_mlx`` imports it; None when that import declines (the case then declines with the
    reason). With ``fused``, at least the module's fused attention calls in that case's step, or ``RuntimeError``
    (the structural count missed a layer)."""
    import mlx.core as mx

    forward, args, _reference = library.case(family, step, dtype).make()
    try:
        imported = from_mlx(forward, *args)
    except ModelImportError:
        return None
    count = candidates(imported.graph)
    if not fused:
        return count
    forward, args, _reference = library.case(family, step, dtype).make()  # its cache as filled, not as imported
    with counting_fused() as fused, zoo.bf16_gather_mm():
        mx.eval(forward(*args))
    if count < fused[0]:
        raise RuntimeError(
            f"the structural count found {count} attention layers, the module calls "
            f"mx.fast.scaled_dot_product_attention {fused[0]} times"
        )
    return count


# ----------------------------------------------------------------------------- one family (in its own process)


def run_case(family: str, step: str, dtype: str, layers: int | None, library: Library = MLX_LM) -> dict[str, Any]:
    """One zoo case: ``{"case", "status", "raised", "reason"}``, and ``"layers"`` where it counted its own:
    ``layers`` None (the float32 prefill's import declined, so the family's are not counted), this case's import
    counts them (:func:`attention_layers`)."""
    case = library.case(family, step, dtype, 0 if layers is None else layers)
    own = layers is None
    try:
        with time_box(CASE_TIMEOUT):
            if own:
                layers = attention_layers(family, library, step, dtype)
                case = library.case(family, step, dtype, 0 if layers is None else layers)
            row = zoo.run_case(case)
    except Exception as exc:  # noqa: BLE001  (the sweep records whatever a case raises)
        status = "declined" if needs_metal(exc) else "failed"  # filling a verify/decode cache runs the model
        return dict(case=case.name, status=status, raised=None, reason=_failure(exc))
    if row.imported != "yes":  # nothing imported, nothing raised
        return dict(case=case.name, status="declined", raised=None, reason=row.imported.removeprefix("no: "))
    result = dict(case=case.name, raised=row.raised, reason="", **({"layers": layers} if own else {}))
    if not row.ok:
        reason = mismatch(case, row)
        return {**result, "status": "declined" if reason.startswith("module:") else "failed", "reason": reason}
    if layers is None:  # its import for the count declined, this one did not
        reason = "imported, but its attention layers are not counted: its import for the count declined"
        return {**result, "status": "failed", "reason": reason}
    if row.raised < layers and not own and not (row.remark and not row.remark.startswith("raise-attention left")):
        fewer = own_layers(family, step, dtype, library)  # a step may run fewer layers than the prefill
        if fewer is not None and row.raised == fewer < layers:
            return {**result, "status": "handled", "layers": fewer}
    if row.remark.startswith("raise-attention left no remark") or (row.raised < layers and not row.remark):
        return {**result, "status": "failed", "reason": row.remark or f"{row.raised}/{layers} raised, no remark"}
    if row.raised < layers:
        return {**result, "status": "declined", "reason": row.remark}
    return {**result, "status": "handled"}


def own_layers(family: str, step: str, dtype: str, library: Library) -> int | None:
    """The attention layers of one case counted in its own import (:func:`attention_layers`, by structure only),
    where it raised fewer than the family's float32 prefill has: a step's output may depend on fewer (florence2's
    warm-cache steps still run its encoder, whose output nothing reads: the decoder's cross-attention reads its
    cached keys and values; the module calls the fused attention 18 times, the import's graph, what reaches the
    logits, holds 12). None when that count fails."""
    try:
        with time_box(CASE_TIMEOUT):
            return attention_layers(family, library, step, dtype, fused=False)
    except Exception:  # noqa: BLE001  (then the family's count stands)
        return None


def mismatch(case: Any, row: Any) -> str:
    """Why ``row`` (a zoo case whose import does not match the module) failed: a ``MISMATCH``, unless the module's
    own ``mx.compile``'d run is what differs (``module:``). The import runs the function with compilation off (its
    compiled helpers' Python bodies, each call at its own shapes); the reference, with it on. Where the case rerun
    with compilation off (:func:`compile_off`: the reference then uncompiled) matches, the module computes
    something else compiled than what its code says: a ``mx.compile(shapeless=True)`` helper replays its first
    trace at other shapes, and what that trace resolved from its shapes is stale (MLX resolves argpartition's
    negative ``kth`` once: hy_v4's indexer, ``kth=-index_topk``, traced on the 11-token prompt, then keeps the top
    of 8 of the verify step's 16 keys in arbitrary order, not the top 4). No graph of the function reproduces that
    history, and the import is the function as written (its uncompiled run)."""
    said = f"max error {row.error:.2e} > {row.bound:.1e}"
    if case.backend == "mlx":
        try:
            with time_box(CASE_TIMEOUT), compile_off():
                uncompiled = zoo.run_case(case)
        except Exception:  # noqa: BLE001  (the rerun only refines the reason)
            uncompiled = None
        if uncompiled is not None and uncompiled.ok:
            return (
                f"module: its mx.compile'd run differs from its uncompiled run, which the import matches ({said}; "
                f"{uncompiled.error:.2e} uncompiled)"
            )
    return f"MISMATCH (silently wrong): {said}"


@contextlib.contextmanager
def compile_off() -> Iterator[None]:
    """``mx.compile`` off meanwhile (a compiled function runs its Python body on every call), back on after
    where it was on (MLX has no getter: a probe compiled while on is traced once for two calls)."""
    import mlx.core as mx

    traced: list[int] = []
    probe = mx.compile(lambda x: traced.append(1) or x)
    probe(mx.zeros((1,))), probe(mx.zeros((1,)))
    mx.disable_compile()
    try:
        yield
    finally:
        if len(traced) == 1:
            mx.enable_compile()


ATTNPASS = Path(importlib.import_module("attnpass.ir").__file__).resolve().parents[1]  # the package's root


def _library(path: Path) -> bool:
    """Whether ``path`` is attnpass's own code (not an example or a test of its checkout, nor an installed package
    of a virtual environment inside it: the model library's code, where the checkout holds its ``.venv``)."""
    path = path.resolve()
    if not path.is_relative_to(ATTNPASS) or "site-packages" in path.parts:
        return False
    return path.relative_to(ATTNPASS).parts[0] not in ("examples", "tests")


def _failure(exc: BaseException) -> str:
    """``exc`` short, with the innermost attnpass or model-library (:data:`LIBRARIES`) frame; ``module:`` first when
    no attnpass frame is on the stack (the model itself raised, outside the import: a bug of its library or a
    configuration it rejects)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if _library(Path(f.filename))]
    where = [f for f in frames if f in ours or any(name in f.filename for name in LIBRARIES)]
    at = f" (at {Path(where[-1].filename).name}:{where[-1].lineno})" if where else ""
    return f"{'' if ours else 'module: '}{_short(exc)}{at}"


def needs_metal(exc: BaseException) -> bool:
    """Whether ``exc`` is MLX without Metal refusing to run a custom Metal kernel (``mx.fast.metal_kernel``; the
    import names the kernel): the module itself does not run here, so neither a cache to fill nor the drop-in."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("[metal_kernel] No Metal back-end")


def greedy(model: Any, count: int = OPTIMIZE_TOKENS) -> list[int]:
    """``count`` greedy tokens after the zoo's prompt (``mlx_lm.generate.generate_step``)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    with zoo.bf16_gather_mm():
        steps = generate_step(mx.array(zoo.TOKENS[: zoo.PROMPT]), model, max_tokens=count)
        return [int(token) for token, _ in steps]


def speculative(model: Any, draft: Any, count: int = OPTIMIZE_TOKENS) -> list[int]:
    """``count`` greedy tokens after the zoo's prompt by speculative decoding
    (``mlx_lm.generate.speculative_generate_step``, :data:`DRAFT_TOKENS` drafted per verify step)."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    prompt = mx.array(zoo.TOKENS[: zoo.PROMPT])
    with zoo.bf16_gather_mm():
        steps = speculative_generate_step(prompt, model, draft, num_draft_tokens=DRAFT_TOKENS, max_tokens=count)
        return [int(token) for token, _, _ in steps]


def untrimmable(model: Any) -> str:
    """Why mlx-lm refuses speculative decoding on ``model`` (its caches cannot be trimmed back after a rejected
    draft: ``can_trim_prompt_cache``), or ``""``. A cache without ``is_trimmable`` (another library's: mlx-vlm's
    ``Z1TCache``) is not trimmable."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    refused = sorted({type(c).__name__ for c in cache if not getattr(c, "is_trimmable", lambda: False)()})
    return f"{', '.join(refused)} not trimmable" if refused else ""


def unspeculative(model: Any, draft: Any, plain: list[int]) -> str:
    """Why mlx-lm's speculative decoding of the plain ``model`` is not a check of ``optimize``, or ``""``: mlx-lm
    refuses it (:func:`untrimmable`), or its own tokens are not the ``plain`` greedy ones (plamo3: on its
    ``RotatingKVCache`` past the window, a verify step after another one attends otherwise than one-row steps)."""
    refused = untrimmable(model)
    if refused:
        return refused
    own = speculative(model, draft)
    return "" if own == plain else f"mlx-lm's own speculative tokens differ from greedy: {own} vs {plain}"


Part = dict[str, Any]  # a drop-in check: status, reason, identical (None: not run), routed, declined {code: calls}


def _part(status: str, reason: str) -> Part:
    """A drop-in check that did not run the model to the end."""
    return dict(status=status, reason=reason, identical=None, routed=0, declined={})


def drop_in(
    family: str,
    generate: Callable[[Any], list[int]],
    refusal: Callable[[Any, list[int]], str] | None = None,
    library: Library = MLX_LM,
) -> Part:
    """``generate(model)``'s tokens under ``optimize(model, min_keys=0)`` (a fresh handle: its own routed/declined
    calls) against the plain model's greedy tokens (float32). ``min_keys=0`` routes the tiny contexts too (by
    default on CPU their calls are under ``MIN_KEYS`` and run mlx-lm's helper): the route itself is what each
    family tests. ``refusal(model, plain tokens)``, when given and not empty, is why ``generate`` on the plain model
    is no check: ``n/a``."""
    from attnpass.backends.mlx import optimize

    if family in library.undriven:
        return _part("declined", library.undriven[family])
    model = library.model(family)
    try:
        with time_box(CASE_TIMEOUT):
            try:
                plain = greedy(model)
            except RuntimeError as exc:
                if not needs_metal(exc):
                    raise
                return _part("declined", _failure(exc))
            reason = refusal(model, plain) if refusal else ""
            if reason:
                return _part("n/a", reason)
            try:
                opt = optimize(model, min_keys=0)
            except ValueError as exc:  # no module calls mlx-lm's helper: nothing to route, said by name
                return _part("declined", _short(exc, 120))
            with opt:
                tokens = generate(model)
    except Exception as exc:  # noqa: BLE001
        return _part("failed", _failure(exc))
    identical = tokens == plain
    result = dict(identical=identical, routed=opt.routed, declined=dict(opt.declined), reason="")
    if not identical:
        return {**result, "status": "failed", "reason": f"tokens differ from greedy: {tokens} vs {plain}"}
    return {**result, "status": "handled"}


def run_optimize(family: str, library: Library = MLX_LM) -> Part:
    """The drop-in: ``optimize``'s greedy tokens (``generate_step``) against the plain model's (:func:`drop_in`)."""
    return drop_in(family, greedy, library=library)


def run_speculative(family: str, library: Library = MLX_LM) -> Part:
    """Speculative decoding under ``optimize`` (:func:`speculative`), its draft a second plain instance of the
    same weights (built again with the same seed), against the plain model's greedy tokens; its verify steps are
    multi-row calls on a warm cache. ``n/a`` where mlx-lm's own is no check (:func:`unspeculative`)."""
    draft = functools.cache(functools.partial(library.fresh, family))  # built once, when first needed
    return drop_in(
        family,
        lambda model: speculative(model, draft()),
        lambda model, plain: unspeculative(model, draft(), plain),
        library,
    )


def run_family(
    family: str, emit: Callable[[dict[str, Any]], None] = lambda record: None, library: Library = MLX_LM
) -> dict[str, Any]:
    """Every case of ``family`` and its drop-in checks, each record also given to ``emit`` as it completes."""
    record: dict[str, Any] = dict(family=family, cases=[], optimize=None, speculative=None, layers=None, config="")
    try:
        with time_box(CASE_TIMEOUT):
            record["layers"] = attention_layers(family, library)
    except Exception as exc:  # noqa: BLE001
        record["config"] = _failure(exc).removeprefix("module: ")
        emit(dict(config=record["config"]))
        return record
    emit(dict(layers=record["layers"], counted=True))
    for step in zoo.STEPS:
        for dtype in zoo.DTYPES:
            case = run_case(family, step, dtype, record["layers"], library)
            record["cases"].append(case)
            emit(dict(case=case))
    record["optimize"] = run_optimize(family, library)
    emit(dict(optimize=record["optimize"]))
    record["speculative"] = run_speculative(family, library)
    emit(dict(speculative=record["speculative"]))
    return record


def _child(family: str, library: Library) -> int:
    """Runs one family, one JSON line per record on stdout (the parent assembles them)."""
    run_family(family, lambda record: print(json.dumps(record), flush=True), library)
    return 0


def family_in_process(family: str, library: Library = MLX_LM) -> dict[str, Any]:
    """``run_family`` in a fresh process (``library.script --child``), killed after every case's time box is
    spent: a hang is a timeout."""
    budget = CASE_TIMEOUT * (len(zoo.STEPS) * len(zoo.DTYPES) + 1 + len(DROP_INS)) + 30
    command = [sys.executable, "-X", "faulthandler", library.script, "--child", family]  # a crash prints its stack
    record: dict[str, Any] = dict(family=family, cases=[], optimize=None, speculative=None, layers=None, config="")
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=budget)
        out, ended = done.stdout, _ending(done.returncode, done.stderr)
    except subprocess.TimeoutExpired as exc:
        out, ended = _text(exc.stdout), f"timeout (over {budget} s)"
    record["seconds"] = round(time.monotonic() - start, 1)
    for line in out.splitlines():
        if line.startswith("{"):
            item = json.loads(line)
            if "case" in item:
                record["cases"].append(item["case"])
            else:
                record.update(item)
    if not record.get("counted") and not record["config"]:
        record["config"] = f"process ended: {ended}"
    elif record["speculative"] is None:
        record["crash"] = ended
    return record


def _ending(returncode: int, stderr: str) -> str:
    """How a family's process ended early: the signal that killed it and the innermost Python frame then running
    of the sweeps (:data:`EXAMPLES`) or the model code (:data:`LIBRARIES`; faulthandler's dump), else its last line
    of stderr."""
    if returncode < 0:
        frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', stderr.split("most recent call first", 1)[-1])
        ours = [f for f in frames if any(name in f[0] for name in LIBRARIES) or Path(f[0]).parent == EXAMPLES]
        at = f" in {ours[0][2]} ({Path(ours[0][0]).name}:{ours[0][1]})" if ours else ""
        return f"killed by {signal.Signals(-returncode).name}{at}"
    return (stderr.strip().splitlines() or [f"exit status {returncode}, no output"])[-1][:160]


def _text(value: bytes | str | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


# ----------------------------------------------------------------------------- the verdict and the table


def verdict(record: dict[str, Any]) -> tuple[str, str]:
    """``(status, reason)`` of a family: failed before declined before handled, the first such reason; a family
    without softmax attention is declined (nothing to raise) unless a part failed. A drop-in check that is
    ``n/a`` (mlx-lm cannot run it) is neither."""
    if record["config"]:
        return "failed", f"config: {record['config']}"
    if record.get("crash"):
        return "failed", f"{record['crash']} after {len(record['cases'])} cases"
    parts = [(case["case"].split("/", 1)[-1], case) for case in record["cases"]]
    parts += [(name, record[name]) for name in DROP_INS if record.get(name)]
    for status in ("failed", "declined"):
        if status == "declined" and record["layers"] == 0:
            return "declined", "no softmax-attention layer: nothing to raise"
        for name, part in parts:
            if part["status"] == status:
                return status, f"{name}: {part['reason']}"
    return "handled", ""


def _cell(record: dict[str, Any], step: str, dtype: str) -> str:
    name = f"{record['family']}/{step}/{dtype}"
    case = next((c for c in record["cases"] if c["case"] == name), None)
    return {None: "-", "handled": "ok", "declined": "declined", "failed": "**FAIL**"}[case and case["status"]]


def _raised(record: dict[str, Any]) -> str:
    """Raised / counted layers over the cases: the family's count, else the cases' own (:func:`run_case`)."""
    cases = [c for c in record["cases"] if c["raised"] is not None]
    counts = [c["raised"] for c in cases if c.get("layers", record["layers"]) is not None]
    totals = sorted({c.get("layers", record["layers"]) for c in cases} - {None})
    if not counts:
        return "-"
    low, high = min(counts), max(counts)
    total = f"{totals[0]}" if len(totals) == 1 else f"{totals[0]}-{totals[-1]}"
    return f"{low}/{total}" if low == high else f"{low}-{high}/{total}"


def _drop_in_cell(record: dict[str, Any], name: str) -> str:
    """A drop-in check's cell: ``identical R/D`` (or ``**DIFFER** R/D``: calls routed/declined), else its status,
    ``n/a`` with the reason."""
    part = record.get(name)
    if part is None:
        return "-"
    if part["identical"] is None:
        return f"n/a ({part['reason']})" if part["status"] == "n/a" else part["status"]
    declined = sum(part["declined"].values())
    return f"{'identical' if part['identical'] else '**DIFFER**'} {part['routed']}/{declined}"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def table(
    records: list[dict[str, Any]],
    skipped: dict[str, str],
    command: str,
    seconds: float | None,
    note: str = "",
    library: Library = MLX_LM,
) -> str:
    """The docs page: counts, one row per family, the skipped modules."""
    import mlx.core as mx

    version = importlib.import_module(library.package).__version__
    script = Path(library.script).relative_to(EXAMPLES.parent)

    verdicts = [verdict(r) for r in records]
    counts = {s: sum(v[0] == s for v in verdicts) for s in STATUSES}
    head = ["family", "status", *[f"{s} {d}" for s in zoo.STEPS for d in zoo.DTYPES], "raised", *DROP_INS, "reason"]
    lines = [
        f"# {library.name} families",
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()}"
        f"{'' if seconds is None else f' ({seconds / 60:.0f} min)'} with {library.name} "
        f"{version} and MLX {mx.__version__}; the sweep is `{script}`, described in "
        f"its docstring. Do not edit by hand: `make {library.target}` regenerates it.{' ' + note if note else ''}",
        "",
        f"**{len(records)} families: {counts['handled']} handled, {counts['declined']} declined by name, "
        f"{counts['failed']} failed.**",
        "",
        "Cells: `ok` (imported, every attention layer raised, matches the module within the zoo's tolerance), "
        "`declined` (a named reason), `**FAIL**` (an error without one, a mismatch, a timeout). `raised`: "
        "attention layers raised to `sdpa` / softmax-attention layers (counted by structure in the float32 "
        "prefill's import, each case's own where that one declines: softmaxes a matmul contracts with V, at least "
        "the module's fused attention calls; a range over the six cases). `optimize`: greedy tokens of `optimize(model, min_keys=0)` (every depth "
        "routed, as the tiny contexts would not be by default on CPU) vs the plain model (float32, "
        f"{OPTIMIZE_TOKENS} tokens), then attention calls routed/declined (the prompt's prefill and one-row decode "
        "steps). `speculative`: mlx-lm's `speculative_generate_step` under a fresh `optimize(model, min_keys=0)`, "
        f"{DRAFT_TOKENS} tokens drafted per step by a plain copy of the model (same weights), vs the plain "
        "model's greedy tokens, then its calls routed/declined (the prefill and the "
        f"{DRAFT_TOKENS + 1}-row verify steps on the warm cache: what MLA/DSA routes); `n/a` where mlx-lm "
        "refuses speculative decoding (a cache it cannot trim) or its own tokens differ from greedy decoding's "
        "(plain, no attnpass), with the reason. `reason`: the first failed part, "
        f"else the first declined one; `module:` when the model itself raised outside attnpass (an {library.name} bug "
        "or a configuration it rejects) or computes otherwise under `mx.compile` than uncompiled, where the import "
        "matches its uncompiled run (its code as written), `config:` when the tiny configuration did not build or "
        "run.",
        "",
        library.configurations,
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for record, (status, reason) in zip(records, verdicts):
        cells = [_cell(record, s, d) for s in zoo.STEPS for d in zoo.DTYPES]
        reason = reason if len(reason) <= 200 else reason[:199] + "…"
        drop_ins = [_drop_in_cell(record, name) for name in DROP_INS]
        row = [f"`{record['family']}`", status, *cells, _raised(record), *drop_ins, _escape(reason)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", library.unlisted, ""]
    lines += [f"- `{name}`: {reason}" for name, reason in sorted(skipped.items())]
    return "\n".join(lines) + "\n"


def committed(path: Path) -> dict[str, str]:
    """Family -> status, read from a generated table."""
    statuses = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) > 2:
            statuses[cells[0].strip("`")] = cells[1]
    return statuses


def main(argv: list[str] | None = None, library: Library = MLX_LM) -> int:
    about = f"Every model family of the installed {library.name}, imported, raised, lowered and checked, one row each."
    parser = argparse.ArgumentParser(description=about)
    parser.add_argument("only", nargs="*", help="these families only (default: every family)")
    parser.add_argument("--write", type=Path, help="write the table to this markdown file")
    parser.add_argument("--jobs", type=int, default=1, help="families run at once (default 1)")
    parser.add_argument(
        "--records", type=Path,
        help="a JSON-lines file of finished families: appended to; families in it are not rerun unless named; "
        "the table then covers every family it holds",
    )  # fmt: skip
    parser.add_argument("--note", default="", help="a sentence for the table's header (how this run was made)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        return _child(options.child, library)
    found, skipped = library.families()
    unknown = sorted(set(options.only) - set(found))
    if unknown:
        parser.error(f"not a family of the installed {library.name}: {', '.join(unknown)}")
    selected = [f for f in found if not options.only or f in options.only]
    kept = _read_records(options.records) if options.records else {}
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(options.jobs) as pool:  # each family is its own process
        todo = [f for f in selected if options.only or f not in kept]
        for record in pool.map(functools.partial(family_in_process, library=library), todo):
            kept[record["family"]] = record
            if options.records:
                with options.records.open("a") as out:
                    out.write(json.dumps(record) + "\n")
            status, reason = verdict(record)
            print(f"{record['family']:<28} {status:<9} {_raised(record):>6}  {reason[:110]}", flush=True)
    if options.write:
        records = [kept[f] for f in (found if options.records else selected) if f in kept]
        given = sys.argv[1:] if argv is None else argv
        shown = [a for i, a in enumerate(given) if a != "--note" and (i == 0 or given[i - 1] != "--note")]
        command = " ".join([f"python {Path(library.script).relative_to(EXAMPLES.parent)}", *shown])
        seconds = None if options.records else time.monotonic() - start  # a run assembled from records: no one time
        options.write.write_text(table(records, skipped, command, seconds, options.note, library))
    return 0


def _read_records(path: Path) -> dict[str, dict[str, Any]]:
    """Family -> its last record in a ``--records`` file (none if the file does not exist)."""
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["family"]] = record
    return records


if __name__ == "__main__":
    raise SystemExit(main())
