"""mlx-vlm Qwen4-Exp's batched cache (``BatchQSAKVCache``) under ``optimize`` (backends/mlx/caches/qsa_batch.py).

Three streams go through mlx-vlm's own batch caches (``generate.ar._make_cache``:
a ``BatchQSAKVCache`` per QSA layer, left padding per stream) and the tiny
model of ``test_dropin_mlx_vlm_qsa.py``, plainly and optimized. The model
prefills a batch one stream at a time on single-stream ``QSAKVCache`` caches
(routed as there) and merges them; then:

- equal-length streams decode with every QSA call on the ``BatchQSAKVCache``,
  each stream with its own selection: routed through one gather program
  (``B = 3``), tokens identical and logits within 1e-4 in float32;
- ragged streams (left padding) decode through the model's left-padded path,
  which attends densely and makes no QSA call: nothing to route, tokens identical.
"""

from __future__ import annotations

import numpy as np

from tests.backends.mlx_backend.test_dropin_mlx_vlm_qsa import QSA_LAYERS, VOCAB, model  # noqa: F401 (the fixture)
from tests.util import lazy_import, requires

pytestmark = requires("mlx.core", "mlx_vlm")

mx = lazy_import("mlx.core")
language = lazy_import("mlx_vlm.models.qwen4_exp.language")

STEPS = 10


def _batch(lengths: list[int]):
    """Left-padded prompts of ``lengths`` tokens (different per stream) and their padding."""
    rng, width = np.random.default_rng(1), max(lengths)
    rows = [np.concatenate([np.zeros(width - n, int), rng.integers(0, VOCAB, n)]) for n in lengths]
    return mx.array(np.stack(rows), dtype=mx.int32), [width - n for n in lengths]


def _run(lm, lengths: list[int]):
    """Prefill the batch on mlx-vlm's batch caches, then greedy decode: tokens per step, logits, caches."""
    from mlx_vlm.generate.ar import _make_cache

    prompts, padding = _batch(lengths)
    cache = _make_cache(lm, padding)
    logits = lm(prompts, cache=cache).logits[:, -1]
    tokens, steps = [], []
    for _ in range(STEPS):
        token = mx.argmax(logits, axis=-1)
        tokens.append(token.tolist())
        steps.append(np.array(logits))
        logits = lm(token[:, None], cache=cache).logits[:, -1]
    return tokens, np.stack(steps), cache


def test_equal_length_streams_decode_through_one_gather_program_with_each_streams_selection(model):  # noqa: F811
    from attnpass.backends.mlx import optimize

    lengths = [40, 40, 40]
    plain, plain_logits, _ = _run(model, lengths)
    with optimize(model) as opt:
        tokens, logits, cache = _run(model, lengths)
    assert tokens == plain
    np.testing.assert_allclose(logits, plain_logits, rtol=0, atol=1e-4)
    assert len({tuple(t[b] for t in plain) for b in range(3)}) == 3  # three different streams
    assert type(cache[3]) is language.BatchQSAKVCache and cache[3].kv_cache._idx == 40 + STEPS
    # per QSA layer: 3 single-stream prefills (the model's per-stream prefill), then every batched decode step
    assert opt.routed == QSA_LAYERS * (3 + STEPS) and not opt.declined
    decode = [
        e for e in opt.programs["qsa_attention"].specializations if e.signature.startswith("queries:f32[3,4,1,32]")
    ]
    assert len(decode) == 1 and decode[0].compiled and "selection:i32[3,1,4]" in decode[0].signature
    assert decode[0].ops["qsa_cells"] == 1 and "qsa_mask" not in decode[0].ops  # a gather, never the masked form


def test_ragged_streams_decode_densely_in_the_model_and_only_their_prefills_are_routed(model):  # noqa: F811
    from attnpass.backends.mlx import optimize

    lengths = [40, 33, 27]
    plain, plain_logits, _ = _run(model, lengths)
    with optimize(model) as opt:
        tokens, logits, cache = _run(model, lengths)
    assert tokens == plain
    np.testing.assert_allclose(logits, plain_logits, rtol=0, atol=1e-4)
    assert np.array(cache[3].left_padding).tolist() == [0, 7, 13]
    # mlx-vlm's left-padded decode ("left_padded_decode") attends the streams densely: no QSA call to route, its
    # calls of mlx-vlm's helper (a client too) are under CPU's bound at these depths
    assert opt.routed == QSA_LAYERS * 3 and set(opt.declined) == {"short_context"}


def test_each_stream_attends_its_own_selection_and_arrays_not_the_caches_are_declined_by_name(model):  # noqa: F811
    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.clients import QSA_DISPATCH

    route_qsa = QSA_DISPATCH.trampoline()

    _, _, cache = _run(model, [40, 40, 40])
    batched = cache[3]
    attention = model.model.layers[3].self_attn
    step = mx.random.normal((3, 1, 64))
    with optimize(model) as opt, opt.active():
        selection = attention.indexer.select(step, batched, None)
        q, k, v = attention.q_proj(step), attention.k_proj(step), attention.v_proj(step)
        queries, keys, values, _, _ = attention._prepare_projected_qkv(q, k, v, batched, None, None, None)
        options = {"cache": batched, "scale": attention.scale, "block_size": 4, "causal": True, "mask": None,
                   "mask_factory": lambda: attention.indexer.build_mask(selection)}  # fmt: skip
        blocks, ends = selection.selected_blocks, selection.query_ends
        routed = route_qsa(queries, keys, values, blocks, ends, **options)
        copied = route_qsa(queries, keys, values, mx.array(blocks), ends, **options)
        fresh = route_qsa(queries, mx.array(keys), values, blocks, ends, **options)
    assert opt.routed == 1 and opt.declined == {"not_selected": 1, "not_fetched": 1}
    picked = np.sort(np.array(blocks)[:, 0], axis=-1)
    assert (picked >= 0).all() and len({tuple(p) for p in picked}) == 3  # 4 of 12 blocks, a different 4 per stream
    # the declined calls are the model's dispatch (its mask built from each stream's selection): the routed gather
    # attends the same cells of each stream
    np.testing.assert_allclose(np.array(routed), np.array(copied), rtol=0, atol=1e-5)
    assert np.array_equal(np.array(fresh), np.array(copied))
