"""What each pass does with sdpa's sinks and logit soft-capping (issue 23): head-chunk slices the sinks per
chunk and keeps the cap; split-kv keeps the cap in every partial and its sdpa_lse and adds the sinks once, in
the combine; decompose-sdpa writes both out (each checked on every target against the unchanged call);
qsa-gather and shard-attention decline by name, leaving the call as it was."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.passes import DecomposeSDPA, HeadChunkSDPA, PassManager, QSAGather, SplitKV, parse_pipeline
from tests.util import assert_close, random_array, requires

F32 = DType.float32
B, HQ, HKV, S, T, D = 1, 8, 2, 4, 8, 8


def graph_and_inputs(*, sinks: bool, softcap: float | None, mask: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    xs = [random_array(rng, (B, HQ, S, D), F32, low=-3, high=3), random_array(rng, (B, HKV, T, D), F32, low=-3, high=3),
          random_array(rng, (B, HKV, T, D), F32)]  # fmt: skip
    if mask:
        m = rng.random((B, HQ, S, T)) < 0.7
        m[0, 3, 1] = False  # one row of head 3 without keys: 0 with sinks
        xs.append(m)
    if sinks:
        xs.append(random_array(rng, (HQ,), F32, low=-1, high=3))

    def call(q, k, v, rest):
        return ops.sdpa(q, k, v, mask=rest[0] if mask else None, sinks=rest[-1] if sinks else None,
                        logit_softcap=softcap)  # fmt: skip

    fn = {3: lambda q, k, v: call(q, k, v, ()), 4: lambda q, k, v, a: call(q, k, v, (a,)),
          5: lambda q, k, v, a, b: call(q, k, v, (a, b))}[len(xs)]  # fmt: skip
    graph = trace(fn, *[TensorSpec(x.shape, DType.from_numpy(x.dtype)) for x in xs], name="attention")
    return graph, xs


VARIANTS = [dict(sinks=True, softcap=None), dict(sinks=False, softcap=5.0), dict(sinks=True, softcap=5.0)]
IDS = ["sinks", "softcap", "both"]
TARGETS = ["numpy", pytest.param("mlx", marks=requires("mlx.core")), pytest.param("jax", marks=requires("jax"))]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "perheadmask"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_head_chunk_slices_the_sinks_per_chunk(variant, mask, target):
    graph, xs = graph_and_inputs(mask=mask, **variant)
    result = HeadChunkSDPA(budget=S, enabled=True)(graph)  # one query head per subcall
    calls = [n for n in result.graph.nodes() if n.op == "sdpa"]
    assert len(calls) == HQ and all(c.attrs == graph.node(graph.outputs[0]).attrs for c in calls)
    (applied,) = result.applied()
    assert ("sinks [Hq] sliced per chunk" in applied.message) == variant["sinks"]
    if variant["sinks"]:
        for h, c in enumerate(calls):  # subcall h reads sinks[h:h+1]
            sliced = result.graph.node(c.inputs[-1])
            assert sliced.op == "slice" and sliced.attrs["start"] == (h,) and sliced.attrs["stop"] == (h + 1,)
    expected = run(lower(graph, "numpy"), *xs)
    assert_close(run(lower(result.graph, target), *xs), expected)


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_the_other_passes_decline_naming_the_variant(variant):
    graph, _ = graph_and_inputs(mask=True, **variant)
    named = "sinks" if variant["sinks"] else "logit_softcap=5"
    result = QSAGather(enabled=True)(graph)
    assert not result.changed and result.graph == graph
    (remark,) = [r for r in result.declined() if r.node == graph.outputs[0]]
    assert remark.reason == "unsupported_variant" and named in remark.message, remark.message
    graph.set_mesh({"model": 2})
    result = PassManager(parse_pipeline("shard-attention{heads=model}")).run(graph)
    declined = [r for r in result.remarks if r.pass_name == "shard-attention" and r.kind == "declined"]
    assert [(r.node, r.rule, r.reason) for r in declined] == [(graph.outputs[0], "sdpa", "unsupported_variant")]
    assert named in declined[0].message
    assert not any(r.kind == "applied" for r in result.remarks if r.pass_name == "shard-attention")


def test_shard_attention_declines_a_head_chunked_group_with_sinks():
    graph, _ = graph_and_inputs(sinks=True, softcap=None)
    chunked = HeadChunkSDPA(budget=S, enabled=True)(graph).graph
    chunked.set_mesh({"model": 2})
    result = PassManager(parse_pipeline("shard-attention{heads=model}")).run(chunked)
    declined = [(r.rule, r.reason) for r in result.remarks if r.pass_name == "shard-attention" and r.kind == "declined"]
    assert declined == [("head-chunked", "unsupported_variant")], declined


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("causal", ["none", "bottom_right"])
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_split_kv_adds_the_sinks_once_and_caps_every_partial(variant, mask, causal, target):
    rng = np.random.default_rng(1)
    s = 10 if causal == "bottom_right" else S  # bottom-right with S > T: rows 0, 1 see no key
    xs = [random_array(rng, (B, HQ, s, D), F32, low=-3, high=3), random_array(rng, (B, HKV, T, D), F32, low=-3, high=3),
          random_array(rng, (B, HKV, T, D), F32)]  # fmt: skip
    if mask == "bool":
        m = rng.random((B, HQ, s, T)) < 0.6
        m[0, 3, 1] = False  # a row without keys: 0 with sinks, the mean of V without
        xs.append(m)
    elif mask == "additive":
        xs.append(random_array(rng, (s, T), F32))
    if variant["sinks"]:
        xs.append(random_array(rng, (HQ,), F32, low=-1, high=3))
    has_mask, sinks = mask is not None, variant["sinks"]

    def call(q, k, v, rest):
        return ops.sdpa(q, k, v, mask=rest[0] if has_mask else None, sinks=rest[-1] if sinks else None,
                        logit_softcap=variant["softcap"], causal=causal)  # fmt: skip

    fn = {3: lambda q, k, v: call(q, k, v, ()), 4: lambda q, k, v, a: call(q, k, v, (a,)),
          5: lambda q, k, v, a, b: call(q, k, v, (a, b))}[len(xs)]  # fmt: skip
    graph = trace(fn, *[TensorSpec(x.shape, DType.from_numpy(x.dtype)) for x in xs], name="attention")
    result = SplitKV(shards=2)(graph)
    (applied,) = result.applied()
    assert ("sinks added once" in applied.message) == sinks
    assert ("logit_softcap 5 kept by every partial" in applied.message) == (variant["softcap"] is not None)
    partials = [n for n in result.graph.nodes() if n.op in ("sdpa", "sdpa_lse")]
    assert len(partials) == 2 and all(n.attrs["logit_softcap"] == variant["softcap"] for n in partials)
    assert all(n.sinks is None for n in partials)  # the partials see no sink: the combine adds it once
    expected = run(lower(graph, "numpy"), *xs)
    got = run(lower(result.graph, target), *xs)
    assert_close(got, expected)
    if sinks and causal == "bottom_right":
        assert np.all(got[:, :, :2] == 0)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "perheadmask"])
@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_decompose_sdpa_writes_the_variants_out(variant, mask, target):
    graph, xs = graph_and_inputs(mask=mask, **variant)
    result = DecomposeSDPA(device="cpu", target="mlx")(graph)
    (applied,) = result.applied()
    named = "sinks" if variant["sinks"] else "logit_softcap=5"
    assert named in applied.message and "written out" in applied.message
    ops_after = {n.op for n in result.graph.nodes()}
    assert "sdpa" not in ops_after and ("tanh" in ops_after) == (variant["softcap"] is not None)
    assert ("concat" in ops_after) == variant["sinks"]
    assert_close(run(lower(result.graph, target), *xs), run(lower(graph, "numpy"), *xs))
