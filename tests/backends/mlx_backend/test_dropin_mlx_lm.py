"""``attnpass.backends.mlx.optimize``: mlx-lm generation through attnpass programs, tokens and log-probabilities.

Tiny random models (:func:`attnpass.models.tiny_lm`: GQA 12, head dim 128, bf16)
generate 64 greedy tokens with mlx-lm's own ``stream_generate`` / ``generate``,
plain and optimized; speculative decoding runs with a one-layer draft. The
pipeline :data:`CHUNKED` rewrites every call of at most 8 query rows (head-chunk
with budget 8 < GQA 12), so decode and verify steps run attnpass programs while
the 11-row prefill keeps MLX's fused call and is declined to mlx-lm's helper.
Head-chunk runs MLX's fused call per head chunk: the log-probabilities are
plain mlx-lm's, bit for bit. The CPU default pipeline's decompose-sdpa repeats
MLX's CPU fallback op for op in the model's dtype: bit for bit too, in float32,
float16 and bfloat16.
(What the router substitutes, cache class by cache class: test_dropin_mlx_lm_router.py.)
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.util import assert_bits_equal, load_example, requires

pytestmark = requires("mlx.core", "mlx_lm")

PROMPT = [3, 17, 99, 250, 7, 8, 9, 10, 44, 1, 2, 3]
TOKENS = 64
CHUNKED = "raise-attention,head-chunk{budget=8},dce"


@pytest.fixture(scope="module")
def tokenizer():
    from attnpass.models import tiny_tokenizer

    return tiny_tokenizer()


def stream_tokens(model, tokenizer, max_tokens: int = TOKENS, **kwargs) -> list[int]:
    return stream(model, tokenizer, max_tokens, **kwargs)[0]


def stream(model, tokenizer, max_tokens: int = TOKENS, **kwargs) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each step's log-probabilities (float32: exact for bf16) from mlx-lm's stream_generate."""
    import mlx.core as mx
    import mlx_lm

    responses = list(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=max_tokens, **kwargs))
    return [r.token for r in responses], np.stack([np.array(r.logprobs.astype(mx.float32)) for r in responses])


@pytest.mark.parametrize("family, dtype", [("llama", "bfloat16"), ("qwen3", "bfloat16"), ("llama", "float32")])
def test_greedy_tokens_are_identical_and_a_signature_per_32_decode_rows(family, dtype, tokenizer):
    from attnpass.backends.mlx import optimize
    from attnpass.ir import DType
    from attnpass.models import tiny_lm

    model = tiny_lm(family, dtype=dtype)
    plain, plain_logprobs = stream(model, tokenizer)
    with optimize(model, CHUNKED, strict=True, min_keys=0) as opt:
        optimized, logprobs = stream(model, tokenizer)
    assert optimized == plain
    assert_bits_equal(logprobs, plain_logprobs)  # head-chunk: MLX's fused call per chunk of heads
    assert len(plain) == TOKENS and len(set(plain)) >= 8  # a model that says something: the comparison means something
    # prefill of 11 rows and 1-row decode steps (12 to 74 keys), all within the first 256-row buffer of mlx-lm's
    # KVCache, given cut to 32, 64 and 96 rows (buffer_rows): one signature each, and the prefill's
    assert opt.traces == 4
    keys = [f"keys:{DType.parse(dtype).short}[1,2,{rows},128]" for rows in (32, 32, 64, 96)]
    assert [e.signature.split(", ")[1] for e in opt.programs["attention"].specializations] == keys
    assert opt.declined == {"fused_kernel_serves": 2}  # the prefill chunk, in both layers
    assert opt.routed >= 2 * (TOKENS - 1)  # both layers of every decode step


def test_the_default_pipeline_routes_only_what_it_rewrites(tokenizer):
    from attnpass.backends.mlx import optimize
    from attnpass.models import tiny_lm

    model = tiny_lm("llama", layers=1)
    plain, plain_logprobs = stream(model, tokenizer, max_tokens=16)
    with optimize(model, strict=True, min_keys=0) as opt:
        optimized, logprobs = stream(model, tokenizer, max_tokens=16)
    assert optimized == plain
    assert_bits_equal(logprobs, plain_logprobs)
    # what the device's pipeline leaves as MLX's fused call runs mlx-lm's helper; nothing fails or is declined otherwise
    assert set(opt.declined) <= {"fused_kernel_serves"} and calls(opt) >= 16


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_kv_cache_is_routed_with_plain_mlx_lms_tokens_bit_for_bit(family, bits, tokenizer):
    """``kv_bits`` with ``quantized_kv_start=0``: mlx-lm quantizes the cache after the prefill, and every decode
    call then runs on a QuantizedKVCache. All of them are routed (raised to one quantized_sdpa per signature),
    and the float32 log-probabilities are plain mlx-lm's quantized path, bit for bit."""
    import io

    from attnpass.backends.mlx import optimize
    from attnpass.models import tiny_lm

    model = tiny_lm(family, dtype="float32")
    quantized = {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": 0}
    plain, plain_logprobs = stream(model, tokenizer, **quantized)
    with optimize(model, strict=True, min_keys=0) as opt:
        optimized, logprobs = stream(model, tokenizer, **quantized)
    assert optimized == plain and len(set(plain)) >= 8
    assert_bits_equal(logprobs, plain_logprobs)
    # both layers of every 1-row step: the prompt's last token, then decode one token ahead of the last yielded
    assert opt.routed == 2 * (TOKENS + 1)
    assert opt.declined == {"fused_kernel_serves": 2}  # the 11-row prefill, on the KVCache mlx-lm quantizes afterwards
    # offsets 12 to 76 of a 256-row buffer: cut to 32, 64 and 96 rows (buffer_rows), one signature each
    entries = opt.programs["quantized_attention"].specializations
    words = 128 * bits // 32
    assert [e.signature.split(", kq:")[1].split("], ")[0] for e in entries] == [
        f"uint32[1, 2, {r}, {words}" for r in (32, 64, 96)
    ]
    for entry in entries:
        assert entry.signature.startswith("queries:f32[1,24,1,128], ") and entry.signature.endswith(f"bits={bits}")
        assert [n.op for n in entry.graph if n.op != "input"] == ["quantized_sdpa"]
    text = io.StringIO()
    opt.explain(file=text, full=True)  # the whole report: every remark's message
    assert f"routed {2 * (TOKENS + 1)} attention call(s)" in text.getvalue()
    assert "quantized_sdpa: 24 query heads on 2 kv heads" in text.getvalue()


def test_speculative_decoding_is_identical_with_the_verify_steps_routed(tokenizer):
    import mlx_lm

    from attnpass.backends.mlx import optimize
    from attnpass.models import tiny_lm

    model, draft = tiny_lm("llama"), tiny_lm("llama", layers=1, hidden=64, heads=4, head_dim=16, seed=1)
    speculative = {"max_tokens": TOKENS, "draft_model": draft, "num_draft_tokens": 3}
    plain = mlx_lm.generate(model, tokenizer, PROMPT, **speculative)
    plain_tokens, plain_logprobs = stream(model, tokenizer, **speculative)
    with (
        optimize(model, CHUNKED, strict=True, min_keys=0) as opt,
        optimize(draft, CHUNKED, strict=True, min_keys=0) as opt_draft,
    ):
        optimized = mlx_lm.generate(model, tokenizer, PROMPT, **speculative)
        tokens, logprobs = stream(model, tokenizer, **speculative)
    assert optimized == plain and len(plain.split()) == TOKENS
    assert tokens == plain_tokens
    assert_bits_equal(logprobs, plain_logprobs)  # the verify steps' log-probabilities too: head-chunk is bit for bit
    rows = {entry.signature.split(", ")[0] for entry in opt.programs["attention"].specializations}
    assert "queries:bf16[1,24,4,128]" in rows  # a verify step: 3 draft tokens + 1, chunked and routed
    assert opt.routed > 0 and calls(opt_draft) > 0  # the draft's GQA 2 fits the budget: its calls stay fused


def test_one_trace_per_cache_buffer_length(monkeypatch):
    """With a 16-row KVCache step (a buffer shorter than its cut, grown to it by the router), 64 decode steps cross
    3 cuts (buffer_rows): one trace each, never one per step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache

    from attnpass.backends.mlx import optimize
    from attnpass.models import tiny_lm

    monkeypatch.setattr(KVCache, "step", 16)
    model = tiny_lm("llama", layers=1)

    def greedy() -> tuple[list[int], np.ndarray]:
        steps = list(generate_step(mx.array(PROMPT), model, max_tokens=TOKENS))
        return [t for t, _ in steps], np.stack([np.array(p.astype(mx.float32)) for _, p in steps])

    plain, plain_logprobs = greedy()
    with optimize(model, CHUNKED, strict=True, min_keys=0) as opt:
        optimized, logprobs = greedy()
    assert optimized == plain
    assert_bits_equal(logprobs, plain_logprobs)  # across every buffer growth, the cache's and the router's
    lengths = sorted(
        {int(e.signature.split("keys:bf16[1,2,")[1].split(",")[0]) for e in opt.programs["attention"].specializations}
    )
    # 11 prompt rows fill a 16-row buffer, grown to the 32-row cut; decode reaches 12 + 63 = 75 rows: cuts 32, 64, 96
    assert lengths == [32, 64, 96]
    assert opt.traces == len(lengths) + 1  # + the 11-row prefill over the first cut


def test_caches_without_a_buffer_are_declined_and_counted(tokenizer):
    from mlx_lm.models.cache import ConcatenateKVCache

    from attnpass.backends.mlx import optimize
    from attnpass.models import tiny_lm

    model = tiny_lm("llama", layers=1)
    plain, plain_logprobs = stream(model, tokenizer, prompt_cache=[ConcatenateKVCache()])
    with optimize(model, min_keys=0) as opt:
        tokens, logprobs = stream(model, tokenizer, prompt_cache=[ConcatenateKVCache()])
    assert tokens == plain
    assert_bits_equal(logprobs, plain_logprobs)  # every call declined: mlx-lm's own, bit for bit
    assert opt.routed == 0 and opt.traces == 0
    assert list(opt.declined) == ["cache_unrouted"] and "ConcatenateKVCache" in opt.declines["cache_unrouted"].message


def test_restore_undoes_the_routing_and_other_models_never_route():
    import mlx.core as mx
    from mlx_lm.models import base, cache, llama

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.clients import MLX_LM_HELPER

    route = MLX_LM_HELPER.trampoline()
    from attnpass.models import tiny_lm

    model, other = tiny_lm("llama", layers=1), tiny_lm("llama", layers=1)
    tokens = mx.array([PROMPT[:6]])  # 6 rows, no cache: a "causal" call that CHUNKED rewrites, so routed
    before = model(tokens)
    update_and_fetch = cache.KVCache.update_and_fetch
    opt = optimize(model, CHUNKED, strict=True, min_keys=0)
    assert llama.scaled_dot_product_attention is route and type(model) is not llama.Model
    with pytest.raises(ValueError, match="already optimized"):
        optimize(model)
    second = optimize(other, CHUNKED, min_keys=0)
    other(tokens)  # seen by its own handle only
    assert calls(opt) == 0 and calls(second) == 1
    second.restore()
    assert llama.scaled_dot_product_attention is route  # still used by `model`
    after = model(tokens)
    assert opt.routed == 1 and not opt.declined
    assert_bits_equal(np.array(after.astype(mx.float32)), np.array(before.astype(mx.float32)))
    opt.restore()
    opt.restore()  # idempotent
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert cache.KVCache.update_and_fetch is update_and_fetch  # no longer recorded
    assert type(model) is llama.Model and type(other) is llama.Model
    assert mx.array_equal(model(tokens), before) and calls(opt) == 1
    assert "mlx_lm.models.llama" in sys.modules and repr(opt).startswith("<OptimizedModel Model (restored)")


@pytest.mark.parametrize(
    "family, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen3", "bfloat16"), ("llama", "float16")]
)
def test_the_default_pipeline_is_bit_exact_in_every_dtype(family, dtype, tokenizer):
    """CPU's decompose-sdpa on every decode step: MLX's CPU fallback's own ops, so mlx-lm's log-probabilities."""
    import mlx.core as mx

    from attnpass.backends.mlx import optimize
    from attnpass.models import tiny_lm

    if mx.default_device() != mx.cpu:
        pytest.skip("bit-exactness is measured for CPU's default pipeline (MLX's CPU fallback of the fused call)")
    model = tiny_lm(family, dtype=dtype)
    plain, plain_logprobs = stream(model, tokenizer)
    with optimize(model, strict=True, min_keys=0) as opt:
        tokens, logprobs = stream(model, tokenizer)
    assert opt.routed >= 2 * (TOKENS - 1) and len(plain) == TOKENS
    assert tokens == plain
    assert_bits_equal(logprobs, plain_logprobs)


def test_a_declined_prefill_is_decided_before_lowering_and_built_once(tokenizer):
    from attnpass.backends.mlx import optimize
    from attnpass.models import tiny_lm

    model = tiny_lm("llama", layers=1)
    with optimize(model, CHUNKED, strict=True, min_keys=0) as opt:
        first = stream_tokens(model, tokenizer, max_tokens=4)
        traces = opt.traces
        assert stream_tokens(model, tokenizer, max_tokens=4) == first
    assert opt.traces == traces == 2  # the 11-row prefill and the decode step, each built once for both runs
    assert opt.declined == {"fused_kernel_serves": 2}
    prefill = next(
        e for e in opt.programs["attention"].specializations if e.signature.startswith("queries:bf16[1,24,11,")
    )
    assert (
        prefill.declined.reason == "fused_kernel_serves" and prefill.program is None and prefill.call is None
    )  # never lowered or compiled
    assert prefill.ops == {"sdpa": 1}


def calls(opt) -> int:
    """Attention calls an optimized model saw: routed or declined."""
    return opt.routed + sum(opt.declined.values())


def test_a_model_without_the_shared_helper_is_refused():
    import mlx.nn as nn

    from attnpass.backends.mlx import optimize

    with pytest.raises(ValueError, match="no_client: .* calls a registered client function .*mlx_lm.models.base"):
        optimize(nn.Linear(4, 4))


def test_the_example_generates_identical_texts(capsys):
    assert load_example("mlx_lm_optimize").main(tokens=8, pipeline=CHUNKED, min_keys=0)
    out = capsys.readouterr().out
    assert out.count("identical with optimize") == 3 and "DIFFERENT" not in out
    assert " 0 attention call(s) routed" not in out and out.count("attention call(s) routed") == 3
    assert "[head-chunk] applied" in out


def test_the_example_routes_nothing_below_the_cpu_bound_and_says_why(capsys):
    assert load_example("mlx_lm_optimize").main(tokens=8, dtype="float32")
    out = capsys.readouterr().out
    assert out.count(" 0 attention call(s) routed") == 3 and "declined short_context x" in out
