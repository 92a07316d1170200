"""Cross-check: our QSA selection equals transformers' Qwen4ExpTextQSAIndexer (torch, CPU).

Needs the optional peers (``pip install -e .[peers]``: torch 2.13.0 and transformers with
``models/qwen4_exp``); skipped with the reason when they are absent, except under ``make test``,
which installs them and sets ``ATTNPASS_REQUIRE_PEERS=1``: there a missing peer fails. The indexer runs a
prefill of T tokens with a causal mask, so every row is a decode query at its own position.
torch's ``topk`` does not specify its tie order, so the data is checked to have no tie
(or near-tie) at any row's cut before the selections are compared exactly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.models import rms_norm, rope
from tests.util import available, lazy_import, requires

# transformers with models/qwen4_exp (the peers extra); the numerics run on every target.
REQUIRED = os.environ.get("ATTNPASS_REQUIRE_PEERS") == "1"
PEERS = ("torch", "transformers.models.qwen4_exp", "mlx.core", "jax")
if REQUIRED:
    missing = [m for m in PEERS if not available(m)]
    assert not missing, f"ATTNPASS_REQUIRE_PEERS=1 but {missing} do not import (pip install -e '.[peers,mlx,jax]')"
else:
    pytestmark = requires(*PEERS)
torch = lazy_import("torch")
modeling = lazy_import("transformers.models.qwen4_exp.modeling_qwen4_exp")
configuration = lazy_import("transformers.models.qwen4_exp.configuration_qwen4_exp")

T, HIDDEN, HEADS, DIM, RATIO, BUDGET, ROTARY, EPS = 96, 32, 4, 16, 4, 16, 8, 1e-6
K = BUDGET // RATIO


def torch_indexer(seed: int):
    if not hasattr(modeling, "Qwen4ExpTextQSAIndexer"):
        (pytest.fail if REQUIRED else pytest.skip)("transformers.models.qwen4_exp has no Qwen4ExpTextQSAIndexer class")
    torch.manual_seed(seed)
    config = configuration.Qwen4ExpTextConfig(
        hidden_size=HIDDEN, num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=EPS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": ROTARY / 16},
        indexer_n_heads=HEADS, indexer_kv_heads=1, indexer_head_dim=DIM, indexer_budget=BUDGET,
        indexer_compress_ratio=RATIO,
    )  # fmt: skip
    indexer = modeling.Qwen4ExpTextQSAIndexer(config, layer_idx=0).eval()
    with torch.no_grad():
        indexer.q_layernorm.weight.normal_(0.0, 0.2)
        indexer.k_layernorm.weight.normal_(0.0, 0.2)
    return indexer


def our_indexer():
    def qsa_indexer(idx_q, idx_keys, q_scale, k_scale, rope_cos, rope_sin, positions):
        n_blocks = T // RATIO
        pooled = ops.qsa_pool(idx_keys, ratio=RATIO)
        keys = rope(
            rms_norm(pooled, k_scale, EPS), rope_cos[: n_blocks * RATIO : RATIO], rope_sin[: n_blocks * RATIO : RATIO]
        )
        cos_q = ops.reshape(rope_cos, (1, T, 1, ROTARY // 2))
        sin_q = ops.reshape(rope_sin, (1, T, 1, ROTARY // 2))
        scores = ops.qsa_block_scores(rope(rms_norm(idx_q, q_scale, EPS), cos_q, sin_q), keys)
        selection = ops.qsa_select(scores, positions, ratio=RATIO, top_k_blocks=K)
        return scores, ops.qsa_mask(selection, positions, ratio=RATIO, kv_len=T)

    return trace(
        qsa_indexer,
        TensorSpec((1, T, HEADS, DIM)), TensorSpec((1, T, DIM)), TensorSpec((DIM,)), TensorSpec((DIM,)),
        TensorSpec((T, ROTARY // 2)), TensorSpec((T, ROTARY // 2)), TensorSpec((1, T), "int32"),
    )  # fmt: skip


def no_tie_at_the_cut(scores: np.ndarray) -> bool:
    for p in range(T):
        visible = np.sort(scores[0, p, : (p + 1) // RATIO])[::-1]
        if len(visible) > K and visible[K - 1] - visible[K] <= 1e-4 * max(1.0, abs(visible[K - 1])):
            return False
    return True


@pytest.mark.parametrize("seed", [0, 1])
def test_selection_matches_the_transformers_indexer(seed):
    indexer = torch_indexer(seed)
    hidden = torch.randn(1, T, HIDDEN)
    freqs = torch.arange(T, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(0, ROTARY, 2) / ROTARY)
    cos, sin = freqs.cos(), freqs.sin()
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
    with torch.no_grad():
        theirs = indexer(hidden, (torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]), causal, None)
        q, k = torch.split(indexer.index_qk_proj(hidden), [HEADS * DIM, DIM], dim=-1)
    inputs = [
        q.reshape(1, T, HEADS, DIM).numpy(), k.numpy(),
        (1.0 + indexer.q_layernorm.weight).detach().numpy(), (1.0 + indexer.k_layernorm.weight).detach().numpy(),
        cos.numpy(), sin.numpy(), np.arange(T, dtype=np.int32)[None],
    ]  # fmt: skip
    graph = our_indexer()
    scores, _ = run(lower(graph, "numpy"), *inputs)
    assert no_tie_at_the_cut(scores), "the random data has a tie at the top-k cut; torch's tie order is unspecified"
    expected = theirs.numpy()
    assert expected.shape == (1, 1, T, T) and expected.dtype == np.bool_
    assert (expected.sum(-1)[0, 0] < np.arange(1, T + 1)).any()  # the selection really drops cells
    for target in ("numpy", "mlx", "jax"):
        _, mask = run(lower(graph, target), *inputs)
        np.testing.assert_array_equal(mask, expected, err_msg=target)
