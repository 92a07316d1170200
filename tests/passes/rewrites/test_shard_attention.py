"""shard-attention on one device: what it annotates and rewrites, what it declines and why; values stay equal."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import Graph, TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.models import (
    EXAMPLES,
    QSAConfig,
    build_layer,
    build_model,
    gather_pipeline,
    make_inputs,
    narrowed_inputs,
    verify_step,
)
from attnpass.passes import PassManager, ShardAttention, parse_pipeline
from tests.sharded_cases import (
    HKV,
    HQ,
    B,
    T,
    claimed_bytes,
    rows_first,
    rows_first_repeated,
    swap_th,
    verify_graph,
    verify_inputs,
)
from tests.util import assert_close, random_array, target_params

HEADS = (None, "model", None, None)


def shard_result(graph: Graph, pipeline: str, mesh: dict[str, int]):
    graph.set_mesh(mesh)
    result = PassManager(parse_pipeline(pipeline)).run(graph)
    return result.graph, [r for r in result.remarks if r.pass_name == "shard-attention"]


def shard(graph: Graph, pipeline: str, mesh: dict[str, int]):
    graph, remarks = shard_result(graph, pipeline, mesh)
    return graph, [str(r) for r in remarks]


def declines(remarks) -> list[tuple[str | None, str]]:
    """(rule, reason) of each shard-attention decline."""
    return [(r.rule, r.reason) for r in remarks if r.kind == "declined"]


def test_a_head_chunked_attention_is_regrouped_over_all_kv_groups():
    graph, remarks = shard(verify_step(q_len=4, kv_len=256), "head-chunk,shard-attention{heads=model}", {"model": 2})
    assert remarks[0].startswith("[shard-attention] applied sdpa_heads (head-chunked): regrouped 4 head-chunk subcalls")
    assert (
        "KV heads over model: 2/2 = 1 KV head(s) per device with their 12 query head(s) (whole GQA groups)"
        in remarks[0]
    )
    calls = [n for n in graph.nodes() if n.op == "sdpa"]
    assert [graph.node(c.inputs[0]).type.shape[1] for c in calls] == [16, 8]  # chunks 8 and 4, both KV groups at once
    assert all(c.inputs[1:3] == ("k_cache", "v_cache") for c in calls)  # K/V whole: no one-head slices left
    assert all(4 * graph.node(c.inputs[0]).type.shape[1] // 2 <= 32 for c in calls)  # q_len * heads per KV head
    assert all(c.sharding == HEADS for c in calls)
    assert [graph.node(n).sharding for n in graph.inputs] == [HEADS, HEADS, HEADS, None]
    assert graph.node(graph.outputs[0]).sharding == HEADS


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
def test_regrouped_and_split_attention_computes_the_same_values(target):
    original = verify_step(q_len=4, kv_len=256)
    arrays = verify_inputs(original)
    expected = run(lower(original, "numpy"), **arrays)
    for pipeline in ("head-chunk,shard-attention{heads=model}", "head-chunk,shard-attention{heads=model,seq=keys}"):
        graph, _ = shard(verify_step(q_len=4, kv_len=256), pipeline, {"model": 2, "keys": 4})
        assert_close(run(lower(graph, target), **arrays), expected)


def test_a_plain_sdpa_is_annotated_in_place_and_a_second_run_changes_nothing():
    graph, remarks = shard(
        verify_graph(QSAConfig(n_q_heads=32, n_kv_heads=8)), "shard-attention{heads=model}", {"model": 8}
    )
    assert (
        "applied sdpa (sdpa): KV heads over model: 8/8 = 1 KV head(s) per device with their 4 query head(s)"
        in remarks[0]
    )
    assert graph.node("sdpa").sharding == HEADS and graph.node("mask").sharding is None
    again = PassManager(parse_pipeline("shard-attention{heads=model}")).run(graph)
    first = again.remarks[0]
    assert not again.changed and (first.kind, first.node, first.rule, first.reason) == (
        "declined",
        "sdpa",
        "sdpa",
        "already_done",
    )


def test_the_whole_model_is_annotated_through_its_residual_adds():
    model = build_model(4, q_len=4, n_kv=8192)
    graph = PassManager(parse_pipeline(EXAMPLES["qwen38-model"].pipeline)).run(model).graph
    sharded, remarks = shard(graph, "shard-attention{heads=model}", {"model": 2})
    assert sum("] applied " in r for r in remarks) == 3 + 1  # 3 head-chunked dense layers, 1 gathered layer
    assert "gathered QSA attention over 1 stream(s) x 4 row(s): each qsa_gather keeps streams and KV" in remarks[3]
    residual = [n for n in sharded.nodes() if n.op == "add" and n.type.shape == (1, 24, 4, 256)]
    assert len(residual) == 4 and all(n.sharding == HEADS for n in residual)
    gathers = [n for n in sharded.nodes() if n.op == "qsa_gather"]  # annotated as they are, no rewrite
    assert len(gathers) == 2 and all(n.sharding == HEADS for n in gathers)
    assert {n.inputs[0] for n in gathers} <= set(sharded.inputs)  # read straight from the (sharded) caches
    assert sharded.node(sharded.outputs[0]).sharding == HEADS
    assert all(sharded.node(n).sharding == HEADS for n in sharded.inputs if n.startswith(("k_cache", "v_cache")))
    assert all(sharded.node(n).sharding is None for n in sharded.inputs if n.startswith(("idx_", "rope_")))


@pytest.mark.parametrize(
    ("pipeline", "mesh", "reason"),
    [
        (
            "head-chunk,shard-attention{heads=model}",
            {"data": 1},
            ("head-chunked", "mesh_axis_missing"),
        ),
        (
            "head-chunk,shard-attention{heads=model}",
            {"model": 4},
            ("head-chunked", "not_divisible"),
        ),
        (
            "shard-attention{batch=data}",
            {"data": 2},
            ("sdpa", "not_divisible"),
        ),
        ("shard-attention{seq=model}", {"model": 3}, ("sdpa", "not_divisible")),
    ],
)
def test_preconditions_decline_by_reason(pipeline, mesh, reason):
    graph, remarks = shard_result(verify_step(q_len=4, kv_len=256), pipeline, mesh)
    assert declines(remarks) == [reason], remarks
    assert all(graph.node(n).sharding is None for n in graph.inputs)


def test_seq_and_batch_cannot_share_the_leading_dimension():
    graph = verify_graph(QSAConfig(), batch=2, kv_len=256)
    sharded, remarks = shard_result(graph, "shard-attention{seq=model,batch=data}", {"data": 2, "model": 4})
    assert declines(remarks)[0] == ("sdpa", "sharding_conflict")
    assert all(n.sharding is None for n in sharded.nodes()) and not any(n.op == "sdpa_lse" for n in sharded.nodes())


def test_a_qsa_gather_of_another_form_is_declined():
    from tests.passes.rewrites.test_split_kv import qsa_take_graph

    graph = qsa_take_graph()
    sharded, remarks = shard_result(graph, "shard-attention{heads=model}", {"model": 2})
    assert declines(remarks) == [("sdpa", "gather_form")], remarks
    assert all(n.sharding is None for n in sharded.nodes())


def test_the_gather_form_shards_the_streams():
    cfg = QSAConfig()
    masked = build_layer(cfg, 8192, batch=2, rows=2)
    graph = gather_pipeline().run(masked).graph
    sharded, remarks = shard(graph, "shard-attention{batch=data}", {"data": 2})
    assert len(remarks) >= 1 and "] applied " in remarks[0] and "streams over data: 2/2 = 1 per device" in remarks[0]
    assert [sharded.node(n).sharding for n in ("k_cache", "v_cache")] == [("data", None, None, None)] * 2
    gathers = [n for n in sharded.nodes() if n.op == "qsa_gather"]
    assert len(gathers) == 2 and all(n.sharding == ("data", None, None, None) for n in gathers)
    inputs = make_inputs(cfg, 8192, np.array([[5000, 5001], [7000, 7001]]), hidden_fraction=0.1)
    expected = run(lower(masked, "numpy"), **inputs)
    assert_close(run(lower(sharded, "numpy"), **narrowed_inputs(sharded, inputs)), expected)


def test_an_earlier_annotation_is_never_overwritten():
    graph = verify_step(q_len=4, kv_len=256)
    graph.set_mesh({"model": 2, "keys": 4})
    graph.set_sharding("k_cache", (None, None, "keys", None))
    chunked = PassManager(parse_pipeline("head-chunk")).run(graph).graph
    sharded, remarks = shard_result(chunked.copy(), "shard-attention{heads=model}", {"model": 2, "keys": 4})
    assert sharded == chunked  # declined: the same graph, every annotation as it was
    assert sharded.node("k_cache").sharding == (None, None, "keys", None)
    assert declines(remarks) == [("head-chunked", "sharding_conflict")] and not any(
        r.kind == "applied" for r in remarks
    )


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # a shard seeing no cell
def test_the_gathered_qsa_layer_keeps_the_indexer_unannotated():
    cfg = QSAConfig()
    graph = gather_pipeline().run(build_layer(cfg, 8192)).graph
    sharded, remarks = shard(graph, "shard-attention{heads=model,seq=keys}", {"model": 2, "keys": 4})
    assert "gathered form (qsa_gather): each shard gathers qsa_cells % 2048 from its own slice" in remarks[0]
    assert sharded.node("k_cache").sharding == (None, "model", "keys", None)
    assert all(sharded.node(n).sharding is None for n in ("idx_q", "idx_keys", "positions", "rope_cos"))
    inputs = make_inputs(cfg, 8192, np.array([[5000]]), hidden_fraction=0.1)
    expected = run(lower(build_layer(cfg, 8192), "numpy"), **inputs)
    assert_close(run(lower(sharded, "numpy"), **narrowed_inputs(sharded, inputs)), expected)


@pytest.mark.parametrize(
    ("options", "message"),
    [({}, "name at least one mesh axis"), ({"heads": "model", "seq": "model"}, "must be different mesh axes")],
)
def test_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        ShardAttention(**options)


ROWS = {"heads": (None, None, "m", None), "batch": ("m", None, None, None), "seq": (None, "m", None, None)}


@pytest.mark.parametrize("option", ROWS)
@pytest.mark.parametrize("fn", [rows_first, rows_first_repeated])
def test_rows_first_k_and_v_are_sharded_where_their_bytes_live(fn, option, rng):
    """K/V reach the sdpa through transposes (and a repeat_kv reshape/broadcast_to): the inputs carry the
    sharding, and the remark states their bytes per device from it."""
    specs = [TensorSpec((B, 4, HQ, 32)), TensorSpec((B, T, HKV, 32)), TensorSpec((B, T, HKV, 32))]
    original = trace(fn, *specs)
    graph, remarks = shard(original.copy(), f"shard-attention{{{option}=m}}", {"m": 4})
    assert graph.node("k").sharding == graph.node("v").sharding == ROWS[option]
    nbytes = graph.node("k").type.nbytes
    assert claimed_bytes(remarks[0]) == {"k": (nbytes // 4, nbytes), "v": (nbytes // 4, nbytes)}
    if fn is rows_first_repeated and option == "heads":  # the sdpa reads 16 KV heads, 4 of k's repeated 4x
        assert "KV heads over m: 16/4 = 4 KV head(s) per device" in remarks[0]
        assert f"repeated 4x from k's {HKV}: {HKV // 4} of them per device" in remarks[0]
    arrays = [random_array(rng, s.shape, s.dtype) for s in specs]
    assert_close(run(lower(graph, "numpy"), *arrays), run(lower(original, "numpy"), *arrays))


def test_a_kv_head_repeated_over_the_heads_axis_is_declined_with_the_broadcast():
    def mqa(q, k, v):  # one KV head broadcast to the 4 query heads
        def repeat(x):
            return ops.reshape(ops.broadcast_to(ops.reshape(x, (2, 1, 1, 64, 16)), (2, 1, 4, 64, 16)), (2, 4, 64, 16))

        return ops.sdpa(q, repeat(k), repeat(v))

    graph = trace(mqa, TensorSpec((2, 4, 3, 16)), TensorSpec((2, 1, 64, 16)), TensorSpec((2, 1, 64, 16)))
    sharded, remarks = shard_result(graph, "shard-attention{heads=m}", {"m": 2})
    (declined,) = [r for r in remarks if r.kind == "declined"]
    assert declined.reason == "sharding_blocked"
    assert "it repeats reshape [2, 1, 1, 64, 16] along dimension 2" in declined.message  # the value and the axis
    assert all(n.sharding is None for n in sharded.nodes())


def test_a_reshape_that_splits_the_sharded_dimension_is_declined_with_it():
    def folded(q, k, v):  # K/V arrive as [B*Hkv, T, D]: the KV heads are the inner part of the first dimension
        return ops.sdpa(q, ops.reshape(k, (2, 2, 64, 16)), ops.reshape(v, (2, 2, 64, 16)))

    graph = trace(folded, TensorSpec((2, 4, 3, 16)), TensorSpec((4, 64, 16)), TensorSpec((4, 64, 16)))
    sharded, remarks = shard_result(graph, "shard-attention{heads=m}", {"m": 2})
    (declined,) = [r for r in remarks if r.kind == "declined"]
    assert declined.reason == "sharding_blocked"
    assert all(n.sharding is None for n in sharded.nodes())


def test_k_and_v_computed_in_the_graph_are_annotated_there_and_no_input_bytes_are_claimed(rng):
    def projected(x, wk, wv, q):  # K/V projected from x inside the graph, rows-first
        def heads(w):
            return ops.transpose(ops.reshape(ops.matmul(x, w), (1, 64, 2, 16)), (0, 2, 1, 3))

        return ops.sdpa(q, heads(wk), heads(wv))

    specs = [TensorSpec((1, 64, 32)), TensorSpec((32, 32)), TensorSpec((32, 32)), TensorSpec((1, 4, 3, 16))]
    original = trace(projected, *specs)
    graph, remarks = shard(original.copy(), "shard-attention{heads=m}", {"m": 2})
    assert "K/V per device: matmul is computed (matmul), not a graph input: annotated (_, _, m)" in remarks[0]
    assert claimed_bytes(remarks[0]) == {}
    assert [n for n in graph.inputs if graph.node(n).sharding] == ["q"]
    assert graph.node("matmul").sharding == graph.node("matmul_1").sharding == (None, None, "m")
    arrays = [random_array(rng, s.shape, s.dtype) for s in specs]
    assert_close(run(lower(graph, "numpy"), *arrays), run(lower(original, "numpy"), *arrays))


def test_a_query_that_cannot_carry_the_sharding_back_is_annotated_where_its_chain_ends(rng):
    def shared_query(q, k, v):  # one query head broadcast to all 4: q's bytes are not what is split
        return ops.sdpa(ops.broadcast_to(q, (2, 4, 3, 16)), k, v)

    specs = [TensorSpec((2, 1, 3, 16)), TensorSpec((2, 2, 64, 16)), TensorSpec((2, 2, 64, 16))]
    original = trace(shared_query, *specs)
    graph, remarks = shard(original.copy(), "shard-attention{heads=m}", {"m": 2})
    assert "] applied " in remarks[0]
    assert graph.node("broadcast_to").sharding == (None, "m", None, None)
    assert graph.node("q").sharding is None
    assert graph.node("k").sharding == graph.node("v").sharding == (None, "m", None, None)
    arrays = [random_array(rng, s.shape, s.dtype) for s in specs]
    assert_close(run(lower(graph, "numpy"), *arrays), run(lower(original, "numpy"), *arrays))


@pytest.mark.parametrize(
    ("option", "expected"),
    [("heads", ("m", None, None, None)), ("batch", (None, None, "m", None)), ("seq", (None, "m", None, None))],
)
def test_a_transpose_that_is_not_its_own_inverse_maps_each_dimension_back(option, expected, rng):
    def stored(q, k, v):  # K/V stored [Hkv, T, B, D]; perm (2, 0, 1, 3) gives [B, Hkv, T, D]
        return ops.sdpa(q, ops.transpose(k, (2, 0, 1, 3)), ops.transpose(v, (2, 0, 1, 3)))

    specs = [TensorSpec((2, 4, 3, 16)), TensorSpec((2, 64, 2, 16)), TensorSpec((2, 64, 2, 16))]
    original = trace(stored, *specs)
    graph, remarks = shard(original.copy(), f"shard-attention{{{option}=m}}", {"m": 2})
    assert graph.node("k").sharding == graph.node("v").sharding == expected, remarks
    arrays = [random_array(rng, s.shape, s.dtype) for s in specs]
    assert_close(run(lower(graph, "numpy"), *arrays), run(lower(original, "numpy"), *arrays))


def test_a_rows_first_head_chunked_attention_is_sharded_on_its_inputs(rng):
    def verify(q, k, v, mask):  # 24 query / 2 KV heads, rows-first: head-chunk slices the transposes
        return swap_th(ops.sdpa(swap_th(q), swap_th(k), swap_th(v), mask=mask))

    specs = [TensorSpec((1, 4, 24, 64)), TensorSpec((1, 256, 2, 64)), TensorSpec((1, 256, 2, 64)),
             TensorSpec((1, 1, 4, 256), "bool")]  # fmt: skip
    original = trace(verify, *specs)
    graph, remarks = shard(original.copy(), "head-chunk,shard-attention{heads=model,seq=keys}", {"model": 2, "keys": 4})
    assert "regrouped 4 head-chunk subcalls" in remarks[0]
    assert graph.node("k").sharding == graph.node("v").sharding == (None, "keys", "model", None)
    nbytes = graph.node("k").type.nbytes
    assert claimed_bytes(remarks[0]) == {"k": (nbytes // 8, nbytes), "v": (nbytes // 8, nbytes)}
    arrays = [random_array(rng, s.shape, s.dtype) for s in specs]
    arrays[3][..., 0] = True
    assert_close(run(lower(graph, "numpy"), *arrays), run(lower(original, "numpy"), *arrays))
