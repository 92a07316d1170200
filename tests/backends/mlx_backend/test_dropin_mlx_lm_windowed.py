"""``optimize`` on windowed caches: mlx-lm's ``RotatingKVCache`` (sliding-window layers) and ``ChunkedKVCache``
(llama4's chunked attention), greedy tokens against plain mlx-lm in float32.

The zoo's tiny models (examples/mlx_lm_sweep.py's configurations: 24 query heads over 2 KV heads, head dim 8,
a sliding window or chunk of 8) generate past their window: a prompt of :data:`PROMPT_LEN` tokens prefilled in
one call (the rotating cache concatenates it whole) or in steps of :data:`STEP` (each step concatenates and
trims the ring; llama4's cache starts mid-chunk), then :data:`TOKENS` decode steps (the ring buffer wraps).
The prefill steps' masks are proven a window or chunk and given to the program as the ``sdpa``'s attributes
(the structured program's graph holds them); the decode steps attend the ring buffer as it is (every row it holds is in the window).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.util import assert_bits_equal, load_example, requires

pytestmark = requires("mlx.core", "mlx_lm")

# block-sparse and head-chunk rewrite every windowed call of the tiny models: none stays one fused call
WINDOWED = "raise-attention,block-sparse{block_q=4},head-chunk{budget=8},dce"
PROMPT_LEN, STEP, TOKENS = 30, 7, 24
WINDOWS = {"gemma3_text": (8, None, None), "gpt_oss": (8, None, None), "cohere2": (8, None, None),
           "exaone4": (8, None, None), "llama4": (None, None, 8)}  # fmt: skip


@pytest.fixture(scope="module")
def sweep():
    return load_example("mlx_lm_sweep")


def greedy(model, step: int) -> tuple[list[int], np.ndarray]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    prompt = mx.array([(7 * i + 3) % 128 for i in range(PROMPT_LEN)])
    steps = list(generate_step(prompt, model, max_tokens=TOKENS, prefill_step_size=step))
    return [int(t) for t, _ in steps], np.stack([np.array(p) for _, p in steps])


@pytest.mark.parametrize("step", [2048, STEP], ids=["one-prefill", "prefill-steps"])
@pytest.mark.parametrize("family", sorted(WINDOWS))
def test_windowed_caches_are_routed_with_the_window_as_an_attribute(family, step, sweep):
    from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache

    from attnpass.backends.mlx import optimize
    from tests.mlx_lm_versions import chunked_cache_keeps_its_rows, mlx_lm_version

    if family == "llama4" and not chunked_cache_keeps_its_rows():
        pytest.skip(
            f"mlx-lm {mlx_lm_version()}'s ChunkedKVCache drops the chunk's keys when llama4 trims its front (it keeps "
            "the last chunk_size rows of its 256-row buffer): plain llama4 attends no key, or fails, past its first call"
        )
    model = sweep.zoo.mlx_model(family, "f32", sweep.tiny_args)
    windowed = [c for c in model.make_cache() if type(c) in (RotatingKVCache, ChunkedKVCache)]
    assert windowed and all(getattr(c, "max_size", None) or c.chunk_size for c in windowed)
    plain, plain_logprobs = greedy(model, step)
    with optimize(model, WINDOWED, strict=True, min_keys=0) as opt:
        tokens, logprobs = greedy(model, step)
    assert tokens == plain
    assert np.abs(logprobs - plain_logprobs).max() <= 1e-4  # tiles sum over fewer keys: within f32 rounding
    # the full-attention layers' KVCache prefill of more than 8 rows is left to MLX's fused call; nothing else
    assert set(opt.declined) <= {"fused_kernel_serves"}
    assert sum(opt.declined.values()) <= (len(model.layers) - len(windowed)) * -(-(PROMPT_LEN - 1) // step)
    # every layer: the prefill steps of all but the last prompt token, then TOKENS + 1 one-row steps (generate_step
    # runs one ahead of what it yields)
    assert opt.routed + sum(opt.declined.values()) == len(model.layers) * (-(-(PROMPT_LEN - 1) // step) + TOKENS + 1)
    structured = [
        e for e in opt.programs["structured_attention"].specializations
        if any(n.op == "sdpa" and n.attrs["window"] == WINDOWS[family] for n in e.imported.graph.nodes())
    ]  # fmt: skip
    assert structured and all(e.compiled for e in structured)  # the window, given as an attribute, compiled
    wraps = [e for e in opt.programs["attention"].specializations if "queries:f32[1,24,1," in e.signature]
    assert any("keys:f32[1,2,8," in e.signature for e in wraps) or family == "llama4"  # decode over the full ring


def test_the_ring_buffer_after_it_wraps_is_attended_as_it_is(sweep):
    """A decode step on a full RotatingKVCache: the program gets the buffer in ring order, every row valid."""
    from mlx_lm.models.cache import RotatingKVCache

    from attnpass.backends.mlx import buffers, optimize

    model = sweep.zoo.mlx_model("gemma3_text", "f32", sweep.tiny_args)
    seen = []
    over_cut = buffers.over_cut

    def spy(call, length, grows):  # the arguments of every call planned over a buffer cut
        out = over_cut(call, length, grows)
        cache = call.cache
        if type(cache) is RotatingKVCache and call.rows == 1:
            _, keys, _, mask, _, _ = out.args
            seen.append((cache._idx, cache.offset, keys is cache.keys, np.array(mask).all(), out.program))
        return out

    buffers.over_cut = spy
    try:
        with optimize(model, WINDOWED, strict=True, min_keys=0):
            greedy(model, 2048)
    finally:
        buffers.over_cut = over_cut
    wrapped = [s for s in seen if s[1] > 8]
    assert wrapped and {s[0] for s in wrapped} == set(range(1, 9))  # every ring position written
    assert all(s[2] and s[3] and s[4] == "attention" for s in wrapped)


def test_a_bool_mask_that_is_no_structure_stays_a_mask():
    """A prefill mask with a hole: no window describes it, so the program takes the helper's mask as it is."""
    import mlx.core as mx
    from mlx_lm.models import base
    from mlx_lm.models.cache import RotatingKVCache

    from attnpass.backends.mlx import optimize
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe

    mx.random.seed(3)
    probe, kv = Probe(), RotatingKVCache(max_size=8)
    q = mx.random.normal((1, 4, 6, 16))
    k, v = mx.random.normal((2, 1, 2, 6, 16))
    holed = mx.tril(mx.ones((6, 6), dtype=mx.bool_)) & (mx.arange(6)[None] != 2)  # rows 3..5: keys 0, 1, 3, ...
    with optimize(probe, "raise-attention,decompose-sdpa{device=cpu},dce", strict=True, min_keys=0) as opt:
        out = probe(q, k, v, kv, holed)
    keys, values, mask = probe.received
    expected = base.scaled_dot_product_attention(q, keys, values, cache=kv, scale=SCALE, mask=mask)
    assert opt.routed == 1
    (entry,) = opt.programs["attention"].specializations
    assert "mask:bool[6,6]" in entry.signature and "structured_attention" not in opt.programs
    assert_bits_equal(np.array(out), np.array(expected))


def test_the_cpu_default_pipeline_tiles_a_long_windowed_prefill_and_keeps_the_tokens(sweep):
    """A 700-token prompt in one prefill call (window 64): block-sparse tiles the sliding and the global layers'
    calls (512-row tiles), the window stays the sdpa's attribute, greedy tokens as plain mlx-lm's in float32."""
    import importlib

    import mlx.core as mx

    from attnpass.backends.mlx import optimize
    from attnpass.passes import default_pipeline, format_pipeline

    module = importlib.import_module("mlx_lm.models.gemma3_text")
    args = {**sweep.tiny_args("gemma3_text", module), "sliding_window": 64}
    mx.random.seed(0)
    model = module.Model(module.ModelArgs(model_type="gemma3_text", **args))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    prompt = mx.array([(7 * i + 3) % 128 for i in range(700)])

    def greedy() -> tuple[list[int], np.ndarray]:
        from mlx_lm.generate import generate_step

        steps = list(generate_step(prompt, model, max_tokens=8))
        return [int(t) for t, _ in steps], np.stack([np.array(p) for _, p in steps])

    plain, plain_logprobs = greedy()
    with optimize(model, "raise-attention," + format_pipeline(default_pipeline("cpu", keep_signature=True)),
                  strict=True, min_keys=0) as opt:  # fmt: skip
        tokens, logprobs = greedy()
    assert tokens == plain and np.abs(logprobs - plain_logprobs).max() <= 1e-4
    assert not opt.declined
    prefill = [
        e for e in opt.programs["structured_attention"].specializations if "queries:f32[1,24,699," in e.signature
    ]
    assert len(prefill) == 2  # the sliding layer (window 64) and the global one (causal)
    for entry in prefill:
        tiled = [r.message for r in entry.remarks if r.pass_name == "block-sparse" and r.kind == "applied"]
        assert len(tiled) == 1 and tiled[0].startswith("block_q 512 (the cpu plan); 2 tiles")
    windows = {n.attrs["window"] for e in prefill for n in e.graph.nodes() if n.op == "sdpa"}
    assert windows == {None, (64, None, None)}  # the global layer's tiles, the sliding layer's tiles
