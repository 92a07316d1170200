"""mlx-lm's batched generation (``BatchKVCache``) under ``optimize`` (backends/mlx/caches/batch.py).

``batch_generate`` runs three prompts of different lengths (left-padded
streams, per-stream offsets) on tiny random models in float32, plain and
optimized: the tokens and log-probabilities must be plain mlx-lm's, bit for
bit, with the batched prefill and every decode step routed, also after a
stream finishes and the batch is filtered, and with continuous batching (one
prompt prefilled at a time, joining the running batch). A one-attention probe
checks what the router substitutes (the buffer's valid rows are the helper's
keys, the padding rows masked out for every stream) and what it declines, by
name, among them a left-padded prefill whose padding rows see no key: forced
through the program, exactly those rows would differ.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

from tests.util import assert_bits_equal, lazy_import, requires

pytestmark = requires("mlx.core", "mlx_lm")

mx = lazy_import("mlx.core")

# CPU's decompose-sdpa on every call of at most 8 query rows, whatever the default device: float32 gives mlx-lm's bits
PIPELINE = "raise-attention,decompose-sdpa{device=cpu},dce"
PROMPTS = [[3, 17, 99, 250, 7, 8, 9, 10, 44], [5, 6, 7, 8, 9, 11], [40, 41, 42, 43]]  # prefill: 8 rows, padded
MAX_TOKENS = [24, 16, 20]  # streams finish at different steps: the batch is filtered to 2, then 1 stream


def generate(family: str, monkeypatch, **kwargs):
    """``batch_generate`` of :data:`PROMPTS`, plain (counting its attention calls) then optimized."""
    import importlib

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.caches import batch as batched
    from attnpass.models import tiny_lm, tiny_tokenizer
    from tests.mlx_lm_versions import batch_generate_ids

    model, tokenizer = tiny_lm(family, dtype="float32"), tiny_tokenizer()
    options = {"max_tokens": MAX_TOKENS, **kwargs}
    module, helper, calls = importlib.import_module(f"mlx_lm.models.{family}"), "scaled_dot_product_attention", []
    original = getattr(module, helper)
    monkeypatch.setattr(module, helper, lambda *a, **k: calls.append(1) or original(*a, **k))
    plain_ids, plain_logprobs = batch_generate_ids(model, tokenizer, PROMPTS, **options)
    monkeypatch.undo()
    monkeypatch.setattr(batched, "evaluated_blind_row", _unexpected)  # every mask is one the cache made
    with optimize(model, PIPELINE, strict=True, min_keys=0) as opt:
        token_ids, logprobs = batch_generate_ids(model, tokenizer, PROMPTS, **options)
    assert token_ids == plain_ids
    assert_bits_equal(np.concatenate(logprobs), np.concatenate(plain_logprobs))
    assert [len(t) for t in plain_ids] == MAX_TOKENS and len({tuple(t) for t in plain_ids}) == 3
    assert opt.routed == len(calls) and not opt.declined  # every attention call of plain mlx-lm's run
    return opt


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_generate_is_identical_with_the_prefill_and_every_decode_step_routed(family, monkeypatch):
    opt = generate(family, monkeypatch)
    shapes = {e.signature.split(", ")[0] for e in opt.programs["attention"].specializations}
    # the 3 streams' prefill (8 rows, right-padded), then decode steps of 3, 2 and 1 streams: the program runs once
    # per stream (caches/batch.py, per_stream), so its signatures name no batch size
    assert shapes == {"queries:f32[1,24,8,128]", "queries:f32[1,24,1,128]"}
    out = io.StringIO()
    opt.explain(file=out)
    assert f"routed {opt.routed} attention call(s)" in out.getvalue() and "declined: none" in out.getvalue()


def test_continuous_batching_extends_the_running_batch_and_stays_identical(monkeypatch):
    # one prompt prefilled at a time, each joining the decoding batch (BatchKVCache.extend: buffers re-padded)
    opt = generate("llama", monkeypatch, prefill_batch_size=1)
    shapes = {e.signature.split(", ")[0] for e in opt.programs["attention"].specializations}
    assert {"queries:f32[1,24,8,128]", "queries:f32[1,24,3,128]", "queries:f32[1,24,1,128]"} <= shapes
    assert not any(shape.startswith(("queries:f32[2,", "queries:f32[3,")) for shape in shapes)  # one stream a call


def test_the_router_substitutes_the_buffer_with_each_streams_padding_or_declines_by_name(monkeypatch):
    from mlx_lm.models import base
    from mlx_lm.models.cache import BatchKVCache

    from attnpass.backends.mlx import OptimizedModel, optimize
    from attnpass.backends.mlx.caches import batch as batched
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe, spy_run

    substituted = []
    monkeypatch.setattr(OptimizedModel, "_run", spy_run(OptimizedModel._run, substituted))
    mx.random.seed(0)
    padding, has_blind_row = [2, 0, 3], batched.has_blind_row
    probe, kv = Probe(), BatchKVCache(left_padding=padding)

    def model_mask(rows: int):  # BatchKVCache.make_mask, as the model builds it before the fetch
        return lambda keys: base.create_causal_mask(rows, offset=keys - rows, left_padding=kv.left_padding)

    def run(rows: int, mask, **kwargs):
        q = mx.random.normal((3, 4, rows, 64))
        k, v = mx.random.normal((2, 3, 2, rows, 64))
        out = probe(q, k, v, kv, mask, **kwargs)
        keys, values, given = probe.received
        return out, base.scaled_dot_product_attention(q, keys, values, cache=kv, scale=SCALE, mask=given)

    # check=False: the test routes blind rows on purpose below, which the shadow mode would refuse (it does)
    with optimize(probe, PIPELINE, strict=True, min_keys=0, check=False) as opt:
        # a left-padded prefill: its first rows of streams 0 and 2 see no key, mlx-lm's helper gives them its own value
        out, expected = run(5, model_mask(5))
        assert_bits_equal(np.array(out), np.array(expected))
        assert opt.routed == 0 and opt.declined == {"rows_without_keys": 1}
        # what the decline avoids: through the padded buffer the blind rows (and only they) would differ
        kv.trim(5)
        monkeypatch.setattr(batched, "has_blind_row", lambda *_: False)
        out, expected = run(5, model_mask(5))
        monkeypatch.setattr(batched, "has_blind_row", has_blind_row)
        differ = np.array(out != expected).any(axis=(1, 3))  # [stream, row]
        assert differ.tolist() == [[r < pad for r in range(5)] for pad in padding] and opt.routed == 1
        for rows in (3, 1, 1):  # every row now sees its stream's keys
            out, expected = run(rows, model_mask(rows))
            assert_bits_equal(np.array(out), np.array(expected))
            routed = substituted[-1]
            assert routed.program == "attention" and len(routed.streams) == 3  # one program call per stream
            n = kv._idx
            for stream, pad in enumerate(padding):
                _, buffer_k, _, program_mask = routed.streams[stream]
                assert_bits_equal(np.array(buffer_k[..., :n, :]), np.array(probe.received[0][stream : stream + 1]))
                visible = np.array(program_mask)
                assert not visible[..., n:].any()  # the unwritten rows, for every query row
                assert not visible[..., :pad].any() and visible[..., pad:n].any()  # the left padding stays masked
        assert opt.routed == 1 + 3 and opt.declined == {"rows_without_keys": 1}
        for mask, kwargs, reason in [
            (None, {}, "no_array_mask"),  # mlx-lm's helper would attend the padding: not the streams' attention
            ("causal", {}, "no_array_mask"),
            (model_mask(1), {"fetch": False}, "not_fetched"),
            (model_mask(1), {"between": lambda c: c.trim(1)}, "cache_changed"),
        ]:
            declined = dict(opt.declined)
            out, expected = run(1, mask, **kwargs)
            assert_bits_equal(np.array(out), np.array(expected))  # mlx-lm's helper, as without optimize
            new = [r for r in opt.declined if opt.declined[r] > declined.get(r, 0)]
            assert new == [reason]
    assert opt.routed == 1 + 3


def test_a_mask_the_cache_made_is_decided_as_evaluating_it_would_without_evaluating_it():
    """BatchKVCache.make_mask's masks (causal, windowed, left-padded, blind rows or not): the recorded decision is
    the evaluated one; a mask made with another option is not recorded."""
    from mlx_lm.models.cache import BatchKVCache

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.caches import batch as batched
    from attnpass.backends.mlx.calls import ACTIVE
    from tests.backends.mlx_backend.lm_probe import Probe

    decided = []
    with optimize(Probe(), PIPELINE, min_keys=0) as opt, opt.active():
        masks = ACTIVE.get().notes(batched.MADE_MASKS)
        for padding, written, rows, window in [
            ([2, 0, 3], 0, 5, None),  # a left-padded prefill: blind rows
            ([2, 0, 3], 2, 1, None),  # stream 2's next row is still padding
            ([2, 0, 3], 3, 1, None),
            ([2, 0, 3], 3, 4, None),
            ([0, 0], 0, 8, None),
            ([4, 1], 2, 3, 2),
            ([4, 1], 4, 1, 1),
            ([1, 6], 5, 2, 3),
        ]:
            cache = BatchKVCache(padding)
            if written:
                cache.update_and_fetch(*mx.zeros((2, len(padding), 1, written, 4)))
            mask = cache.make_mask(rows, window_size=window)
            made, sees = masks[id(mask)]
            assert made is mask and sees == (not batched.evaluated_blind_row(mask))
            decided.append(sees)
        mask = BatchKVCache([1, 0]).make_mask(2, right_padding=mx.array([1, 0]))
        assert id(mask) not in masks  # not make_mask's own mask: evaluated when used
    assert set(decided) == {True, False}


def test_a_left_padded_prefill_is_declined_and_its_decode_routed_without_evaluating_a_mask(monkeypatch):
    """A llama model's own calls on left-padded streams: the blind prefill declined (both layers), the decode steps
    routed, from the masks the cache made (never evaluated); the logits are plain mlx-lm's bit for bit."""
    from mlx_lm.models.cache import BatchKVCache

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.caches import batch as batched
    from attnpass.models import tiny_lm

    model, padding, steps = tiny_lm("llama", dtype="float32"), [2, 0, 3], 4
    prompts = mx.array([[0, 0, 3, 17, 99, 250, 7, 8], [5, 6, 7, 8, 9, 11, 12, 13], [0, 0, 0, 40, 41, 42, 43, 44]])

    def run():
        cache = [BatchKVCache(padding) for _ in model.layers]
        logits = [model(prompts, cache=cache)[:, -1]]
        for _ in range(steps):
            logits.append(model(mx.argmax(logits[-1], axis=-1)[:, None], cache=cache)[:, -1])
        return np.array(mx.stack(logits))

    plain = run()
    monkeypatch.setattr(batched, "evaluated_blind_row", _unexpected)
    with optimize(model, PIPELINE, strict=True, min_keys=0) as opt:
        optimized = run()
    assert_bits_equal(optimized, plain)
    assert opt.declined == {"rows_without_keys": 2} and opt.routed == 2 * steps


def _unexpected(mask):
    raise AssertionError(f"a mask {mask.shape} was evaluated: the cache's make_mask made none")
