"""HeadChunkSDPA as a graph pass (no backend): golden IR, remarks, policy, masks, idempotence."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from attnpass.ir import Graph, TensorSpec, ops, parse_graph, trace
from attnpass.passes import HeadChunkSDPA, PassError, PassManager, head_chunk_plan
from attnpass.passes.rewrites import head_chunk as head_chunk_module
from attnpass.passes.rewrites.head_chunk import ENV_VAR
from tests.passes.claims import audit, fuzzed

ON = HeadChunkSDPA(enabled=True)


def verify_shaped(q_len: int, t: int = 128, hq: int = 24, hkv: int = 2, d: int = 256) -> Graph:
    """The issue's client graph: ops.sdpa(q, k, v, scale=1/16), q bf16[1,24,q_len,256], k/v bf16[1,2,T,256]."""

    def attention(q, k, v):
        return ops.sdpa(q, k, v, scale=1 / 16)

    kv = TensorSpec((1, hkv, t, d), "bf16")
    return trace(attention, TensorSpec((1, hq, q_len, d), "bf16"), kv, kv)


def sdpa_nodes(graph: Graph):
    return [n for n in graph.nodes() if n.op == "sdpa"]


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


GOLDEN_BEFORE = """\
graph attention(q:bf16[1,24,4,256], k:bf16[1,2,128,256], v:bf16[1,2,128,256]) {
  sdpa:bf16[1,24,4,256] = sdpa[scale=0.0625, causal='none'] q k v
  return sdpa
}"""

GOLDEN_AFTER = """\
graph attention(q:bf16[1,24,4,256], k:bf16[1,2,128,256], v:bf16[1,2,128,256]) {
  sdpa_k0:bf16[1,1,128,256] = slice[start=(0, 0, 0, 0), stop=(1, 1, 128, 256), step=(1, 1, 1, 1)] k
  sdpa_v0:bf16[1,1,128,256] = slice[start=(0, 0, 0, 0), stop=(1, 1, 128, 256), step=(1, 1, 1, 1)] v
  sdpa_q0:bf16[1,8,4,256] = slice[start=(0, 0, 0, 0), stop=(1, 8, 4, 256), step=(1, 1, 1, 1)] q
  sdpa_c0:bf16[1,8,4,256] = sdpa[scale=0.0625, causal='none'] sdpa_q0 sdpa_k0 sdpa_v0
  sdpa_q1:bf16[1,4,4,256] = slice[start=(0, 8, 0, 0), stop=(1, 12, 4, 256), step=(1, 1, 1, 1)] q
  sdpa_c1:bf16[1,4,4,256] = sdpa[scale=0.0625, causal='none'] sdpa_q1 sdpa_k0 sdpa_v0
  sdpa_k1:bf16[1,1,128,256] = slice[start=(0, 1, 0, 0), stop=(1, 2, 128, 256), step=(1, 1, 1, 1)] k
  sdpa_v1:bf16[1,1,128,256] = slice[start=(0, 1, 0, 0), stop=(1, 2, 128, 256), step=(1, 1, 1, 1)] v
  sdpa_q2:bf16[1,8,4,256] = slice[start=(0, 12, 0, 0), stop=(1, 20, 4, 256), step=(1, 1, 1, 1)] q
  sdpa_c2:bf16[1,8,4,256] = sdpa[scale=0.0625, causal='none'] sdpa_q2 sdpa_k1 sdpa_v1
  sdpa_q3:bf16[1,4,4,256] = slice[start=(0, 20, 0, 0), stop=(1, 24, 4, 256), step=(1, 1, 1, 1)] q
  sdpa_c3:bf16[1,4,4,256] = sdpa[scale=0.0625, causal='none'] sdpa_q3 sdpa_k1 sdpa_v1
  sdpa_heads:bf16[1,24,4,256] = concat[axis=1] sdpa_c0 sdpa_c1 sdpa_c2 sdpa_c3
  return sdpa_heads
}"""

GOLDEN_REMARK = (
    "q_len*gqa = 48 > 32 (q_len 4, gqa 12): 4 subcalls with heads_per_chunk 8 (8+4 per KV group, "
    "2 KV group(s)), one-head K/V slices, concat in head order; no mask"
)


def test_golden_ir_24q_2kv_q_len_4(clean_env):
    before = verify_shaped(4)
    assert str(before) == GOLDEN_BEFORE
    result = HeadChunkSDPA()(before)
    assert result.changed
    assert str(result.graph) == GOLDEN_AFTER
    assert parse_graph(GOLDEN_AFTER) == result.graph
    assert str(before) == GOLDEN_BEFORE  # the caller's graph is untouched
    assert [(r.kind, r.node, r.message) for r in result.remarks] == [("applied", "sdpa", GOLDEN_REMARK)]


def test_new_nodes_carry_the_source_location():
    before = verify_shaped(4)
    loc = before.node("sdpa").loc
    assert loc is not None and loc.function == "attention"
    after = ON(before).graph
    assert all(n.loc == loc for n in after.nodes() if n.op != "input")
    assert ON(before).remarks[0].loc == loc


@pytest.mark.parametrize("q_len", list(range(1, 41)))
def test_traced_client_graph_every_row_count(q_len):
    """Any q_len: rewritten exactly when the plan says so, into plan-many one-KV-head subcalls."""
    result = ON(verify_shaped(q_len, t=64))
    plan = head_chunk_plan(q_len, 24, 2)
    assert result.changed == (plan is not None)
    calls = sdpa_nodes(result.graph)
    if plan is None:
        assert len(calls) == 1 and result.graph == verify_shaped(q_len, t=64)
        return
    hpc, chunks = plan
    assert len(calls) == chunks
    for call in calls:
        q, k, v = (result.graph.node(i).type.shape for i in call.inputs)
        assert k == v == (1, 1, 64, 256)  # one KV head, never repeated to query heads
        assert q[1] <= hpc and q[2] * q[1] <= 32
        assert call.attrs["scale"] == 0.0625 and call.attrs["causal"] == "none"
    (concat,) = [n for n in result.graph.nodes() if n.op == "concat"]
    assert concat.inputs == tuple(c.name for c in calls) and result.graph.outputs == (concat.name,)
    # slices cover the query heads in order: group outer, chunk inner
    starts = [result.graph.node(c.inputs[0]).attrs["start"][1] for c in calls]
    assert starts == sorted(starts) and starts[0] == 0


def test_declined_remarks_carry_the_numbers():
    small = ON(verify_shaped(2))
    wide = ON(verify_shaped(40))
    assert not small.changed and not wide.changed
    assert [(r.kind, r.reason) for r in small.remarks + wide.remarks] == [
        ("declined", "fused_kernel_serves"),
        ("declined", "too_many_rows"),
    ]
    assert "q_len*gqa = 24 <= 32" in small.remarks[0].message and "gqa 12" in small.remarks[0].message
    assert "q_len 40 > 32" in wide.remarks[0].message


def test_ungrouped_attention_is_never_chunked():
    result = ON(verify_shaped(8, hq=16, hkv=16, d=64))
    assert not result.changed
    assert [r.reason for r in result.remarks] == ["fused_kernel_serves"]


def test_no_sdpa_nodes_declines_once():
    g = trace(lambda x: ops.exp(x), TensorSpec((2, 3)))
    result = ON(g)
    assert not result.changed and [(r.kind, r.node, r.reason) for r in result.remarks] == [
        ("declined", None, "no_candidates")
    ]


def test_running_twice_equals_once():
    once = ON(verify_shaped(6))
    twice = ON(once.graph)
    assert once.changed and not twice.changed
    assert twice.graph == once.graph
    # every subcall is itself ineligible: q_len * heads_per_chunk <= budget
    assert [r.kind for r in twice.remarks] == ["declined"] * 6
    assert all(r.reason == "fused_kernel_serves" for r in twice.remarks)
    fixed = PassManager([ON], fixed_point=True).run(verify_shaped(6))
    assert fixed.graph == once.graph and not [r for r in fixed.remarks if r.pass_name == "pass_manager"]


def test_budget_parameter():
    g = verify_shaped(4)
    assert not HeadChunkSDPA(enabled=True, budget=48)(g).changed  # 4*12 = 48 fits
    result = HeadChunkSDPA(enabled=True, budget=16)(g)
    assert len(sdpa_nodes(result.graph)) == 2 * 3  # 4 heads per chunk
    assert not HeadChunkSDPA(enabled=True, budget=16)(result.graph).changed


OFF_VALUES = ["false", "FALSE", "False", " off ", "OFF", "no", "No\n", "0", "\t0 "]
ON_VALUES = ["", "1", "true", "on", "yes", "offf", "disabled", "00", "none"]


@pytest.mark.parametrize("value", OFF_VALUES)
def test_env_off_values(monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, value)
    result = HeadChunkSDPA()(verify_shaped(4))
    assert not result.changed
    assert result.remarks[0].reason == "disabled"
    assert result.remarks[0].message == f"disabled by {ENV_VAR}={value.strip()}"  # it names the switch and value


@pytest.mark.parametrize("value", ON_VALUES)
def test_env_other_values_leave_it_on(monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, value)
    assert HeadChunkSDPA()(verify_shaped(4)).changed


def test_env_unset_is_on(clean_env):
    assert HeadChunkSDPA()(verify_shaped(4)).changed


def test_explicit_setting_wins_over_env(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "off")
    assert HeadChunkSDPA(enabled=True)(verify_shaped(4)).changed
    monkeypatch.setenv(ENV_VAR, "1")
    result = HeadChunkSDPA(enabled=False)(verify_shaped(4))
    assert not result.changed and result.remarks[0].reason == "disabled"


def test_policy_is_resolved_at_use_and_env_never_mutated(monkeypatch):
    p = HeadChunkSDPA()
    monkeypatch.setenv(ENV_VAR, "off")
    snapshot = dict(os.environ)
    assert not p(verify_shaped(4)).changed
    monkeypatch.setenv(ENV_VAR, "on")
    assert p(verify_shaped(4)).changed
    monkeypatch.setenv(ENV_VAR, "off")
    assert dict(os.environ) == snapshot


def test_first_engagement_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(head_chunk_module, "_FIRST_ENGAGEMENT", threading.Lock())
    caplog.set_level(logging.INFO, logger="attnpass.passes.rewrites.head_chunk")
    ON(verify_shaped(2))  # declined: no engagement
    assert caplog.records == []
    ON(verify_shaped(6))
    ON(verify_shaped(4))
    assert [r.getMessage() for r in caplog.records] == [
        "head-chunked SDPA engaged: q_len=6 heads_per_chunk=5 chunks=6 n_kv_heads=2"
    ]


def masked(mask_shape, mask_dtype="bf16", causal=None, batch=1) -> Graph:
    """24q/2kv, q_len 4, T 32, head dim 64, with a mask input."""

    def attention(q, k, v, mask):
        return ops.sdpa(q, k, v, scale=0.125, mask=mask, causal=causal)

    kv = TensorSpec((batch, 2, 32, 64), "bf16")
    return trace(attention, TensorSpec((batch, 24, 4, 64), "bf16"), kv, kv, TensorSpec(mask_shape, mask_dtype))


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((1, 1, 4, 32), "bool"),
        ((1, 1, 4, 32), "bf16"),
        ((4, 32), "bool"),
        ((32,), "bf16"),
        ((1, 4, 32), "bool"),
        ((), "bf16"),
    ],  # fmt: skip
    ids=["bool-head1", "additive-head1", "2d", "1d", "rank3-head1", "scalar"],
)
def test_broadcast_masks_pass_unchanged_to_every_subcall(shape, dtype):
    result = ON(masked(shape, dtype))
    calls = sdpa_nodes(result.graph)
    assert len(calls) == 4 and all(c.inputs[3] == "mask" for c in calls)
    assert "passes unchanged to every subcall" in result.remarks[0].message


@pytest.mark.parametrize(
    "shape, batch", [((1, 24, 4, 32), 1), ((24, 4, 32), 1), ((2, 24, 1, 32), 2)], ids=["rank4", "rank3", "batch2-rows1"]
)
def test_per_head_masks_are_sliced_per_chunk(shape, batch):
    result = ON(masked(shape, "bool", batch=batch))
    axis = len(shape) - 3
    calls = sdpa_nodes(result.graph)
    assert len(calls) == 4
    for call in calls:
        q_slice, m_slice = result.graph.node(call.inputs[0]), result.graph.node(call.inputs[3])
        assert m_slice.op == "slice" and m_slice.inputs == ("mask",)
        assert (m_slice.attrs["start"][axis], m_slice.attrs["stop"][axis]) == (
            q_slice.attrs["start"][1],
            q_slice.attrs["stop"][1],
        )
        assert m_slice.type.shape[:axis] + m_slice.type.shape[axis + 1 :] == shape[:axis] + shape[axis + 1 :]
    assert "mathematically equal extension" in result.remarks[0].message


@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
def test_causal_attribute_is_kept_on_each_subcall(causal):
    result = ON(masked((1, 1, 4, 32), "bool", causal=causal))
    assert [c.attrs["causal"] for c in sdpa_nodes(result.graph)] == [causal] * 4


def test_scale_none_is_kept():
    def attention(q, k, v):
        return ops.sdpa(q, k, v)

    kv = TensorSpec((1, 2, 16, 64), "f32")
    result = ON(trace(attention, TensorSpec((1, 24, 5, 64), "f32"), kv, kv))
    assert [c.attrs["scale"] for c in sdpa_nodes(result.graph)] == [None] * 4


def test_mqa_reads_k_and_v_without_slicing():
    result = ON(verify_shaped(4, hq=16, hkv=1, d=64))
    calls = sdpa_nodes(result.graph)
    assert len(calls) == 2 and all(c.inputs[1:] == ("k", "v") for c in calls)
    assert sorted(n.op for n in result.graph.nodes()).count("slice") == 2  # only the query slices


def test_several_calls_chained_and_declined_mixed():
    """Two eligible calls (the second reads the first's output as q) and one declined call."""

    def model(q, k, v, q2):
        a = ops.sdpa(q, k, v, scale=0.125)
        b = ops.sdpa(a, k, v, scale=0.125)
        c = ops.sdpa(q2, k, v, scale=0.125)
        return b, c

    kv = TensorSpec((1, 2, 16, 64), "f32")
    g = trace(model, TensorSpec((1, 24, 3, 64), "f32"), kv, kv, TensorSpec((1, 24, 2, 64), "f32"))
    result = ON(g)
    assert [(r.kind, r.node) for r in result.remarks] == [
        ("applied", "sdpa"), ("applied", "sdpa_1"), ("declined", "sdpa_2"),
    ]  # fmt: skip
    assert len(sdpa_nodes(result.graph)) == 4 + 4 + 1
    assert result.graph.outputs == ("sdpa_1_heads", "sdpa_2")
    second = [c for c in sdpa_nodes(result.graph) if c.name.startswith("sdpa_1_c")]
    assert {result.graph.node(c.inputs[0]).inputs[0] for c in second} == {"sdpa_heads"}
    assert not ON(result.graph).changed


def test_failure_leaves_the_callers_graph_untouched(monkeypatch):
    g = verify_shaped(4)
    text = str(g)
    calls = []
    original = Graph.add_node

    def flaky(self, op, *args, **kwargs):
        calls.append(op)
        if len(calls) == 5:
            raise RuntimeError("injected failure")
        return original(self, op, *args, **kwargs)

    monkeypatch.setattr(Graph, "add_node", flaky)
    with pytest.raises(PassError, match="head-chunk"):
        ON(g)
    assert str(g) == text


def test_pass_is_a_frozen_named_dataclass():
    assert HeadChunkSDPA.name == "head-chunk"
    assert HeadChunkSDPA() == HeadChunkSDPA(enabled=None, budget=32)
    with pytest.raises(AttributeError):
        ON.budget = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs", [{"budget": 0}, {"budget": -3}, {"budget": 2.5}, {"budget": True}, {"enabled": "off"}]
)
def test_invalid_options_are_rejected_with_the_valid_range(kwargs):
    with pytest.raises(ValueError, match="budget must be an int >= 1|enabled must be True, False or None"):
        HeadChunkSDPA(**kwargs)


@pytest.mark.parametrize("budget", [32, 16, 7])
def test_every_remark_states_the_subcalls_it_made(clean_env, budget):
    """The numbers of each remark are the call's (q_len, gqa, KV groups) and the rewrite's: that many subcalls, the
    largest with heads_per_chunk heads and q_len * heads <= budget, one-head K/V, the per-group sizes, concatenated in
    head order, the mask as stated; a declined call's q_len*gqa fits (tests/passes/claims.py)."""
    counts = audit(HeadChunkSDPA(budget=budget), fuzzed(("sdpa", "chain"), 150), anchor="sdpa")
    assert counts["applied"] >= 30 and counts["checked"] >= counts["applied"] + 20
