"""Batched sliding windows under ``optimize``: mlx-lm's and mlx-vlm's ``BatchRotatingKVCache``
(backends/mlx/caches/batch_rotating.py).

``batch_generate`` runs three prompts of different lengths on tiny sliding-window models (a window of 8, so every
stream's ring rotates), plain and optimized, in float32: tokens and log-probabilities bit for bit, every ring call
routed. mlx-vlm's ring is driven the same way by hand on a gemma3 language model (left-padded streams). A
one-attention probe checks what the router substitutes (each stream's program reads the keys mlx-lm's helper
received, the cut's rows past them masked out for every query row) and what it declines, by name; the masks the
ring made are decided as evaluating them would, without evaluating them.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from tests.util import assert_bits_equal, lazy_import, load_example, requires

pytestmark = requires("mlx.core", "mlx_lm")

mx = lazy_import("mlx.core")

PIPELINE = "raise-attention,decompose-sdpa{device=cpu},dce"  # float32 gives the helper's bits (batched tests' own)
PROMPTS = [[3, 17, 99, 50, 7, 8, 9, 10, 44, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [5, 6, 7, 8, 9, 11], [40, 41]]
MAX_TOKENS = [30, 20, 26]


@pytest.fixture(scope="module")
def sweep():
    return load_example("mlx_lm_sweep")


def ring_plans(monkeypatch, adapter) -> collections.Counter:
    """Counts the ring adapter's answers: ``(Plan or Decline reason, the ring rotated)``."""
    seen, plan = collections.Counter(), type(adapter).plan

    def counting(self, call):
        answer = plan(self, call)
        seen[(getattr(answer, "reason", "plan"), bool(call.cache.rotated))] += 1
        return answer

    monkeypatch.setattr(type(adapter), "plan", counting)
    return seen


def _unexpected(mask):
    raise AssertionError(f"a mask {mask.shape} was evaluated: the ring's make_mask made every one")


@pytest.mark.parametrize("prefill_batch_size", [8, 1], ids=["one-prefill", "joining"])
@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_batch_generate_over_rings_is_identical_with_every_ring_call_routed(
    family, prefill_batch_size, sweep, monkeypatch
):
    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.caches import ADAPTERS, batch
    from attnpass.backends.mlx.caches.base import MLX_LM
    from attnpass.models import tiny_tokenizer
    from tests.mlx_lm_versions import batch_generate_ids

    model, tokenizer = sweep.zoo.mlx_model(family, "f32", sweep.tiny_args), tiny_tokenizer()
    options = {"max_tokens": MAX_TOKENS, "prefill_batch_size": prefill_batch_size}
    plain_ids, plain_logprobs = batch_generate_ids(model, tokenizer, PROMPTS, **options)
    seen = ring_plans(monkeypatch, ADAPTERS[MLX_LM, "BatchRotatingKVCache"])
    monkeypatch.setattr(batch, "evaluated_blind_row", _unexpected)
    with optimize(model, PIPELINE, min_keys=0) as opt:
        token_ids, logprobs = batch_generate_ids(model, tokenizer, PROMPTS, **options)
    assert token_ids == plain_ids and [len(t) for t in plain_ids] == MAX_TOKENS
    assert_bits_equal(np.concatenate(logprobs), np.concatenate(plain_logprobs))
    # every ring call routed, before and after the rings rotate; the full-attention layers' 20-row prefill is
    # MLX's fused call (more than 8 rows on CPU), nothing else is declined
    assert set(seen) == {("plan", False), ("plan", True)}, seen
    assert set(opt.declined) <= {"fused_kernel_serves"}


@requires("mlx_vlm")
def test_mlx_vlms_rings_route_left_padded_streams_bit_for_bit(monkeypatch):
    from mlx_vlm.models import cache as vlm_cache

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.caches import ADAPTERS
    from attnpass.backends.mlx.caches.base import MLX_VLM
    from tests.backends.mlx_backend.test_dropin_mlx_vlm import language_model

    model = language_model("gemma3", "float32", {"model_type": "gemma3_text", "sliding_window": 8,
                                                 "sliding_window_pattern": 2})  # fmt: skip
    padding = [0, 3, 5]
    prompts = mx.array([[(7 * i + 3 * b) % 100 + 1 if i >= pad else 0 for i in range(6)]
                        for b, pad in enumerate(padding)])  # fmt: skip

    def run():
        def batched(c):
            if isinstance(c, vlm_cache.RotatingKVCache):
                return vlm_cache.BatchRotatingKVCache(c.max_size, padding)
            return vlm_cache.BatchKVCache(padding)

        cache = [batched(c) for c in model.make_cache()]
        assert {type(c).__name__ for c in cache} == {"BatchRotatingKVCache", "BatchKVCache"}
        logits = [model(prompts, cache=cache).logits[:, -1]]
        for _ in range(12):  # the rings (8 rows) fill, then rotate
            logits.append(model(mx.argmax(logits[-1], axis=-1)[:, None], cache=cache).logits[:, -1])
        return np.array(mx.stack(logits))

    plain = run()
    seen = ring_plans(monkeypatch, ADAPTERS[MLX_VLM, "BatchRotatingKVCache"])
    with optimize(model, PIPELINE, min_keys=0) as opt:
        got = run()
    assert_bits_equal(got, plain)
    # the left-padded prefill's padding rows see no key (declined by name, both kinds of layer); every decode step
    # of every ring routed, before and after it rotates
    assert seen[("rows_without_keys", False)] == 1 and seen[("plan", False)] and seen[("plan", True)], seen
    assert seen[("plan", False)] + seen[("plan", True)] == 12 and len(seen) == 3
    assert opt.declined == {"rows_without_keys": 2} and opt.routed == 12 * 2


def test_the_router_substitutes_each_streams_ring_or_declines_by_name(monkeypatch):
    from mlx_lm.models import base
    from mlx_lm.models.cache import BatchRotatingKVCache

    from attnpass.backends.mlx import OptimizedModel, optimize
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe, spy_run

    substituted = []
    monkeypatch.setattr(OptimizedModel, "_run", spy_run(OptimizedModel._run, substituted))
    mx.random.seed(0)
    padding, window = [0, 2, 1], 6
    probe, ring = Probe(), BatchRotatingKVCache(max_size=window, left_padding=padding)

    def run(rows: int, mask=True, **kwargs):
        q = mx.random.normal((3, 4, rows, 64))
        k, v = mx.random.normal((2, 3, 2, rows, 64))
        made = ring.make_mask(rows, window_size=window, return_array=True) if mask is True else mask
        out = probe(q, k, v, ring, made, **kwargs)
        keys, values, given = probe.received
        return out, base.scaled_dot_product_attention(q, keys, values, cache=ring, scale=SCALE, mask=given)

    with optimize(probe, PIPELINE, strict=True, min_keys=0) as opt:
        out, expected = run(4)  # a left-padded prefill: streams 1 and 2's first rows see no key
        assert_bits_equal(np.array(out), np.array(expected))
        assert opt.routed == 0 and opt.declined == {"rows_without_keys": 1}
        for rows in (3, 1, 1, 1, 1, 1):  # a concatenating step, then one-row steps into the ring, which rotates
            out, expected = run(rows)
            assert_bits_equal(np.array(out), np.array(expected))
            routed, n = substituted[-1], probe.received[0].shape[2]
            assert routed.program == "attention" and len(routed.streams) == 3  # one program call per stream
            for stream in range(3):
                _, ring_keys, _, program_mask = routed.streams[stream]
                assert_bits_equal(np.array(ring_keys[..., :n, :]), np.array(probe.received[0][stream : stream + 1]))
                assert not np.array(program_mask)[..., n:].any()  # the cut's rows past the fetch, for every row
        assert ring.rotated and opt.routed == 6
        for mask, kwargs, reason in [
            (None, {}, "no_array_mask"),  # the helper would attend the padding: not the streams' attention
            ("causal", {}, "no_array_mask"),
            (lambda n: mx.ones((3, 1, 1, n), mx.bool_), {"fetch": False}, "not_fetched"),
            (True, {"between": lambda c: c.trim(1)}, "cache_changed"),
        ]:
            declined = dict(opt.declined)
            out, expected = run(1, mask, **kwargs)
            assert_bits_equal(np.array(out), np.array(expected))  # mlx-lm's helper, as without optimize
            assert [r for r in opt.declined if opt.declined[r] > declined.get(r, 0)] == [reason]


@pytest.mark.parametrize("library", ["mlx_lm", "mlx_vlm"])
def test_a_mask_the_ring_made_is_decided_as_evaluating_it_would_without_evaluating_it(library):
    """Masks of rings before and after they fill, trim and rotate, with and without blind rows (left padding
    past the first query row), windows narrower than the ring: the recorded decision is the evaluated one."""
    import importlib

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.caches import batch
    from attnpass.backends.mlx.calls import ACTIVE
    from tests.backends.mlx_backend.lm_probe import Probe

    pytest.importorskip(library)
    ring = importlib.import_module(f"{library}.models.cache").BatchRotatingKVCache
    decided = []
    with optimize(Probe(), PIPELINE, min_keys=0) as opt, opt.active():
        masks = ACTIVE.get().notes(batch.MADE_MASKS)
        for padding, max_size, steps, rows, window in [
            ([2, 0, 3], 6, [], 5, None),  # a left-padded prefill: blind rows
            ([2, 0, 3], 6, [2], 1, None),  # stream 2's next row is still padding
            ([2, 0, 3], 6, [3], 1, None),
            ([2, 0, 3], 6, [5, 1, 1], 1, None),  # the ring is full: it rotates
            ([2, 0, 3], 6, [5, 1, 1, 1, 1], 1, 3),
            ([4, 1], 4, [6], 3, None),  # a concatenating step past the ring: trimmed
            ([4, 1], 4, [6, 1], 1, 2),
            ([6, 0], 8, [3], 2, None),
            ([6, 0], 4, [6], 1, None),  # stream 0 was all padding: its first row sees only itself, once rotated
            ([7, 0], 4, [6], 1, None),
        ]:
            cache = ring(max_size, padding)
            for step in steps:
                cache.update_and_fetch(*mx.zeros((2, len(padding), 1, step, 4)))
            mask = cache.make_mask(rows, window_size=window, return_array=True)
            made, sees = masks[id(mask)]
            assert made is mask and sees == (not batch.evaluated_blind_row(mask)), (padding, steps, rows)
            decided.append(sees)
    assert set(decided) == {True, False}


def test_a_fetch_that_is_not_the_rings_first_rows_is_declined(monkeypatch):
    """The proof reads the ring's first rows: a fetch of other rows (here its last ones) is declined by name."""
    from mlx_lm.models.cache import BatchRotatingKVCache

    from attnpass.backends.mlx import optimize
    from tests.backends.mlx_backend.lm_probe import Probe

    fetch = BatchRotatingKVCache.update_and_fetch
    monkeypatch.setattr(
        BatchRotatingKVCache, "update_and_fetch", lambda c, k, v: [a[..., 1:, :] for a in fetch(c, k, v)]
    )
    probe, ring = Probe(), BatchRotatingKVCache(max_size=8, left_padding=[0, 0])
    q, k, v = mx.random.normal((3, 2, 4, 3, 64))
    with optimize(probe, PIPELINE, min_keys=0) as opt:
        mx.eval(probe(q, k, v, ring, lambda n: mx.ones((2, 1, 3, n), mx.bool_)))
    assert opt.routed == 0 and opt.declined == {"not_prefix": 1}
