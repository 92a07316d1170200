"""Predicted Metal routing of MLX 0.32 SDPA calls (backends/mlx/metal_route.py), before and after head chunking."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.backends.mlx import Route, sdpa_route, sdpa_routes
from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.passes import HeadChunkSDPA
from tests.util import requires


def route(q, k, mask=None, **kw) -> Route:
    return sdpa_route(q, k, dtype=kw.pop("dtype", "bfloat16"), mask=mask, **kw)


def verify_program(q_len: int, t: int, chunk: bool, d: int = 256):
    """The MLX program of a 24q/2kv sdpa (lowering to mlx needs mlx: its tests carry requires("mlx.core"))."""

    def attention(q, k, v):
        return ops.sdpa(q, k, v, scale=1 / 16)

    kv = TensorSpec((1, 2, t, d), "bf16")
    graph = trace(attention, TensorSpec((1, 24, q_len, d), "bf16"), kv, kv)
    return lower(HeadChunkSDPA(enabled=chunk)(graph).graph, "mlx")


@requires("mlx.core")
@pytest.mark.parametrize("q_len", [3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("t, kernel", [(128, "vector"), (4097, "vector_2pass")])
def test_rows_3_to_8_go_from_one_fallback_to_all_vector_subcalls(q_len, t, kernel):
    before = sdpa_routes(verify_program(q_len, t, chunk=False))
    assert [r.kernel for _, r in before] == ["fallback"]
    assert f"q_len*gqa = {q_len * 12} > 32" in before[0][1].reason
    after = sdpa_routes(verify_program(q_len, t, chunk=True))
    assert len(after) > 1 and {r.kernel for _, r in after} == {kernel}
    assert all(name.startswith("sdpa_c") for name, _ in after)


@requires("mlx.core")
@pytest.mark.parametrize("q_len", [9, 12, 16, 24, 32])
def test_rows_9_to_32_stay_fallback_after_chunking(q_len):
    """Head dim 256 with more than 8 rows: the default heuristic prefers the unfused path either way."""
    for chunk in (False, True):
        routes = sdpa_routes(verify_program(q_len, 128, chunk=chunk))
        assert {r.kernel for _, r in routes} == {"fallback"}
        assert all("head dim 256" in r.reason for _, r in routes)
    assert len(sdpa_routes(verify_program(q_len, 128, chunk=True))) > 1


@requires("mlx.core")
@pytest.mark.parametrize("q_len", [1, 2])
def test_small_rows_already_take_the_vector_kernel(q_len):
    assert [r.kernel for _, r in sdpa_routes(verify_program(q_len, 128, chunk=True))] == ["vector"]


@requires("mlx.core")
@pytest.mark.parametrize("q", [(1, 24, 4, 256), (1, 8, 1, 64), (1, 32, 64, 128)])
def test_cpu_is_always_the_fallback(q):
    r = route(q, (1, 8, 4096, q[3]), device="cpu")
    assert r == Route("fallback", "CPU stream: MLX always runs the unfused fallback")
    program = verify_program(4, 64, chunk=True)
    assert {r.kernel for _, r in sdpa_routes(program, device="cpu")} == {"fallback"}


@pytest.mark.parametrize(
    "t, hq, hkv, arch, kernel",
    [
        (4095, 8, 1, "g", "vector"), (4096, 8, 1, "g", "vector_2pass"),  # GQA: two passes from 4096 keys
        (8192, 8, 8, "g", "vector"),  # no GQA, base GPU: always one pass
        (1023, 8, 8, "s", "vector"), (1024, 8, 8, "s", "vector_2pass"), (1024, 8, 8, "d", "vector_2pass"),
    ],
)  # fmt: skip
def test_two_pass_threshold(t, hq, hkv, arch, kernel):
    assert route((1, hq, 2, 128), (1, hkv, t, 128), arch=arch).kernel == kernel


@pytest.mark.parametrize(
    "q, k, kw, kernel",
    [
        ((1, 8, 4, 64), (1, 2, 64, 64), {}, "vector"),  # 4 * 4 = 16
        ((1, 8, 8, 96), (1, 2, 64, 96), {}, "vector"),  # 8 * 4 = 32: the budget is inclusive
        ((1, 8, 4, 72), (1, 2, 64, 72), {}, "fallback"),  # no vector kernel for 72
        ((1, 8, 4, 192), (1, 2, 64, 192), {}, "fallback"),  # 192/192: the heuristic prefers unfused
        ((1, 8, 4, 192), (1, 2, 64, 192), {"v_head_dim": 128}, "vector"),  # 192/128 has a vector kernel
        ((1, 8, 4, 512), (1, 2, 64, 512), {}, "fallback"),  # not modelled: later releases
        ((1, 4, 8, 64), (1, 4, 4, 64), {}, "fallback"),  # q_len > k_len
        ((1, 8, 16, 64), (1, 2, 64, 64), {}, "full"),
        ((1, 8, 16, 80), (1, 2, 64, 80), {"mask": "array"}, "full"),
        ((1, 8, 16, 128), (1, 2, 8, 128), {"mask": "causal"}, "fallback"),  # causal string needs q_len <= k_len
        ((1, 8, 16, 128), (1, 2, 8, 128), {"mask": "array"}, "full"),
        ((1, 8, 16, 192), (1, 2, 64, 192), {}, "fallback"),
        ((1, 8, 16, 64), (1, 2, 64, 64), {"v_head_dim": 32}, "fallback"),
        ((1, 8, 16, 64), (1, 2, 64, 64), {"dtype": "float32"}, "full"),
    ],
)  # fmt: skip
def test_kernel_families(q, k, kw, kernel):
    assert route(q, k, **kw).kernel == kernel


@requires("mlx.core")
def test_routes_follow_the_mlx_lowering_of_causal_masks():
    """Causal bottom-right with q_len <= k_len lowers to MLX's "causal" string; otherwise an explicit array."""

    def attention(q, k, v):
        return ops.sdpa(q, k, v, causal="bottom_right")

    def program(q_len, t):
        kv = TensorSpec((1, 2, t, 64), "f32")
        return lower(trace(attention, TensorSpec((1, 8, q_len, 64), "f32"), kv, kv), "mlx")

    assert '"causal"' in program(16, 32).source and sdpa_routes(program(16, 32))[0][1].kernel == "full"
    assert '"causal"' not in program(16, 8).source and sdpa_routes(program(16, 8))[0][1].kernel == "full"
    assert route((1, 8, 16, 64), (1, 2, 8, 64), mask="causal").kernel == "fallback"


@requires("mlx.core", "jax")
def test_invalid_arguments_and_targets():
    with pytest.raises(ValueError, match="not a float type"):
        route((1, 8, 4, 64), (1, 2, 64, 64), dtype="int32")
    with pytest.raises(ValueError, match="device"):
        route((1, 8, 4, 64), (1, 2, 64, 64), device="cuda")
    with pytest.raises(ValueError, match="mask"):
        route((1, 8, 4, 64), (1, 2, 64, 64), mask="sliding")
    with pytest.raises(ValueError, match="rank 4"):
        route((8, 4, 64), (1, 2, 64, 64))
    jax_program = lower(verify_program(4, 64, chunk=True).graph, "jax")
    with pytest.raises(ValueError, match=r"sdpa_routes\(\) needs a program lowered to 'mlx', got target 'jax'"):
        sdpa_routes(jax_program)


def test_route_is_a_frozen_record():
    r = route((1, 8, 2, 64), (1, 2, 64, 64))
    assert r.kernel == "vector" and "q_len*gqa = 8 <= 32" in r.reason
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.kernel = "full"  # type: ignore[misc]


@requires("mlx.core")
def test_a_soft_capped_sdpa_is_predicted_explicit_and_calls_no_fused_attention():
    """MLX's fused call has no soft-capping: the route says the program writes it out, and the program indeed
    never calls MLX's fused attention, while a plain sdpa of the same shapes does."""

    def program(cap):
        def attention(q, k, v):
            return ops.sdpa(q, k, v, scale=1 / 8, logit_softcap=cap)

        kv = TensorSpec((1, 2, 16, 64), "f32")
        return lower(trace(attention, TensorSpec((1, 8, 1, 64), "f32"), kv, kv), "mlx")

    capped, plain = program(50.0), program(None)
    ((_, route),) = sdpa_routes(capped)
    assert route.kernel == "explicit" and "logit_softcap" in route.reason
    assert sdpa_routes(plain)[0][1].kernel == "vector"
    fused = "mx.fast.scaled_dot_product_attention("
    assert fused not in capped.source and fused in plain.source


def _route_before_the_shared_gate(q_shape, k_shape, mask, dv, arch) -> Route:
    """sdpa_route's Metal branch as written before it read metal_vector_gate (issue 42), numbers and all."""
    _, hq, s, d = q_shape
    _, hkv, t, _ = k_shape
    if s > 8:
        if d != dv or d not in (64, 72, 80, 96, 128, 192, 256):
            return Route("fallback", f"q_len {s} > 8: the full kernel has no head dims D={d}, Dv={dv}")
        if mask == "causal" and s > t:
            return Route("fallback", f"q_len {s} > k_len {t}: the full kernel's causal mask needs q_len <= k_len")
        if d in (192, 256):
            return Route("fallback", f"q_len {s} > 8 with head dim {d}: the default heuristic prefers the unfused path")
        return Route("full", f"q_len {s} > 8, head dim {d}: full (steel) attention kernel")
    gqa = hq // hkv
    if not ((d == dv and d in (64, 96, 128, 192, 256)) or (d, dv) == (192, 128)):
        return Route("fallback", f"q_len {s} <= 8: the vector kernel has no head dims D={d}, Dv={dv}")
    if s > t:
        return Route("fallback", f"q_len {s} > k_len {t}: the vector kernel needs q_len <= k_len")
    if s * gqa > 32:
        return Route("fallback", f"q_len*gqa = {s * gqa} > 32 (q_len {s}, gqa {gqa}): no vector kernel")
    if d == dv == 192:
        return Route("fallback", f"head dim {d} with q_len <= 8: the default heuristic prefers the unfused path")
    if (arch in ("s", "d") and t >= 1024) or (hkv < hq and t >= 4096):
        return Route("vector_2pass", f"q_len*gqa = {s * gqa} <= 32, k_len {t}: two-pass vector kernel")
    return Route("vector", f"q_len*gqa = {s * gqa} <= 32, k_len {t}: vector kernel")


HEAD_DIMS = (32, 64, 72, 80, 96, 128, 192, 256, 512)


@settings(max_examples=300, deadline=None)
@given(
    s=st.integers(1, 40), gqa=st.sampled_from((1, 2, 3, 4, 6, 8, 12, 16, 33)), hkv=st.integers(1, 4),
    d=st.sampled_from(HEAD_DIMS), dv=st.sampled_from((None, *HEAD_DIMS)),
    t=st.one_of(st.integers(1, 48), st.sampled_from((1023, 1024, 4095, 4096, 8192))),
    mask=st.sampled_from((None, "causal", "array")), arch=st.sampled_from("gsd"),
)  # fmt: skip
def test_the_shared_vector_gate_predicts_every_route_and_reason_as_before(s, gqa, hkv, d, dv, t, mask, arch):
    q, k = (1, gqa * hkv, s, d), (1, hkv, t, d)
    expected = _route_before_the_shared_gate(q, k, mask, d if dv is None else dv, arch)
    assert route(q, k, mask=mask, v_head_dim=dv, arch=arch) == expected
