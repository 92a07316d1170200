"""decompose-sdpa and the per-device default pipelines: strategy remarks, numerics against the fused call, counts."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.backends import assert_primitive_counts, run
from attnpass.backends.mlx import sdpa_route
from attnpass.ir import DType, TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, make_inputs, narrowed_inputs
from attnpass.passes import DecomposeSDPA, PassManager, QSAPoolCache, default_pipeline, format_pipeline, parse_pipeline
from attnpass.passes.analysis.devices import DEVICES
from attnpass.passes.rewrites.decompose_sdpa import TARGETS, _metal_vector_kernel
from tests.util import assert_bits_equal, assert_close, random_array, requires

SMALL = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=32, mask_rows=8, rotary_dim=8)


def attention(
    hq=12, hkv=2, s=1, t=40, d=16, dv=None, dtype="float32", mask=None, causal=None, sinks=None, softcap=None
):
    """A bare sdpa graph; ``mask`` is None, "bool", "additive" or "bool-per-head"; ``sinks`` the dtype of a sinks
    operand (None: none); ``softcap`` its logit soft-cap."""
    specs = [
        TensorSpec((2, hq, s, d), dtype),
        TensorSpec((2, hkv, t, d), dtype),
        TensorSpec((2, hkv, t, dv or d), dtype),
    ]
    if mask is not None:
        heads = hq if mask.endswith("per-head") else 1
        specs.append(TensorSpec((2, heads, s, t), "bool" if mask.startswith("bool") else dtype))
    if sinks is not None:
        specs.append(TensorSpec((hq,), sinks))

    def unmasked(q, k, v):
        return ops.sdpa(q, k, v, scale=0.3, causal=causal, logit_softcap=softcap)

    def masked(q, k, v, m):
        return ops.sdpa(q, k, v, mask=m, scale=0.3, causal=causal, logit_softcap=softcap)

    def sunk(q, k, v, sk):
        return ops.sdpa(q, k, v, sinks=sk, scale=0.3, causal=causal, logit_softcap=softcap)

    def masked_sunk(q, k, v, m, sk):
        return ops.sdpa(q, k, v, mask=m, sinks=sk, scale=0.3, causal=causal, logit_softcap=softcap)

    return trace(((unmasked, sunk), (masked, masked_sunk))[mask is not None][sinks is not None], *specs)


def arrays(graph, seed=0):
    rng = np.random.default_rng(seed)
    out = [random_array(rng, t.shape, t.dtype) for t in graph.input_types()]
    if len(out) == 4 and out[3].dtype == bool:
        out[3][..., -1] = True  # every row attends at least one key
    return out


@requires("mlx.core", "jax")
@pytest.mark.parametrize("variant", [None, "sinks", "softcap"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mask", [None, "bool", "additive", "bool-per-head"])
@pytest.mark.parametrize("s", [1, 5])
def test_decomposed_matches_the_fused_call_within_rounding(dtype, mask, s, variant):
    """The float32 form (no ``target``), sinks and a softcap written out, against the fused call on each target."""
    sinks, softcap = (dtype, None) if variant == "sinks" else (None, 2.0 if variant else None)
    g = attention(s=s, dtype=dtype, mask=mask, dv=24, sinks=sinks, softcap=softcap)
    result = DecomposeSDPA()(g)
    assert [(r.kind, r.node) for r in result.remarks] == [("applied", "sdpa")]
    assert (" written out" in result.remarks[0].message) == (variant is not None)
    assert "sdpa" not in {n.op for n in result.graph.nodes()}
    args = arrays(g, seed=s)
    reference = run(lower(g, "numpy"), *args)
    assert_close(run(lower(result.graph, "numpy"), *args), reference)
    for target in ("mlx", "jax"):
        fused, decomposed = run(lower(g, target), *args), run(lower(result.graph, target), *args)
        assert_close(decomposed, reference)
        assert_close(decomposed, fused, rtol=4e-2 if dtype == "bfloat16" else None)


@requires("mlx.core")
@settings(max_examples=40, deadline=None)
@given(
    hkv=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 3, 6]),
    s=st.integers(1, 8),
    t=st.integers(1, 300),
    d=st.sampled_from([16, 64, 80]),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    mask=st.sampled_from([None, "bool", "additive", "bool-per-head"]),
    seed=st.integers(0, 2**16),
)
def test_on_mlx_cpu_the_decomposition_is_the_fused_call_bit_for_bit(hkv, group, s, t, d, dtype, mask, seed):
    g = attention(hq=hkv * group, hkv=hkv, s=s, t=t, d=d, dtype=dtype, mask=mask)
    result = DecomposeSDPA(device="cpu", target="mlx")(g)
    (remark,) = result.remarks
    assert remark.kind == "applied" and f"in {dtype}: MLX's CPU fallback's own ops, bit for bit" in remark.message
    assert (DType.float32 in {n.type.dtype for n in result.graph.nodes()}) == (dtype == "float32")  # no cast
    args = arrays(g, seed=seed)
    assert_bits_equal(run(lower(result.graph, "mlx"), *args), run(lower(g, "mlx"), *args))


@requires("mlx.core")
@settings(max_examples=40, deadline=None)
@given(
    hkv=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 3, 6]),
    s=st.integers(1, 8),
    t=st.integers(1, 300),
    d=st.sampled_from([16, 64, 128]),
    dv=st.sampled_from([None, 64]),  # mimo_v2_flash: head dim 128 over value dim 64
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    half_sinks=st.booleans(),  # float32 queries with half-float sinks (MLX casts them to float32, exactly)
    mask=st.sampled_from([None, "bool", "additive", "bool-per-head"]),
    empty_row=st.booleans(),  # a bool mask's row without keys: it weighs only its sink, 0
    sink_scale=st.sampled_from([1.0, 16.0]),  # sinks beside the scores, or dominating them
    seed=st.integers(0, 2**16),
)
def test_on_mlx_cpu_the_decomposition_with_sinks_is_the_fused_call_bit_for_bit(
    hkv, group, s, t, d, dv, dtype, half_sinks, mask, empty_row, sink_scale, seed
):
    """Issue 44: MLX's fallback puts the sink column first and its CPU softmax sums a row in order, so the
    decomposition does too (appended last, the float32 probabilities moved by 1-4 steps)."""
    sinks = "bfloat16" if half_sinks and dtype == "float32" else dtype
    g = attention(hq=hkv * group, hkv=hkv, s=s, t=t, d=d, dv=dv, dtype=dtype, mask=mask, sinks=sinks)
    result = DecomposeSDPA(device="cpu", target="mlx")(g)
    (remark,) = result.remarks
    assert remark.kind == "applied"
    assert f"the sink column first, precise softmax, @ v, in {dtype}: MLX's CPU fallback's own ops, bit for bit" in (
        remark.message
    )
    assert (DType.float32 in {n.type.dtype for n in result.graph.nodes()}) == (dtype == "float32")  # no cast
    args = arrays(g, seed=seed)  # with sinks a bool mask's rows may be empty anyway
    args[-1] = (args[-1].astype(np.float32) * sink_scale).astype(args[-1].dtype)
    emptied = empty_row and mask in ("bool", "bool-per-head")
    if emptied:
        args[3][0, -1, s - 1] = False  # batch 0, the last query row: of every head ("bool"), of the last one
    got, fused = run(lower(result.graph, "mlx"), *args), run(lower(g, "mlx"), *args)
    assert_bits_equal(got, fused)
    if emptied:
        assert not fused[0, slice(None) if mask == "bool" else -1, s - 1].any()


@requires("mlx.core")
def test_a_softcap_or_a_mask_of_another_dtype_keeps_the_float32_form_on_mlx_cpu():
    q, kv = TensorSpec((1, 4, 2, 16), "float32"), TensorSpec((1, 2, 30, 16), "float32")
    foreign = trace(lambda q, k, v, m: ops.sdpa(q, k, v, mask=m), q, kv, kv, TensorSpec((1, 1, 2, 30), "bfloat16"))
    bf16 = TensorSpec((1, 4, 2, 16), "bfloat16"), TensorSpec((1, 2, 30, 16), "bfloat16")
    capped = trace(lambda q, k, v: ops.sdpa(q, k, v, logit_softcap=30.0), bf16[0], bf16[1], bf16[1])
    for graph in (foreign, capped):
        (remark,) = DecomposeSDPA(device="cpu", target="mlx")(graph).remarks
        assert remark.kind == "applied" and "in float32" in remark.message and "bit for bit" not in remark.message


@requires("mlx.core", "jax")
def test_the_folded_form_reads_k_once_per_kv_head_in_f32():
    g = attention(s=3, dtype="bfloat16", mask="bool")
    graph = DecomposeSDPA()(g).graph
    scores = graph.node("scores_t")
    assert scores.op == "matmul" and scores.inputs[0] == "k_f32"
    assert str(scores.type) == "f32[2,2,40,18]"  # [B, Hkv, T, G*S]: 6 query heads x 3 rows fold into one matmul
    assert str(graph.node(graph.outputs[0]).type) == "bf16[2,12,3,16]"
    args = arrays(g)
    assert_primitive_counts(lower(graph, "mlx"), {"Matmul": 2, "Softmax": 1}, *args)
    assert_primitive_counts(lower(graph, "jax"), {"dot_general": 2}, *args)


@requires("mlx.core")
@pytest.mark.parametrize(
    "device, graph, decomposed",
    [
        ("cpu", lambda: attention(), True),  # no fused CPU kernel
        ("gpu", lambda: attention(), False),  # the GPU targets' fused call
        ("tpu", lambda: attention(), False),  # XLA's own TPU attention
        ("metal", lambda: attention(d=64), False),  # q_len 1, q_len*gqa 6 <= 32, head dim 64: the vector kernel
        ("metal", lambda: attention(d=16), True),  # head dim 16: no vector kernel
        ("metal", lambda: attention(d=64, s=6), True),  # 6*6 > 32
        ("cpu", lambda: attention(causal="bottom_right"), False),  # causal: no [S, T] constant
        ("cpu", lambda: attention(s=9), False),  # q_len 9 > max_q_len
    ],
)
def test_each_device_decides_per_call_and_remarks_on_that_call(device, graph, decomposed):
    g = graph()
    result = DecomposeSDPA(device=device)(g)
    (r,) = [r for r in result.remarks if r.pass_name == "decompose-sdpa"]
    (sdpa,) = [n.name for n in g.nodes() if n.op == "sdpa"]
    assert (r.kind, r.node, r.loc) == ("applied" if decomposed else "declined", sdpa, g.node(sdpa).loc)
    assert result.changed == decomposed
    # what the backend runs: the fused call, or matmuls and a softmax without it
    program = lower(result.graph, "mlx")
    assert ("mx.fast.scaled_dot_product_attention" in program.source) != decomposed
    assert ("sdpa" in {n.op for n in result.graph.nodes()}) != decomposed
    if decomposed:
        assert_primitive_counts(program, {"Matmul": 2, "Softmax": 1}, *arrays(g))


@requires("mlx.core", "jax")
def test_no_cpu_target_has_a_fused_attention_kernel():
    """What the CPU remark states, read from each backend: its fused call runs as two matmuls and a softmax."""
    import jax
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.cpu or jax.default_backend() != "cpu":
        pytest.skip("a statement about the CPU targets")
    g = attention(mask="bool")
    args = arrays(g)
    assert_primitive_counts(lower(g, "mlx"), {"Matmul": 2, "Softmax": 1, "ScaledDotProductAttention": 0}, *args)
    counts = assert_primitive_counts(lower(g, "jax"), {"dot_general": 2, "exp": 1}, *args)
    assert not [name for name in counts if "attention" in name or "custom_call" in name], counts


BACKEND_NAMES = {"mlx": r"mlx|mx\.", "jax": r"jax|xla|cudnn"}
IMPLIED = {"metal": "mlx", "tpu": "jax"}  # the one target that runs on the device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("target", [None, *TARGETS])
def test_the_remark_names_no_backend_but_the_target_it_prepares_for(device, target):
    if target is not None and IMPLIED.get(device, target) != target:
        with pytest.raises(ValueError, match=f"device {device!r} with target {target!r}"):
            DecomposeSDPA(device=device, target=target)
        return
    own = target or IMPLIED.get(device)
    others = "|".join(pattern for name, pattern in BACKEND_NAMES.items() if name != own)
    for g in (attention(d=16), attention(d=64), attention(s=9)):  # decomposed or kept per device, prefill kept
        (r,) = DecomposeSDPA(device=device, target=target)(g).remarks
        assert not re.search(others, r.message, re.IGNORECASE), r.message


def test_the_metal_rule_agrees_with_the_route_model():
    for s, gqa, d, dv, t in itertools.product((1, 4, 8, 9), (1, 4, 12), (64, 80, 128, 192, 256), (128, 256), (4, 4096)):
        route = sdpa_route((1, 2 * gqa, s, d), (1, 2, t, d), dtype="float16", mask="array", v_head_dim=dv)
        fused = route.kernel in ("vector", "vector_2pass")
        if s <= 8 and (d, dv) != (192, 192):  # 192/192: the route model's default heuristic, no fused kernel either
            assert (_metal_vector_kernel(s, gqa, d, dv, t) is not None) == fused, (s, gqa, d, dv, t, route)


def test_options_and_pipeline_text():
    assert parse_pipeline("decompose-sdpa{device=metal,max_q_len=4}") == [DecomposeSDPA(device="metal", max_q_len=4)]
    for bad in ({"device": "npu"}, {"max_q_len": 0}, {"max_q_len": True}):
        with pytest.raises(ValueError, match="DecomposeSDPA"):
            DecomposeSDPA(**bad)
    assert (
        format_pipeline(default_pipeline("cpu"))
        == "mla-absorb{crossover_factor=0.85},qsa-pool-cache,qsa-gather{prefill_tile=16},dsa-gather{tile_bytes=8388608},"
        "block-sparse,decompose-sdpa,dce,narrow-inputs,dce"
    )
    assert format_pipeline(default_pipeline("metal")) == (
        "mla-absorb,qsa-pool-cache,qsa-gather{prefill_tile=16},dsa-gather{tile_bytes=33554432},head-chunk,"
        "decompose-sdpa{device=metal},dce,narrow-inputs,dce"
    )
    assert (
        format_pipeline(default_pipeline("gpu"))
        == "mla-absorb,qsa-pool-cache,qsa-gather{prefill_tile=64},dsa-gather{tile_bytes=268435456},"
        "decompose-sdpa{device=gpu},dce,narrow-inputs,dce"
    )
    assert (
        format_pipeline(default_pipeline("tpu"))
        == "mla-absorb,qsa-pool-cache,qsa-gather{prefill_tile=64},dsa-gather{tile_bytes=268435456},"
        "decompose-sdpa{device=tpu},dce,narrow-inputs,dce"
    )
    assert (
        format_pipeline(default_pipeline("cpu", keep_signature=True))
        == "mla-absorb{crossover_factor=0.85},qsa-gather{prefill_tile=16},dsa-gather{tile_bytes=8388608},block-sparse,"
        "decompose-sdpa,dce"
    )
    with pytest.raises(ValueError, match="device must be one of cpu, metal, gpu, tpu"):
        default_pipeline("npu")


@requires("mlx.core", "jax")
@pytest.mark.parametrize("device, rows", [("cpu", 1), ("cpu", 5), ("metal", 5), ("gpu", 5)])
def test_default_pipelines_rewrite_the_qsa_layer_and_agree_with_the_masked_step(device, rows):
    n_kv = 96
    masked = build_layer(SMALL, n_kv, batch=2, rows=rows)
    result = PassManager(default_pipeline(device)).run(masked)
    applied = {r.pass_name for r in result.applied()}
    assert {"qsa-pool-cache", "qsa-gather", "narrow-inputs"} <= applied
    assert ("decompose-sdpa" in applied) == (device != "gpu")  # metal: head dim 16 has no vector kernel
    graph = result.graph
    positions = np.stack([np.arange(90 - rows, 90), np.arange(60, 60 + rows)]).astype(np.int32)
    inputs = make_inputs(SMALL, n_kv, positions, seed=rows, hidden_fraction=0.1)
    want = run(lower(masked, "numpy"), **inputs)
    prefill = QSAPoolCache().prefill(masked)
    for target in ("numpy", "mlx", "jax"):
        state = dict(zip(prefill.outputs, [run(lower(prefill, target), **{n: inputs[n] for n in prefill.inputs})]))
        out, _cache = run(lower(graph, target), **narrowed_inputs(graph, {**inputs, **state}))
        assert_close(out, want)
    assert graph.node(graph.state_pairs()[0][0]).type.dtype is DType.float32
