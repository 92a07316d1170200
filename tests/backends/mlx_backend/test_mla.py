"""``optimize`` on mlx-lm's MLA and DSA families (backends/mlx/caches/mla.py): multi-row calls routed, the rest
declined by code.

Each family's tiny random model runs, plain and optimized, a prompt of 24 tokens and 12 greedy tokens
(``generate_step``), a follow-up turn on the warm cache and a 4-row verify call (what speculative decoding
sends): the greedy tokens must be identical, the logits within :data:`LOGIT_BOUND` (max |diff| / max |logit|,
measured: docs/mla.md, "Under optimize"), every multi-row MLA call routed and every one-row call declined
``mla_absorbed``, counted exactly. DSA families have ``index_topk`` 8, so their calls select. Calls the
router cannot prove (mistral4's concatenated keys, a hand-modified layer, quantized projections, another mask,
a cache changed after its fetch) are declined by code and are mlx-lm's output bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.mlx_backend.test_dropin_mlx_lm_router import KIMI_LINEAR, LONGCAT_FLASH, MISTRAL4, mla_model
from tests.util import assert_bits_equal, lazy_import, requires

pytestmark = requires("mlx.core", "mlx_lm")
mx = lazy_import("mlx.core")

LOGIT_BOUND = {"float32": 1e-5, "bfloat16": 2e-2}  # max |diff| / max |logit| over every call's logits
DSA = {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 8}
GLM_DSA = {
    **DSA, "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "moe_layer_freq": 1, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0}, "attention_bias": False,
}  # fmt: skip
TWO = {"num_hidden_layers": 2}
KIMI_K3 = {
    **KIMI_LINEAR, "hidden_act": "situ",
    "linear_attn_config": {**KIMI_LINEAR["linear_attn_config"], "short_conv_kernel_size": 4},
}  # fmt: skip
FAMILIES = {  # family -> (config, MLA attention calls per model call)
    "deepseek_v3": (TWO, 2),
    "deepseek_v32": ({**TWO, **DSA}, 2),
    "glm_moe_dsa": ({**TWO, **GLM_DSA}, 2),
    "glm4_moe_lite": (TWO, 2),
    "kimi_k25": (TWO, 2),
    "kimi_linear": (KIMI_LINEAR, 1),  # layer 1 linear attention, layer 2 MLA
    "kimi_k3": (KIMI_K3, 1),  # the same layout, SiTU activations
    "longcat_flash": (LONGCAT_FLASH, 2),  # two attentions in its one layer
    "longcat_flash_ngram": (LONGCAT_FLASH, 2),
}
PROMPT, FOLLOW_UP = list(range(3, 27)), [40, 41, 42, 43, 44, 45]
# generate_step: the prompt's first 23 rows, then 13 one-row steps (a token computed ahead); the follow-up turn:
# 5 rows, then 5 one-row steps; then one 4-row verify call
MULTI_ROW, ONE_ROW = 3, 18


class FloatExperts:
    """A mixture of experts computed in float32 on bfloat16 activations (MLX's CPU ``gather_mm`` is float32 only),
    its output cast back: the attention layers stay bfloat16."""

    def __init__(self, experts):
        self.experts = experts

    def __call__(self, x, indices):
        return self.experts(x.astype(mx.float32), indices).astype(x.dtype)


def model_of(family: str, dtype: str = "float32", seed: int = 0, **extra):
    config, _ = FAMILIES.get(family, ({}, 0))
    config = {**config, **extra}
    seed += config.pop("seed", 0)  # longcat_flash's configuration names its own seed
    if family == "kimi_k25":  # a DeepSeek-V3 text model inside a VLM wrapper
        from mlx_lm.models import kimi_k25

        text = mla_model("deepseek_v3", seed, **config).args
        mx.random.seed(seed)
        model = kimi_k25.Model(kimi_k25.ModelArgs(text_config=vars(text)))
    else:
        model = mla_model(family, seed, **config)
    model.set_dtype(getattr(mx, dtype))
    if dtype != "float32":
        for _, module in model.named_modules():
            if "switch_mlp" in module:
                module.switch_mlp.set_dtype(mx.float32)
                module.switch_mlp = FloatExperts(module.switch_mlp)
    mx.eval(model.parameters())
    return model


def conversation(model) -> tuple[list[int], list[np.ndarray]]:
    """The greedy tokens of both turns and the logits (log-probabilities) of every call, as numpy float32."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    tokens, logits = [], []
    for prompt, count in ((PROMPT, 12), (FOLLOW_UP, 4)):
        for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=count, prompt_cache=cache):
            tokens.append(token)
            logits.append(np.array(logprobs.astype(mx.float32)))
    verify = model(mx.array([tokens[:4]]), cache=cache)
    logits.append(np.array(verify.astype(mx.float32))[0])
    tokens += np.array(verify.argmax(-1))[0].tolist()
    return tokens, logits


def distance(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a, b, strict=True))


def token_logits(logits: list[np.ndarray], i: int) -> np.ndarray:
    """The logits token ``i`` of :func:`conversation` was chosen from (the verify call's rows come last)."""
    last = len(logits) - 1
    return logits[i].reshape(-1) if i < last else logits[last][i - last]


def assert_same_conversation(got: tuple, want: tuple, dtype: str, *, selects: bool = False) -> None:
    """The greedy tokens identical and every call's logits within the bound. In bfloat16 a tiny random model has
    near-ties, and the tokens may part there: the calls before the first differing token within the bound, and
    at it the plain logits of both choices within the bound of each other — unless the model ``selects`` (DSA),
    where a near-tie of the bfloat16 indexer's scores may flip a cell of the top-k, and the call attends other
    cells."""
    (tokens, logits), (plain_tokens, plain_logits) = got, want
    first = next((i for i, (a, b) in enumerate(zip(tokens, plain_tokens, strict=True)) if a != b), None)
    if first is None or dtype == "float32":
        assert tokens == plain_tokens and distance(logits, plain_logits) <= LOGIT_BOUND[dtype]
        return
    calls = min(first, len(logits) - 1)
    assert calls == 0 or distance(logits[:calls], plain_logits[:calls]) <= LOGIT_BOUND[dtype]
    if not selects:
        row = token_logits(plain_logits, first)
        assert row[plain_tokens[first]] - row[tokens[first]] <= LOGIT_BOUND[dtype] * np.abs(row).max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_mla_family_routes_its_multi_row_calls(family, dtype):
    from attnpass.backends.mlx import optimize

    model = model_of(family, dtype)
    plain = conversation(model)
    with optimize(model, strict=True) as opt:
        routed = conversation(model)
    assert len(set(plain[0])) >= 4
    selects = "index_topk" in FAMILIES[family][0]
    assert_same_conversation(routed, plain, dtype, selects=selects)
    calls = FAMILIES[family][1]
    assert opt.routed == MULTI_ROW * calls and opt.declined == {"mla_absorbed": ONE_ROW * calls}
    program = "dsa_attention" if selects else "mla_attention"
    assert set(opt.programs) == {program}  # DSA: every call is past index_topk, so each selects
    for entry in opt.programs[program].specializations:
        applied = {r.pass_name for r in entry.remarks if r.kind == "applied"}
        assert entry.compiled and "mla-absorb" in applied
        assert ("dsa-gather" in applied) == (program == "dsa_attention")


def test_dsa_below_index_topk_is_the_plain_mla_program():
    """At most ``index_topk`` keys the indexer selects nothing (mlx-lm attends densely): the MLA program."""
    from attnpass.backends.mlx import optimize

    model = model_of("deepseek_v32", index_topk=64)
    tokens, logits = conversation(model)
    with optimize(model, strict=True) as opt:
        routed_tokens, routed_logits = conversation(model)
    assert routed_tokens == tokens and distance(routed_logits, logits) <= LOGIT_BOUND["float32"]
    assert set(opt.programs) == {"mla_attention"} and opt.routed == MULTI_ROW * 2


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v32"])
def test_speculative_decoding_gives_the_same_tokens(family):
    from mlx_lm.generate import speculative_generate_step

    from attnpass.backends.mlx import optimize

    model, draft = model_of(family), model_of(family, seed=1, num_hidden_layers=1)

    def speculate() -> list[int]:
        steps = speculative_generate_step(mx.array(PROMPT), model, draft, num_draft_tokens=3, max_tokens=16)
        return [token for token, _, _ in steps]

    tokens = speculate()
    with optimize(model, strict=True) as opt:
        assert speculate() == tokens
    assert len(set(tokens)) >= 4 and opt.routed > 2 * 2  # the prefill and at least one verify call per layer
    assert set(opt.declined) <= {"mla_absorbed"}


def plain_and_optimized(model, **options):
    from attnpass.backends.mlx import optimize

    tokens, logits = conversation(model)
    with optimize(model, strict=True, **options) as opt:
        declined_tokens, declined_logits = conversation(model)
    assert declined_tokens == tokens
    for got, want in zip(declined_logits, logits, strict=True):
        assert_bits_equal(got, want)  # every call declined: mlx-lm's own, bit for bit
    assert opt.routed == 0
    return opt


def test_mistral4_concatenated_keys_are_declined():
    opt = plain_and_optimized(mla_model("mistral4", **MISTRAL4))
    assert opt.declined == {"mla_not_projections": MULTI_ROW, "mla_absorbed": ONE_ROW}


class Rescaled:
    """A hand-modified up-projection: the layer's own output times one (another array, the same values)."""

    def __init__(self, linear):
        self.linear = linear

    def __call__(self, x, transpose=True):
        return self.linear(x, transpose) * 1.0


def test_keys_that_are_not_the_projections_are_declined():
    model = model_of("deepseek_v3")
    for layer in model.model.layers:
        layer.self_attn.embed_q = Rescaled(layer.self_attn.embed_q)
    opt = plain_and_optimized(model)
    # the one-row steps' queries are the wrapper's output, not a recorded projection: their latent keys and values
    # are not what the cache's fetch returned as (keys, values) either
    assert opt.declined == {"mla_not_projections": MULTI_ROW * 2, "not_fetched": ONE_ROW * 2}


def test_quantized_projections_are_declined():
    from mlx import nn

    model = model_of("deepseek_v3", kv_lora_rank=32)
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda _, m: hasattr(m, "to_quantized") and
                type(m).__name__ == "MultiLinear")  # fmt: skip
    opt = plain_and_optimized(model)
    assert opt.declined == {"mla_quantized": MULTI_ROW * 2, "mla_absorbed": ONE_ROW * 2}


def test_an_expansion_the_pipeline_keeps_is_declined():
    """A wide latent (R = 64, Dn = Dv = 16): past the crossover mla-absorb keeps the expansion, which is the
    client's own (``little_gain``); a pipeline without mla-absorb: ``no_absorb_pass``, every call mlx-lm's."""
    from attnpass.backends.mlx import optimize

    model = model_of("deepseek_v3", kv_lora_rank=64, qk_nope_head_dim=16, v_head_dim=16)
    tokens, logits = conversation(model)
    with optimize(model, strict=True) as opt:
        routed_tokens, routed_logits = conversation(model)
    assert routed_tokens == tokens and distance(routed_logits, logits) <= LOGIT_BOUND["float32"]
    # crossover 0.85 x 32·64·32 / (32·96 + 64·32) = 10.9 rows over the prefill's 32-row cut: its 23 rows keep the
    # expansion; the 5-row turn (crossover 13.6 at 64 rows) and the 4-row verify are absorbed
    assert opt.declined == {"little_gain": 2, "mla_absorbed": ONE_ROW * 2} and opt.routed == 2 * 2
    little = opt.declines["little_gain"]
    assert little.data["rows"] == 23 and little.data["rows"] >= little.data["crossover"]
    opt = plain_and_optimized(model_of("deepseek_v3"), pipeline="dce")
    assert opt.declined == {"no_absorb_pass": MULTI_ROW * 2, "mla_absorbed": ONE_ROW * 2}


def direct_call(opt, mutate=None, mask="scores", sinks=None):
    """One MLA call of 4 rows over a KVCache holding 20 latent rows, through the router; ``mutate(cache)`` runs
    between the fetch and the call. Returns (routed output, mlx-lm's helper output)."""
    from mlx_lm.models.base import scaled_dot_product_attention as helper
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.mla import MultiLinear

    from attnpass.backends.mlx.clients import MLX_LM_HELPER

    route = MLX_LM_HELPER.trampoline()

    mx.random.seed(3)
    embed_q, unembed_out = MultiLinear(8, 16, 2), MultiLinear(16, 8, 2)
    cache = KVCache()
    cache.update_and_fetch(mx.random.normal((1, 1, 16, 16)), mx.random.normal((1, 1, 16, 4)))
    q = mx.random.normal((1, 2, 4, 8))
    with opt.active():
        latent, _ = cache.update_and_fetch(mx.random.normal((1, 1, 4, 16)), mx.random.normal((1, 1, 4, 4)))
        k, v = embed_q(latent, transpose=False), unembed_out(latent)
        scores = mx.random.normal((1, 2, 4, 20)) if mask == "scores" else mask
        if mutate is not None:
            mutate(cache)
        out = route(q, k, v, cache, 0.3, scores, sinks)
    return out, helper(q, k, v, cache=cache, scale=0.3, mask=scores, sinks=sinks)


@pytest.mark.parametrize(
    "case, code",
    [
        ({"mask": "causal"}, "mla_operands"),
        ({"mask": None}, "mla_operands"),
        ({"mutate": lambda c: c.trim(1)}, "cache_changed"),  # the cache moved back: its row 19 may be rewritten
        ({"mutate": lambda c: c.update_and_fetch(mx.zeros((1, 1, 1, 16)), mx.zeros((1, 1, 1, 4)))}, "not_fetched"),
    ],
)
def test_unproven_direct_calls_are_declined(case, code):
    from attnpass.backends.mlx import optimize

    with optimize(model_of("deepseek_v3"), strict=True) as opt:
        out, expected = direct_call(opt, **case)
    assert opt.declined == {code: 1} and opt.routed == 0
    assert_bits_equal(np.array(out), np.array(expected))


def test_a_direct_call_with_sinks_per_head_routes_and_carries_them():
    """HunyuanV4's MLA calls give the helper one sink per head: the program takes them (mla-absorb and dsa-gather
    carry sinks), within the latent form's bound of mlx-lm's helper."""
    from attnpass.backends.mlx import optimize

    with optimize(model_of("deepseek_v3"), strict=True) as opt:
        out, expected = direct_call(opt, sinks=mx.array([0.5, -1.0]))
    assert opt.routed == 1 and not opt.declined
    (entry,) = opt.programs["mla_attention"].specializations
    assert "sinks:f32[2]" in entry.signature
    np.testing.assert_allclose(np.array(out), np.array(expected), rtol=0, atol=1e-5 * float(mx.abs(expected).max()))


def test_sinks_of_another_shape_than_one_per_head_are_declined():
    from types import SimpleNamespace

    from attnpass.backends.mlx.caches.mla import _operands_decline

    call = SimpleNamespace(queries=mx.zeros((1, 2, 4, 8)), rows=4, mask=mx.zeros((1, 2, 4, 20)), sinks=None)
    assert _operands_decline(call, 20) is None
    assert _operands_decline(SimpleNamespace(**{**vars(call), "sinks": mx.zeros((2,))}), 20) is None
    found = _operands_decline(SimpleNamespace(**{**vars(call), "sinks": mx.zeros((3,))}), 20)
    assert found.reason == "mla_operands" and "sinks mlx.core.float32 (3,)" in found.message


def test_a_direct_call_routes_over_the_buffer_cut():
    """20 latent rows in a 256-row buffer: the program reads its first 32, the rope scores padded by -inf."""
    from attnpass.backends.mlx import optimize

    with optimize(model_of("deepseek_v3"), strict=True) as opt:
        out, expected = direct_call(opt)
    assert opt.routed == 1
    (entry,) = opt.programs["mla_attention"].specializations
    assert "latent:f32[1,1,32,16]" in entry.signature and "mask:f32[1,2,4,32]" in entry.signature
    np.testing.assert_allclose(np.array(out), np.array(expected), rtol=0, atol=1e-5 * float(mx.abs(expected).max()))
