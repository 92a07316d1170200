"""Attention sinks through ``optimize(model)``'s CPU default pipeline: every routed call mlx-lm's helper's bits.

mlx-lm's ``mimo_v2_flash`` with the tiny configuration of mlx-lm's own ``test_all_models`` (GQA 4/2, head dim 128
over value dim 64, sinks on the sliding-window layers; here also with sinks on the full layers, and random sinks
where mlx-lm starts from ones), float32 (its MoE's ``gather_mm`` runs only in float32 on CPU). The prompt is
prefilled in steps of 5 rows, so the full layers' multi-row calls are routed too, then 24 greedy decode steps.
Each routed call's output is compared with mlx-lm's helper on the same arrays on raw bits (issue 44: with the
sink column appended last, 12 of 96 such calls differed by 1-4 steps), and the log-probabilities with the
plain model's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.util import assert_bits_equal, requires

pytestmark = requires("mlx.core", "mlx_lm")

# mlx-lm's tests/test_models.py, test_all_models, mimo_v2_flash
CONFIG: dict[str, Any] = {
    "model_type": "mimo_v2_flash", "num_experts_per_tok": 2, "hybrid_layer_pattern": [0, 1, 0, 1],
    "moe_layer_freq": [0, 1, 0, 1], "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
    "sliding_window_size": 32, "vocab_size": 1000, "hidden_size": 512, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": None, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 2, "topk_group": 1, "max_position_embeddings": 1000,
    "layernorm_epsilon": 1e-5, "rope_theta": 1000.0, "swa_rope_theta": 1000.0, "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2, "head_dim": 128, "v_head_dim": 64, "swa_head_dim": 128, "swa_v_head_dim": 64,
    "partial_rotary_factor": 0.5,
}  # fmt: skip
PROMPT = [(7 * i + 3) % 1000 for i in range(40)]  # past the window of 32
PREFILL_STEP = 5  # rows per prefill call: at most decompose-sdpa's max_q_len, so the full layers' calls are routed
DECODE = 24


def mimo(full_sinks: bool, seed: int) -> Any:
    """The tiny mimo_v2_flash, float32, with random sinks (mlx-lm's start at ones)."""
    import mlx.core as mx
    from mlx_lm.models import mimo_v2_flash

    mx.random.seed(seed)
    model = mimo_v2_flash.Model(
        mimo_v2_flash.ModelArgs.from_dict({**CONFIG, "add_full_attention_sink_bias": full_sinks})
    )
    for layer in model.layers:
        attn = layer.self_attn
        if attn.attention_sink_bias is not None:
            attn.attention_sink_bias = mx.random.normal((attn.n_heads,))
    mx.eval(model.parameters())
    return model


def generate(model: Any) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each step's log-probabilities: the prompt prefilled in steps, then decode steps."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache, tokens, logprobs = make_prompt_cache(model), [], []
    prompt = mx.array([PROMPT])
    for start in range(0, len(PROMPT), PREFILL_STEP):
        logits = model(prompt[:, start : start + PREFILL_STEP], cache=cache)
    for _ in range(DECODE):
        step = logits[0, -1] - mx.logsumexp(logits[0, -1])
        tokens.append(int(mx.argmax(step)))
        logprobs.append(np.array(step))
        logits = model(mx.array([[tokens[-1]]]), cache=cache)
    return tokens, np.stack(logprobs)


@pytest.mark.parametrize("full_sinks", [False, True], ids=["sliding-sinks", "all-sinks"])
def test_each_routed_call_with_sinks_is_mlx_lms_helper_bit_for_bit(full_sinks):
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention as helper

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.clients import helper_call

    if mx.default_device() != mx.cpu:
        pytest.skip("bit-exactness is measured for CPU's default pipeline (MLX's CPU fallback of the fused call)")
    model = mimo(full_sinks, seed=0)
    plain, plain_logprobs = generate(model)
    compared: list[tuple[int, int, bool]] = []  # (query rows, keys, sinks) of each routed call
    with optimize(model, strict=True, min_keys=0) as opt:
        attend = opt.attend

        def checked(client, *args, **kwargs):
            routed = opt.routed
            out = attend(client, *args, **kwargs)
            if opt.routed > routed:
                assert_bits_equal(np.array(out), np.array(helper(*args, **kwargs)))
                call = helper_call(None, None, *args, **kwargs)
                compared.append((call.queries.shape[2], call.keys.shape[2], call.sinks is not None))
            return out

        opt.attend = checked  # what the client's trampoline calls: the active model's attend
        tokens, logprobs = generate(model)
    assert len(compared) == opt.routed
    sunk = [rows for rows, _keys, sinks in compared if sinks]
    assert len(sunk) >= 2 * DECODE  # every decode step of the sliding layers, at least
    assert (max(sunk) == PREFILL_STEP) == full_sinks  # the full layers' prefill steps, when they have sinks
    assert tokens == plain
    assert_bits_equal(logprobs, plain_logprobs)
