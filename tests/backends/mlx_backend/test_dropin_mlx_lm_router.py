"""What ``optimize``'s router substitutes (backends/mlx/caches/): the cache's buffer only when provably the helper's k/v.

Every cache class mlx-lm ships goes through a one-attention probe module
(``tests/backends/mlx_backend/lm_probe.py``) under ``optimize``: a routed call must have
been given a buffer whose valid prefix is, bit for bit, what the helper
received, and compute what mlx-lm's helper computes on it; any other call is
declined with a named reason and is mlx-lm's helper, bit for bit. MLA models
(the cache holds a latent, the model builds k/v from it) must decode exactly
as without ``optimize`` (their multi-row calls: tests/backends/mlx_backend/test_mla.py).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from tests.util import assert_bits_equal, lazy_import, requires

pytestmark = requires("mlx.core", "mlx_lm")

mx = lazy_import("mlx.core")

HEADS, KV_HEADS, DIM = 4, 2, 64
# CPU's decompose-sdpa, named so that every KVCache call is rewritten whatever the default device: float32 on
# CPU gives mlx-lm's bits, over the padded buffer too (the masked rows add exact zeros)
PIPELINE = "raise-attention,decompose-sdpa{device=cpu},dce"
# (query rows, mask) per step: a prefill with "causal", a decode step without a mask, then array masks over
# the keys the helper receives (bool, then additive), each one row so that every cache class takes them
STEPS = [(5, "causal"), (1, None), (2, "bool"), (1, "additive")]
CACHES = {
    "KVCache": lambda c: c.KVCache(),
    "ConcatenateKVCache": lambda c: c.ConcatenateKVCache(),
    "QuantizedKVCache": lambda c: c.QuantizedKVCache(group_size=64, bits=8),
    "RotatingKVCache": lambda c: c.RotatingKVCache(max_size=6),
    "ChunkedKVCache": lambda c: c.ChunkedKVCache(chunk_size=4),
    "BatchKVCache": lambda c: c.BatchKVCache(left_padding=[0]),
    "BatchRotatingKVCache": lambda c: c.BatchRotatingKVCache(max_size=6, left_padding=[0]),
    "CacheList": lambda c: c.CacheList(c.KVCache()),
    "ArraysCache": lambda c: c.ArraysCache(size=2),
}


ROUTED = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache", "BatchKVCache", "BatchRotatingKVCache")


def array_mask(kind: str, rows: int):
    """The step's mask as a function of the keys received: causal (bottom-right), bool or additive."""
    if kind in ("bool", "additive"):

        def build(keys: int):
            valid = mx.arange(keys)[None] <= (keys - rows + mx.arange(rows))[:, None]
            valid = valid[None, None]
            return valid if kind == "bool" else mx.where(valid, 0.0, -1e9).astype(mx.float32)

        return build
    return kind


def test_the_cache_classes_covered_are_the_ones_mlx_lm_ships():
    from mlx_lm.models import cache

    shipped = {n for n, k in inspect.getmembers(cache, inspect.isclass) if issubclass(k, cache._BaseCache)}
    assert shipped - {"_BaseCache"} == set(CACHES)  # a new cache class in mlx-lm: add it to CACHES


@pytest.mark.parametrize("name", sorted(CACHES))
def test_a_cache_class_is_routed_with_the_helpers_own_arrays_or_declined_by_name(name, monkeypatch):
    from mlx_lm.models import base, cache

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx import OptimizedModel
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe, spy_run

    substituted = []
    monkeypatch.setattr(OptimizedModel, "_run", spy_run(OptimizedModel._run, substituted))
    mx.random.seed(0)
    probe, kv = Probe(), CACHES[name](cache)
    with optimize(probe, PIPELINE, strict=True, min_keys=0) as opt:
        for rows, kind in STEPS:
            q = mx.random.normal((1, HEADS, rows, DIM))
            k, v = mx.random.normal((2, 1, KV_HEADS, rows, DIM))
            routed, declined, before = opt.routed, sum(opt.declined.values()), len(substituted)
            fused = opt.declined["fused_kernel_serves"]
            # a copy of q: the quantized helper scales its queries in place
            out = probe(mx.array(q), k, v, kv, array_mask(kind, rows))
            keys, values, mask = probe.received
            expected = base.scaled_dot_product_attention(q, keys, values, cache=kv, scale=SCALE, mask=mask)
            if len(substituted) > before:  # past the proofs: routed, or declined as fused after its pipeline
                assert name in ROUTED and opt.routed + opt.declined["fused_kernel_serves"] == routed + fused + 1
                routed_call, n = substituted[before], (keys[0] if name == "QuantizedKVCache" else keys).shape[2]
                arguments = routed_call.args
                if name == "QuantizedKVCache":  # words, scales and biases of K, then of V, over the buffer's rows
                    program_mask, length = arguments[7], arguments[1].shape[2]
                    assert routed_call.program == "quantized_attention" and len(arguments) == 11
                    for buffer, array in zip(arguments[1:7], (*keys, *values)):
                        assert_bits_equal(np.array(buffer[..., :n, :]), np.array(array))
                    visible = np.array(program_mask if program_mask.dtype == mx.bool_ else program_mask > -1e30)
                    assert not np.broadcast_to(visible, (1, 1, rows, length))[..., n:].any()
                    assert_bits_equal(np.array(out), np.array(expected))
                    continue
                program_k, program_v, program_mask, structure = program_arrays(routed_call)
                if program_k.shape[2] >= n:  # the buffer (or the keys themselves): its first n rows are the keys
                    assert_bits_equal(np.array(program_k[..., :n, :]), np.array(keys))
                    assert_bits_equal(np.array(program_v[..., :n, :]), np.array(values))
                else:  # a prefill's keys from the first one any row sees
                    assert structure is not None
                    assert_bits_equal(np.array(program_k), np.array(keys[..., n - program_k.shape[2] :, :]))
                if structure is not None:  # the mask, by positions: what the helper's mask says, pair by pair
                    assert program_mask is None
                    seen = causal_plane(rows, n) if isinstance(mask, str) else np.array(mask).reshape(rows, n)
                    first = n - program_k.shape[2]
                    assert not seen[:, :first].any()
                    assert np.array_equal(structure_plane(structure, rows, n - first), seen[:, first:])
                elif program_k.shape[2] > n:  # the padding rows are masked out for every query row
                    visible = np.array(program_mask if program_mask.dtype == mx.bool_ else program_mask > -1e30)
                    assert not np.broadcast_to(visible, (1, 1, rows, program_k.shape[2]))[..., n:].any()
                assert_bits_equal(np.array(out), np.array(expected))
            else:
                assert sum(opt.declined.values()) == declined + 1
                assert_bits_equal(np.array(out), np.array(expected))  # mlx-lm's helper, as without optimize
    if name in ("KVCache", "QuantizedKVCache"):
        assert opt.routed == len(STEPS) and not opt.declined
    elif name in ("BatchKVCache", "BatchRotatingKVCache"):  # the streams' padding is in the model's mask: calls
        # without an array one declined
        assert opt.routed == 2 and opt.declined == {"no_array_mask": 2}
    elif name in ROUTED:  # the steps of several rows get a causal structure, which decompose-sdpa leaves fused
        assert opt.routed == 2 and opt.declined == {"fused_kernel_serves": 2}
    else:
        assert opt.routed == 0
        assert opt.declined == {"cache_unrouted": len(STEPS)} and name in opt.declines["cache_unrouted"].message


def program_arrays(routed):
    """``(keys, values, mask, structure)`` of a routed call's attention program."""
    if routed.program == "structured_attention":
        _, keys, values, _, _, structure = routed.args
        return keys, values, None, structure
    assert routed.program == "attention"
    _, keys, values, mask, _, _ = routed.args
    return keys, values, mask, None


def causal_plane(rows: int, keys: int) -> np.ndarray:
    """MLX's ``"causal"``: row ``i`` sees keys up to its position ``keys - rows + i``."""
    return np.arange(keys)[None] <= (keys - rows + np.arange(rows))[:, None]


def structure_plane(structure, rows: int, keys: int) -> np.ndarray:
    """The bool ``[rows, keys]`` of a program's ``(causal, left, right, chunk)``: sdpa's one visibility
    (docs/semantics.md §1.4)."""
    from attnpass.ir.dialects.attention import visible

    causal, *window = structure
    seen = visible(rows, keys, causal, tuple(window) if any(w is not None for w in window) else None)
    return np.ones((rows, keys), bool) if seen is None else seen


def test_the_array_mask_branch_pads_the_mask_over_the_buffer():
    """A KVCache buffer (256 rows) longer than its keys (7), given cut to 32 rows (buffer_rows): bool and additive
    masks, padded with False / -inf."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache

    from attnpass.backends.mlx import optimize
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe

    mx.random.seed(1)
    probe, kv = Probe(), KVCache()
    with optimize(probe, PIPELINE, strict=True, min_keys=0) as opt:
        probe(mx.random.normal((1, HEADS, 5, DIM)), *mx.random.normal((2, 1, KV_HEADS, 5, DIM)), kv, "causal")
        for kind in ("bool", "additive"):
            q = mx.random.normal((1, HEADS, 1, DIM))
            k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM))
            out = probe(q, k, v, kv, array_mask(kind, 1))
            keys, values, mask = probe.received
            assert kv.keys.shape[2] == 256 > kv.offset == keys.shape[2]
            expected = base.scaled_dot_product_attention(q, keys, values, cache=kv, scale=SCALE, mask=mask)
            assert_bits_equal(np.array(out), np.array(expected))
    assert opt.routed == 3 and not opt.declined
    masks = [e.signature.split(", ")[3] for e in opt.programs["attention"].specializations]
    assert masks == ["mask:bool[1,1,5,32]", "mask:bool[1,1,1,32]", "mask:f32[1,1,1,32]"]


def test_keys_not_fetched_in_this_call_or_a_changed_cache_are_declined():
    from mlx_lm.models.cache import KVCache

    from attnpass.backends.mlx import optimize
    from tests.backends.mlx_backend.lm_probe import Probe

    mx.random.seed(2)
    probe, kv = Probe(), KVCache()
    q = mx.random.normal((1, HEADS, 1, DIM))
    k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM))
    with optimize(probe, PIPELINE, strict=True, min_keys=0) as opt:
        probe(q, k, v, kv)
        keys, values, _ = probe.received
        probe(q, keys, values, kv, fetch=False)  # the very arrays, fetched in an earlier call
        probe(q, mx.array(keys), values, kv, fetch=False)  # equal values, another array
        probe(q, k, v, kv, between=lambda c: c.trim(1))  # fetched, then the cache trimmed before the attention
    assert opt.routed == 1
    assert opt.declined == {"not_fetched": 2, "cache_changed": 1}


def test_sinks_on_a_quantized_cache_are_declined_and_mlx_lms_helper_refuses_them():
    from mlx_lm.models.cache import QuantizedKVCache

    from attnpass.backends.mlx import optimize
    from tests.backends.mlx_backend.lm_probe import Probe

    mx.random.seed(3)
    probe, kv = Probe(), QuantizedKVCache(group_size=64, bits=8)
    q = mx.random.normal((1, HEADS, 1, DIM))
    k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM))
    with optimize(probe, PIPELINE, strict=True, min_keys=0) as opt:
        with pytest.raises(ValueError, match="does not support attention sinks"):
            probe(q, k, v, kv, sinks=mx.zeros((HEADS,)))
    assert opt.routed == 0 and opt.declined == {"quantized_sinks": 1}


def test_a_half_float_quantized_call_is_declined_on_cpu_at_any_depth_as_a_tie_with_mlx_lms_helper():
    """bfloat16 over a QuantizedKVCache is declined on CPU whatever its depth (QUANTIZED_TIE, decided on the
    rewritten graph, never lowered); float32, or a pipeline that widens the call to float32, is routed from MIN_KEYS'
    float32 minimum on (below it: SHORT_CONTEXT, the test below), and ``min_keys`` routes bfloat16 too. Routed or
    declined (not widened), the output is mlx-lm's helper's, bit for bit. The tie itself is measured:
    benchmarks/mlx_lm_decode.py."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import QuantizedKVCache

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.bounds import MIN_KEYS
    from attnpass.ir import DType
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe

    widened = "raise-attention,decompose-sdpa{device=cpu,widen_quantized=true},dce"

    def raw(a):  # the raw bits (bfloat16 as uint16)
        return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)

    def decode(keys: int, dtype=mx.bfloat16, pipeline: str = PIPELINE, min_keys: int | None = None):
        """One decode step over ``keys`` keys: the optimized probe's output, mlx-lm's helper's, the handle."""
        mx.random.seed(keys)
        probe, kv = Probe(), QuantizedKVCache(group_size=64, bits=8)
        kv.update_and_fetch(*mx.random.normal((2, 1, KV_HEADS, keys - 1, DIM)).astype(dtype))
        q = mx.random.normal((1, HEADS, 1, DIM)).astype(dtype)
        k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM)).astype(dtype)
        with optimize(probe, pipeline, strict=True, min_keys=min_keys) as opt:
            out = probe(mx.array(q), k, v, kv)  # a copy: mlx-lm's quantized helper scales its queries in place
        assert kv.offset == keys and opt.traces == 1
        received, values, _ = probe.received
        expected = base.scaled_dot_product_attention(q, received, values, cache=kv, scale=SCALE, mask=None)
        return out, expected, opt

    assert MIN_KEYS["quantized", DType.bfloat16] is None is MIN_KEYS["quantized", DType.float16]
    for keys in (100, 8100):
        out, expected, opt = decode(keys)
        assert_bits_equal(raw(out), raw(expected))  # mlx-lm's helper itself
        (entry,) = opt.programs["quantized_attention"].specializations
        assert opt.routed == 0 and opt.declined == {"quantized_tie": 1}
        assert entry.declined.reason == "quantized_tie" and entry.program is None and not entry.compiled
    float_min = MIN_KEYS["quantized", DType.float32]  # a cut of float_min rows: routed in float32
    for keys, dtype, min_keys in [(float_min, mx.float32, None), (100, mx.bfloat16, 0)]:
        out, expected, opt = decode(keys, dtype, min_keys=min_keys)
        assert_bits_equal(raw(out), raw(expected))  # the routed program: mlx-lm's bits
        assert opt.routed == 1 and not opt.declined
    _, _, opt = decode(float_min, pipeline=widened)  # float32 precision: not mlx-lm's bits (test_quantized_attention)
    assert opt.routed == 1 and not opt.declined


def test_a_short_context_call_is_declined_on_cpu_below_min_keys_and_routed_from_it():
    """A decode step whose cut has fewer rows than MIN_KEYS gives its dtype on CPU (KVCache float32 and bfloat16,
    a float32 QuantizedKVCache) is declined (SHORT_CONTEXT, decided on the rewritten graph: never lowered, counted,
    shown by explain()) and is mlx-lm's helper, bit for bit; one at the minimum is routed. ``min_keys`` moves the
    bound for every dtype (0: routed at any depth, as the exactness tests use it); it must be an int >= 0. The
    per-call costs behind MIN_KEYS are measured: benchmarks/mlx_lm_decode.py, docs/benchmarks.md."""
    import io

    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.bounds import MIN_KEYS
    from attnpass.backends.mlx.buffers import buffer_rows
    from attnpass.ir import DType
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe

    def raw(a):  # the raw bits (bfloat16 as uint16)
        return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)

    def decode(keys: int, dtype, quantized: bool, min_keys: int | None = None):
        """One decode step over ``keys`` keys: the optimized probe's output, mlx-lm's helper's, the handle, the
        signature's entry."""
        mx.random.seed(keys)
        probe = Probe()
        kv = QuantizedKVCache(group_size=64, bits=8) if quantized else KVCache()
        kv.update_and_fetch(*mx.random.normal((2, 1, KV_HEADS, keys - 1, DIM)).astype(dtype))
        q = mx.random.normal((1, HEADS, 1, DIM)).astype(dtype)
        k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM)).astype(dtype)
        with optimize(probe, PIPELINE, strict=True, min_keys=min_keys) as opt:
            out = probe(mx.array(q), k, v, kv)  # a copy: mlx-lm's quantized helper scales its queries in place
        received, values, _ = probe.received
        expected = base.scaled_dot_product_attention(q, received, values, cache=kv, scale=SCALE, mask=None)
        (entry,) = opt.programs["quantized_attention" if quantized else "attention"].specializations
        return out, expected, opt, entry

    for dtype, name, quantized in [(mx.float32, DType.float32, False), (mx.bfloat16, DType.bfloat16, False),
                                   (mx.float32, DType.float32, True)]:  # fmt: skip
        least = MIN_KEYS["quantized" if quantized else "float", name]
        below = max(o for o in range(1, least) if buffer_rows(o) < least)  # the last offset cut under the bound
        at = below + 1  # cut to least rows
        assert buffer_rows(below) < least == buffer_rows(at)
        out, expected, opt, entry = decode(below, dtype, quantized)
        assert_bits_equal(raw(out), raw(expected))  # mlx-lm's helper itself
        assert opt.routed == 0 and opt.declined == {"short_context": 1}
        assert entry.declined.reason == "short_context" and entry.program is None and not entry.compiled
        assert entry.declined.data == {"rows": buffer_rows(below), "min_keys": least, "dtype": name.value}
        text = io.StringIO()
        opt.explain(file=text, full=True)  # the whole report: each signature's decline message
        assert "declined: 1 x short_context" in text.getvalue()
        assert f"runs the original function: {entry.declined.message}" in text.getvalue()
        out, expected, opt, entry = decode(at, dtype, quantized)
        assert opt.routed == 1 and not opt.declined and entry.compiled
        if dtype == mx.float32:  # the routed program gives mlx-lm's bits in float32 (bfloat16: test_dropin_mlx_lm)
            assert_bits_equal(raw(out), raw(expected))
        _, _, opt, _ = decode(below, dtype, quantized, min_keys=0)
        assert opt.routed == 1 and not opt.declined
        _, _, opt, _ = decode(at, dtype, quantized, min_keys=least + 1)
        assert opt.routed == 0 and opt.declined == {"short_context": 1}
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"optimize: min_keys must be an int >= 0 .*got {bad!r}"):
            optimize(Probe(), min_keys=bad)


def test_a_call_under_its_kinds_known_bound_is_declined_before_its_arguments_are_built(monkeypatch):
    """Once the first signature of a dtype and cache kind was decided, a later call of that kind whose cut is
    shorter than the bound it found (MIN_KEYS) is declined (SHORT_CONTEXT) before the router builds its arguments
    or looks up a signature, whatever its own length (a declined decode step then costs about mlx-lm's helper
    alone); a call at the bound is still routed, and another dtype is decided by its own bound. In float32,
    declined or routed, the output is mlx-lm's helper's, bit for bit."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx import buffers
    from attnpass.backends.mlx.bounds import MIN_KEYS
    from attnpass.backends.mlx.buffers import buffer_rows
    from attnpass.ir import DType
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe

    least = MIN_KEYS["float", DType.float32]
    assert MIN_KEYS["float", DType.bfloat16] <= least - 32 == buffer_rows(least - 39, 1 << 20)
    built: list[tuple[int, str]] = []  # (offset, dtype) of every call whose arguments were built
    original = buffers.over_cut

    def building(call, length, grows):
        built.append((call.cache.offset, str(call.queries.dtype).rsplit(".", 1)[-1]))
        return original(call, length, grows)

    monkeypatch.setattr(buffers, "over_cut", building)
    probe = Probe()

    def cache(keys: int, dtype) -> KVCache:
        kv = KVCache()
        kv.update_and_fetch(*mx.random.normal((2, 1, KV_HEADS, keys, DIM)).astype(dtype))
        return kv

    def step(kv: KVCache, dtype) -> None:  # one decode step; in float32 its output is mlx-lm's helper's
        q, k, v = mx.random.normal((1, HEADS, 1, DIM)), *mx.random.normal((2, 1, KV_HEADS, 1, DIM))
        out = probe(q.astype(dtype), k.astype(dtype), v.astype(dtype), kv)
        received, values, _ = probe.received
        expected = base.scaled_dot_product_attention(
            q.astype(dtype), received, values, cache=kv, scale=SCALE, mask=None
        )
        if dtype == mx.float32:
            assert_bits_equal(np.array(out), np.array(expected))

    with optimize(probe, PIPELINE, strict=True) as opt:
        step(cache(19, mx.float32), mx.float32)  # a cut of 32 rows: the first float32 signature, declined
        assert built == [(20, "float32")] and opt.declined == {"short_context": 1}
        longer = cache(least - 40, mx.float32)
        for _ in range(8):  # offsets least - 39 ... least - 32: a cut of least - 32 rows, under the bound
            step(longer, mx.float32)
        assert opt.declined == {"short_context": 9} and opt.routed == 0 and len(built) == 1  # none built
        assert opt.traces == 1  # ... and no signature of their own
        step(cache(least - 40, mx.bfloat16), mx.bfloat16)  # the same cut in bfloat16: its own bound, routed
        assert opt.routed == 1 and built[-1] == (least - 39, "bfloat16")
        step(longer, mx.float32)  # offset least - 31: cut to least rows, routed
        assert opt.routed == 2 and built[-1] == (least - 31, "float32")
    assert opt.declined == {"short_context": 9}


def mla_model(family: str, seed: int = 0, **config):
    """A tiny random MLA model (1 layer, 4 heads, 4 experts, unless ``config`` says otherwise), float32; the test
    skips where the installed mlx-lm lacks ``family`` (0.31.3: kimi_k3, mistral4)."""
    import importlib

    from tests.mlx_lm_versions import needs_family

    needs_family(family)
    module = importlib.import_module(f"mlx_lm.models.{family}")
    base = {
        "model_type": family, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 0,
        "kv_lora_rank": 16, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
    }  # fmt: skip
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict({**base, **config}))  # from_dict keeps the family's fields
    mx.eval(model.parameters())
    return model


MISTRAL4 = {
    "rope_parameters": {"llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 256},
    "routed_scaling_factor": 1.0, "norm_topk_prob": True, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "topk_group": 1, "n_group": 1,
}  # fmt: skip
KIMI_LINEAR = {  # layer 1 linear attention (KDA), layer 2 MLA
    "num_hidden_layers": 2, "head_dim": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "model_max_length": 256,
    "linear_attn_config": {"kda_layers": [1], "num_heads": 2, "head_dim": 16}, "num_experts": 4,
    "num_experts_per_token": 2,
}  # fmt: skip
LONGCAT_FLASH = {
    "seed": 3, "attention_method": "MLA", "zero_expert_type": "identity", "ffn_hidden_size": 128, "moe_topk": 2,
    "expert_ffn_hidden_size": 32, "zero_expert_num": 1, "num_layers": 1, "max_position_embeddings": 256,
    "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True, "attention_bias": False,
}  # fmt: skip


@pytest.mark.parametrize(
    "family, config, prefill",
    [
        ("deepseek_v3", {}, "routed"),
        ("deepseek_v3", {"kv_lora_rank": 32, "qk_rope_head_dim": 8}, "routed"),  # was a [matmul] shape error
        ("glm4_moe_lite", {}, "routed"),
        ("mistral4", MISTRAL4, "mla_not_projections"),  # its keys concatenate the rope keys to the projection
        ("kimi_linear", KIMI_LINEAR, "routed"),
        ("longcat_flash", LONGCAT_FLASH, "routed"),
        ("deepseek_v32", {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 4}, "routed"),
    ],
)
def test_mla_models_decode_exactly_as_without_optimize(family, config, prefill):
    from mlx_lm.generate import generate_step

    from attnpass.backends.mlx import optimize

    def greedy(model):
        steps = list(generate_step(mx.array([5, 9, 1, 7]), model, max_tokens=8))
        return [t for t, _ in steps], np.stack([np.array(p) for _, p in steps])

    model = mla_model(family, **config)
    tokens, logprobs = greedy(model)
    with optimize(model, strict=True, min_keys=0) as opt:
        optimized_tokens, optimized_logprobs = greedy(model)
    assert optimized_tokens == tokens and len(set(tokens)) >= 3
    # one attention: the 3-row prefill only fills the cache (its output reaches no logits), and every one-row
    # step is declined (mlx-lm attends in the latent form already): the log-probabilities are mlx-lm's, bit for
    # bit. longcat_flash's second attention caches what the first one's routed prefill computed: within the bound
    layers = 2 if family == "longcat_flash" else 1  # longcat_flash: two attentions per layer
    if layers == 1 or prefill != "routed":
        assert_bits_equal(optimized_logprobs, logprobs)
    else:
        assert np.abs(optimized_logprobs - logprobs).max() <= 1e-5 * np.abs(logprobs).max()  # test_mla.LOGIT_BOUND
    # 10 calls: the 3-row prefill (the MLA program, tests/backends/mlx_backend/test_mla.py), then 9 one-row steps
    # (generate_step computes a token ahead of the one it yields)
    declined = {"mla_absorbed": 9 * layers} | ({} if prefill == "routed" else {prefill: layers})
    assert opt.routed == (layers if prefill == "routed" else 0) and opt.declined == declined


def test_optimize_refuses_what_is_not_an_mlx_model():
    from attnpass.backends.mlx import optimize
    from attnpass.models import tiny_lm, tiny_tokenizer

    with pytest.raises(TypeError, match=r"expected an mlx-lm model \(an mlx.nn.Module .*\), got str 'not a model'"):
        optimize("not a model")
    with pytest.raises(TypeError, match=r"got NoneType None$"):
        optimize(None)
    loaded = (tiny_lm("llama", layers=1), tiny_tokenizer())  # what mlx_lm.load returns
    with pytest.raises(TypeError, match=r"got tuple .*mlx_lm.load returns \(model, tokenizer\): pass the model"):
        optimize(loaded)


def test_a_declined_signature_is_neither_lowered_nor_compiled_nor_warned_about():
    """``CompiledFunction(decline=...)``, what optimize's "fused_kernel_serves" decision uses: the original function runs."""
    import warnings

    from attnpass.backends.mlx.compiled import MLXFrontend
    from attnpass.backends.specialize import CompiledFunction
    from attnpass.passes import Decline

    def attention(q, k, v):
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25)

    seen = []

    def decline(result):
        seen.append(sorted(n.op for n in result.graph.nodes() if n.op != "input"))
        return Decline("fused_kernel_serves", "kept fused")

    fn = CompiledFunction(
        attention, MLXFrontend(), pipeline="raise-attention,dce", strict=True, max_signatures=4, name="test",
        decline=decline,
    )  # fmt: skip
    q, k, v = mx.random.normal((3, 1, 2, 3, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fn(q, k, v)
        assert_bits_equal(np.array(out), np.array(attention(q, k, v)))
        fn(q, k, v)
    (entry,) = fn.specializations
    assert seen == [["sdpa"]] and fn.traces == 1  # decided once, on the rewritten graph
    assert (
        entry.reason == "kept fused"
        and entry.declined.reason == "fused_kernel_serves"
        and entry.program is None
        and entry.call is None
        and not entry.compiled
    )
    assert "runs the original function: kept fused" in entry.explain()


def test_attend_outside_the_model_routes_only_inside_active():
    """A benchmark's pattern: fetch and attend inside ``opt.active()``; a fetch made outside proves nothing."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import KVCache

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.clients import MLX_LM_HELPER
    from tests.backends.mlx_backend.lm_probe import SCALE, Probe

    mx.random.seed(3)
    q = mx.random.normal((1, HEADS, 1, DIM))
    k, v = mx.random.normal((2, 1, KV_HEADS, 1, DIM))
    with optimize(Probe(), PIPELINE, strict=True, min_keys=0) as opt:
        outside = KVCache()
        keys, values = outside.update_and_fetch(k, v)
        with opt.active():
            opt.attend(MLX_LM_HELPER, q, keys, values, outside, SCALE, None)
            kv = KVCache()
            keys, values = kv.update_and_fetch(k, v)
            out = opt.attend(MLX_LM_HELPER, q, keys, values, kv, SCALE, None)
    assert opt.routed == 1 and opt.declined == {"not_fetched": 1}
    expected = base.scaled_dot_product_attention(q, keys, values, cache=kv, scale=SCALE, mask=None)
    assert_bits_equal(np.array(out), np.array(expected))


def test_a_buffer_is_cut_to_a_few_rows_past_its_offset():
    """buffer_rows: at least the offset, at most a buffer that cannot grow; the padding under 32 rows or under a
    quarter of the offset; 4 distinct cuts per doubling of the offset past 128 (one signature each; the policy's
    own tests: tests/backends/mlx_backend/test_trace_policy.py)."""
    from attnpass.backends.mlx.buffers import buffer_rows

    for offset in range(1, 70000, 7):
        length = -(-offset // 256) * 256 + 256 * (offset % 3)  # a 256-row buffer, sometimes grown further
        rows = buffer_rows(offset, length)
        assert offset <= rows <= length
        assert buffer_rows(offset) - offset < max(32, offset / 4)
    assert len({buffer_rows(o) for o in range(4097, 8193)}) == 4
    assert len({buffer_rows(o) for o in range(1, 2049)}) == 20
