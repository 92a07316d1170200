"""mlx-lm's MiniMax-M3 with its block-sparse attention on, under ``optimize``.

Its sparse layers select key blocks with their own indexer (``_block_mask``: a bool mask over the cache), then,
after the fetch, rebind the cache's keys to ``mx.depends(keys, index_cache)`` (which only orders evaluation: the
same values). The fetch proof reads through the recorded ``mx.depends`` (backends/mlx/calls.py, ``depended``),
so the calls are routed (before: every call after a fetch declined ``cache_changed``); any other rebinding of the
keys is still declined. The tiny configuration makes the sparse path run: blocks of 4 keys, top 2 blocks, over
contexts of 30 and more keys.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.util import assert_bits_equal, lazy_import, load_example, requires

pytestmark = requires("mlx.core", "mlx_lm")

mx = lazy_import("mlx.core")

SPARSE = dict(index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1)
PIPELINE = "raise-attention,decompose-sdpa{device=cpu},dce"  # float32 gives the helper's bits


@pytest.fixture(scope="module")
def model():
    import importlib

    from tests.mlx_lm_versions import needs_family

    needs_family("minimax_m3_vl")
    sweep = load_example("mlx_lm_sweep")
    module = importlib.import_module("mlx_lm.models.minimax_m3_vl")
    args = sweep.tiny_args("minimax_m3_vl", module)
    args["text_config"].update(SPARSE)
    mx.random.seed(0)
    built = module.Model(module.ModelArgs.from_dict(args))
    built.set_dtype(mx.float32)
    mx.eval(built.parameters())
    assert [layer.self_attn.is_sparse_attn for layer in built.layers] == [True, False]
    return built


def greedy(model, **kwargs):
    from mlx_lm.generate import generate_step

    prompt = mx.array([(7 * i + 3) % 100 for i in range(30)])
    steps = list(generate_step(prompt, model, max_tokens=16, **kwargs))
    return [int(t) for t, _ in steps], np.stack([np.array(p) for _, p in steps])


def test_the_sparse_layers_calls_are_routed_and_the_logits_are_mlx_lms_bits(model, monkeypatch):
    from attnpass.backends.mlx import optimize

    masks = []
    block_mask = type(model.layers[0].self_attn)._block_mask
    monkeypatch.setattr(
        type(model.layers[0].self_attn), "_block_mask", lambda *a: masks.append(block_mask(*a)) or masks[-1]
    )
    plain, plain_logprobs = greedy(model, prefill_step_size=7)
    # the sparse path ran: bool masks that drop blocks (over 30+ keys, 2 blocks of 4 kept)
    assert masks and all(isinstance(m, mx.array) and m.dtype == mx.bool_ for m in masks[1:])
    assert not np.array(masks[-1]).all()
    calls = len(masks)  # one per step of the sparse layer, as many of the dense one
    with optimize(model, PIPELINE, strict=True, min_keys=0) as opt:
        tokens, logprobs = greedy(model, prefill_step_size=7)
    assert tokens == plain
    assert_bits_equal(logprobs, plain_logprobs)
    assert not opt.declined and opt.routed == 2 * calls  # every call of both layers, each step


def test_keys_rebound_to_another_array_than_mx_depends_gives_are_still_declined(model, monkeypatch):
    from mlx_lm.models.cache import KVCache

    from attnpass.backends.mlx import optimize
    from tests.backends.mlx_backend.lm_probe import Probe

    probe, kv = Probe(), KVCache()
    q, k, v = mx.random.normal((3, 1, 4, 2, 64))
    with optimize(probe, PIPELINE, min_keys=0) as opt:
        for rebind, reason in [
            (lambda c: setattr(c, "keys", mx.depends(c.keys, [k])), None),  # the same values: routed
            (lambda c: setattr(c, "keys", mx.depends(mx.depends(c.keys, [k]), [v])), None),
            (lambda c: setattr(c, "keys", c.keys + 0), "cache_changed"),  # equal values, but nothing proves it
            (lambda c: setattr(c, "keys", mx.depends(c.keys * 1, [k])), "cache_changed"),
        ]:
            routed, declined = opt.routed, dict(opt.declined)
            mx.eval(probe(q, k, v, kv, None, between=rebind))
            if reason is None:
                assert opt.routed == routed + 1
            else:
                assert [r for r in opt.declined if opt.declined[r] > declined.get(r, 0)] == [reason]


def test_the_sparse_calls_gather_their_selected_blocks_by_default(model):
    """Under the default pipeline each sparse call is the selected_attention program (backends/mlx/selections.py):
    dsa-gather reads each row's 2 blocks of 4 keys, not the 30+ keys; greedy and speculative tokens are the
    plain model's, the logits within the gathered programs' float32 bound."""
    from mlx_lm.generate import speculative_generate_step

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.programs import GATHERED

    plain, plain_logprobs = greedy(model, prefill_step_size=7)
    prompt = mx.array([(7 * i + 3) % 100 for i in range(30)])
    with optimize(model, min_keys=0) as opt:
        tokens, logprobs = greedy(model, prefill_step_size=7)
        drafted = [int(t) for t, _, _ in speculative_generate_step(prompt, model, model, max_tokens=16)]
    assert tokens == plain and drafted == plain
    assert np.abs(logprobs - plain_logprobs).max() < 100 * GATHERED["float32"]
    selected = opt.programs["selected_attention"].specializations
    rows = {s.graph.node(s.graph.inputs[0]).type.shape[2] for s in selected}
    assert rows >= {1, 7} and rows & {2, 3}  # decode, the prefill's chunks and the verify steps
    for s in selected:
        assert s.ops["qsa_gather"] >= 2 and any(r.pass_name == "dsa-gather" and r.kind == "applied" for r in s.remarks)


@requires("mlx_vlm")
def test_mlx_vlms_minimax_m3_gathers_its_selected_blocks():
    """mlx-vlm's MiniMax-M3 (off Metal: its indexed kernel does not serve) through its MiniMaxM3KVCache, the mlx-vlm
    sweep's tiny sparse configuration: greedy tokens are the plain model's, every call is routed and the sparse
    layer's calls are the gathered selected_attention program. (mlx-vlm's ``minimax_m3`` family is the same
    language model: its sweep row.)"""
    from attnpass.backends.mlx import optimize

    sweep, lm = load_example("mlx_vlm_sweep"), load_example("mlx_lm_sweep")
    model = sweep.MLX_VLM.model("minimax_m3_vl")
    plain = lm.greedy(model)
    with optimize(model, min_keys=0) as opt:
        tokens = lm.greedy(model)
    assert tokens == plain
    assert opt.routed and set(opt.declined) <= {"fused_kernel_serves"}
    selected = opt.programs["selected_attention"].specializations
    assert selected and all(s.ops["qsa_gather"] >= 2 for s in selected)
