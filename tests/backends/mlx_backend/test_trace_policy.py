"""The trace policy (backends/mlx/buffers.py: ``buffer_rows``, ``cuts_bound``, ``grow``): a decode call's buffer cut
covers its offset with bounded padding, the contexts up to ``T`` have ``cuts_bound(T)`` cuts (O(log T), under
``max_signatures`` up to 131072), a buffer shorter than its cut is grown to it with the routed call exact, and an
optimized model generating tokens builds one signature per cut it reaches, none evicted, then no more."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.util import assert_bits_equal, lazy_import, requires

mx = lazy_import("mlx.core")

MOST = 131072  # the longest context the policy is stated for


def test_every_offset_is_covered_with_bounded_padding_and_few_cuts():
    """For every offset up to 131072: the cut covers it, its padding is at most padding_bound (under 32 rows, or
    under a quarter of the offset), the cuts never shrink, and the number of distinct cuts over [1, T] is
    cuts_bound(T), at most 4 per doubling (44 at 131072, under optimize's 64 signatures)."""
    from attnpass.backends.mlx.buffers import CUTS_PER_OCTAVE, buffer_rows, cuts_bound, padding_bound
    from attnpass.backends.specialize import MAX_SIGNATURES

    seen, last = set(), 0
    for offset in range(1, MOST + 1):
        cut = buffer_rows(offset)
        assert offset <= cut <= offset + padding_bound(offset)
        assert padding_bound(offset) < max(32, offset / CUTS_PER_OCTAVE)
        assert cut >= last
        seen.add(cut)
        last = cut
        assert len(seen) == cuts_bound(offset)
        assert cuts_bound(offset) <= CUTS_PER_OCTAVE * max(1, (offset - 1).bit_length() - 6)
    assert cuts_bound(MOST) == 44 < MAX_SIGNATURES


@settings(max_examples=300, deadline=None)
@given(offset=st.integers(1, 1 << 24), length=st.integers(1, 1 << 24))
def test_a_cut_is_at_most_a_buffer_that_cannot_grow(offset, length):
    """Past the stated range too: a buffer that cannot grow (a ring's, a chunk's) caps the cut, else the cut is
    the offset's, with its padding under a quarter of the offset (or 32 rows)."""
    from attnpass.backends.mlx.buffers import buffer_rows

    cut = buffer_rows(offset)
    assert buffer_rows(offset, length) == min(length, cut)
    assert offset <= cut < offset + max(32, offset / 4)


def probe_cache(kind: str, rows: int):
    """A cache of ``kind`` holding ``rows`` random rows (float32; a BatchKVCache of 3 left-padded streams)."""
    from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

    cache = {"kv": KVCache(), "quantized": QuantizedKVCache(group_size=64, bits=8), "batch": BatchKVCache([0, 5, 11])}
    found = cache[kind]
    found.update_and_fetch(*mx.random.normal((2, 3 if kind == "batch" else 1, 2, rows, 128)))
    return found


def buffer_length(cache) -> int:
    return (cache.keys[0] if isinstance(cache.keys, (tuple, list)) else cache.keys).shape[2]


@requires("mlx.core", "mlx_lm")
@pytest.mark.parametrize("kind", ["kv", "quantized", "batch"])
def test_a_buffer_shorter_than_its_cut_is_grown_and_the_call_is_exact(kind):
    """Past 2048 keys a cut (2560 at offsets 2049 to 2560) is longer than the buffer mlx-lm's cache grew (2304):
    the router grows the buffer to the cut, and each routed decode step gives mlx-lm's helper's bits (float32)
    on the grown buffer, which the cache's own update_and_fetch then keeps writing into. A second call in the same
    model call on the same fetch (a layer sharing its KV) still routes: the recorded fetch holds the grown
    buffer."""
    from mlx_lm.models import base

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.buffers import buffer_rows
    from tests.backends.mlx_backend.shared_kv import SCALE, SharedKV

    mx.random.seed(0)
    streams = 3 if kind == "batch" else 1
    cache = probe_cache(kind, 2048)
    probe = SharedKV()
    with optimize(probe, strict=True, min_keys=0) as opt:
        for step in range(3):
            q = mx.random.normal((streams, 24, 1, 128))
            k, v = mx.random.normal((2, streams, 2, 1, 128))
            mask = (lambda: cache.make_mask(1, return_array=True)) if kind == "batch" else (lambda: None)
            first, second = probe(q, k, v, cache, mask)
            keys, values, made = probe.received
            expected = base.scaled_dot_product_attention(q, keys, values, cache=cache, scale=SCALE, mask=made)
            assert_bits_equal(np.array(first), np.array(expected))
            assert_bits_equal(np.array(second), np.array(expected))
            assert buffer_length(cache) == buffer_rows(2049 + step) == 2560
    assert opt.routed == 6 and not opt.declined


def generate(model, prompt: int, count: int, after=None) -> list[tuple[int, np.ndarray]]:
    """``count`` greedy tokens and their log-probabilities (float32) after a ``prompt``-token prompt; ``after()``
    runs after each token."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    found = []
    steps = generate_step(mx.arange(1, prompt + 1), model, prompt_cache=make_prompt_cache(model), max_tokens=count)
    for token, logprobs in steps:
        found.append((int(token), np.array(logprobs)))
        if after is not None:
            after()
    return found


@requires("mlx.core", "mlx_lm")
def test_a_generating_model_traces_once_per_cut_and_then_stops():
    """A tiny model (float32) generating 600 tokens after an 8-token prompt, every depth routed: the
    log-probabilities are plain mlx-lm's, bit for bit; after each token the traces are at most the cuts of the
    contexts reached (cuts_bound) plus the prompt's own signature; with max_signatures at exactly that many, none
    is ever evicted (the traces are the signatures held), and past the last cut reached (641 keys) the traces stop
    growing."""
    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.buffers import buffer_rows, cuts_bound
    from attnpass.models import tiny_lm

    prompt, count = 8, 600
    shape = {"heads": 4, "kv_heads": 1, "head_dim": 64}
    plain = generate(tiny_lm("llama", dtype="float32", **shape), prompt, count)
    model = tiny_lm("llama", dtype="float32", **shape)
    most = cuts_bound(prompt + count) + 1  # the prompt's 7-row call is one more signature
    traces: list[int] = []
    with optimize(model, min_keys=0, max_signatures=most) as opt:
        routed = generate(model, prompt, count, lambda: traces.append(opt.traces))
        held = sum(len(c.specializations) for c in opt.programs.values())
    assert [t for t, _ in routed] == [t for t, _ in plain]
    for (_, got), (_, expected) in zip(routed, plain):
        assert_bits_equal(got, expected)
    contexts = [prompt + i for i in range(1, count + 1)]  # keys after each token's step (one step ahead)
    assert all(t <= cuts_bound(c) + 1 for t, c in zip(traces, contexts))
    assert opt.traces == held == most and not opt.declined
    last = next(i for i, c in enumerate(contexts) if buffer_rows(c + 1) == buffer_rows(prompt + count))
    assert len(set(traces[last + 1 :])) == 1


@requires("mlx.core", "mlx_lm")
def test_batches_of_any_size_share_the_signatures():
    """Batched generation (BatchKVCache, as mlx-lm's server runs it) in bursts of 4, 1, 2 and 3 streams of the same
    prompt length: the tokens are plain mlx-lm's, and after the first burst no burst traces again (the program
    runs once per stream: no signature names a batch size)."""
    from attnpass.backends.mlx import optimize
    from attnpass.models import tiny_lm, tiny_tokenizer
    from tests.mlx_lm_versions import batch_generate_ids

    shape = {"heads": 4, "kv_heads": 1, "head_dim": 64}
    plain, model, tokenizer = tiny_lm(dtype="float32", **shape), tiny_lm(dtype="float32", **shape), tiny_tokenizer()

    def burst(generating, streams: int) -> list[list[int]]:
        prompts = [[(11 * s + j) % 500 + 1 for j in range(6)] for s in range(streams)]
        return batch_generate_ids(generating, tokenizer, prompts, max_tokens=40)[0]

    traces = []
    with optimize(model, min_keys=0) as opt:
        for streams in (4, 1, 2, 3):
            assert burst(model, streams) == burst(plain, streams)
            traces.append(opt.traces)
    assert opt.routed > 0 and len(set(traces)) == 1
