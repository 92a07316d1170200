"""A toy multi-layer QSA decoder: greedy tokens agree between the masked and the gathered layer.

Three layers, vocab 64, d_model 64, K = 8 blocks of ratio 4 (W = 35), a 96-cell cache: from
position 35 on (9 complete blocks) the selection drops blocks, and the gather path runs at every step.
Projections, MLP and logits run in numpy; the attention layer is the traced QSA layer on MLX.
"""

from __future__ import annotations

import numpy as np

from attnpass.backends import run
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, gather_pipeline, make_inputs, narrowed_inputs, padded_mask
from tests.util import requires

pytestmark = requires("mlx.core")

VOCAB, D_MODEL, LAYERS, N_KV, STEPS = 64, 64, 3, 96, 64
CFG = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=32, mask_rows=1, rotary_dim=8)
DENSE = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=N_KV, mask_rows=1, rotary_dim=8)


def _norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x) + 1e-6)


class ToyDecoder:
    """Weights are shared between paths; each decoder keeps its own caches."""

    def __init__(self, weights: dict, program, graph) -> None:
        self.w, self.program, self.graph = weights, program, graph
        shape = (1, CFG.n_kv_heads, N_KV, CFG.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(LAYERS)]
        self.v = [np.zeros(shape, np.float32) for _ in range(LAYERS)]
        self.idx_keys = [np.zeros((1, N_KV, CFG.idx_dim), np.float32) for _ in range(LAYERS)]

    def step(self, token: int, p: int) -> np.ndarray:
        h = self.w["embed"][token] + self.w["position"][p]
        positions = np.array([[p]], np.int32)
        for layer in range(LAYERS):
            lw = self.w["layers"][layer]
            x = _norm(h)
            q = (x @ lw["wq"]).reshape(1, CFG.n_q_heads, 1, CFG.head_dim)
            self.k[layer][0, :, p] = (x @ lw["wk"]).reshape(CFG.n_kv_heads, CFG.head_dim)
            self.v[layer][0, :, p] = (x @ lw["wv"]).reshape(CFG.n_kv_heads, CFG.head_dim)
            self.idx_keys[layer][0, p] = x @ lw["wik"]
            inputs = dict(self.w["tables"])
            inputs.update(
                q=q.astype(np.float32),
                k_cache=self.k[layer],
                v_cache=self.v[layer],
                idx_q=(x @ lw["wiq"]).reshape(1, 1, CFG.idx_heads, CFG.idx_dim).astype(np.float32),
                idx_keys=self.idx_keys[layer],
                positions=positions,
                mask=padded_mask(CFG, positions, N_KV),
            )
            attn = run(self.program, **narrowed_inputs(self.graph, inputs))
            h = h + attn.reshape(-1) @ lw["wo"]
            h = h + np.maximum(_norm(h) @ lw["w1"], 0) @ lw["w2"]
        return _norm(h) @ self.w["unembed"]


def make_weights(seed: int = 7) -> dict:
    rng = np.random.default_rng(seed)

    def mat(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    hq, hkv, di = CFG.n_q_heads * CFG.head_dim, CFG.n_kv_heads * CFG.head_dim, CFG.idx_dim
    layers = [
        {
            "wq": mat(D_MODEL, hq) * 4,
            "wk": mat(D_MODEL, hkv),
            "wv": mat(D_MODEL, hkv),
            "wo": mat(hq, D_MODEL) * 4,
            "wiq": mat(D_MODEL, CFG.idx_heads * di),
            "wik": mat(D_MODEL, di),
            "w1": mat(D_MODEL, 2 * D_MODEL),
            "w2": mat(2 * D_MODEL, D_MODEL),
        }  # fmt: skip
        for _ in range(LAYERS)
    ]
    tables = make_inputs(CFG, N_KV, np.zeros((1, 1), np.int32), seed=seed)
    return {
        "embed": mat(VOCAB, D_MODEL) * 8,
        "position": mat(N_KV, D_MODEL) * 8,
        "unembed": mat(D_MODEL, VOCAB) * 4,
        "layers": layers,
        "tables": {k: tables[k] for k in ("idx_q_norm", "idx_k_norm", "rope_cos", "rope_sin")},
    }


def greedy(decoder: ToyDecoder, steps: int) -> tuple[list[int], list[np.ndarray]]:
    token, tokens, logits = 1, [], []
    for p in range(steps):
        out = decoder.step(token, p)
        token = int(np.argmax(out))
        tokens.append(token)
        logits.append(out)
    return tokens, logits


def test_greedy_tokens_identical_in_masked_and_gathered_paths():
    masked = build_layer(CFG, N_KV)
    result = gather_pipeline().run(masked)
    gathered = result.graph
    assert [r.kind for r in result.remarks if r.pass_name == "qsa-gather"] == ["applied"]
    assert str(gathered.node("mask").type) == "f16[1,1,96]"
    weights = make_weights()
    tokens_masked, logits_masked = greedy(ToyDecoder(weights, lower(masked, "mlx"), masked), STEPS)
    tokens_gather, logits_gather = greedy(ToyDecoder(weights, lower(gathered, "mlx"), gathered), STEPS)
    assert STEPS >= 32 and STEPS // CFG.ratio > CFG.top_k_blocks  # the last steps select 8 of 16 blocks
    assert len(set(tokens_masked)) > 5  # a non-degenerate sequence
    assert tokens_gather == tokens_masked
    dense = build_layer(DENSE, N_KV)  # a budget covering the whole cache: the selection no longer drops blocks
    tokens_dense, _ = greedy(ToyDecoder(weights, lower(dense, "mlx"), dense), STEPS)
    assert tokens_dense[:35] == tokens_masked[:35] and tokens_dense != tokens_masked  # the sparse selection matters
    np.testing.assert_allclose(np.array(logits_gather), np.array(logits_masked), rtol=1e-4, atol=1e-4)
