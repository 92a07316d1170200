"""Dead-code elimination: dead nodes, dead inputs leaving the signature, remarks, idempotence."""

from __future__ import annotations

from attnpass.ir import Graph, TensorSpec, ops, parse_graph, trace
from attnpass.passes import DeadCodeElimination, PassManager
from tests.fuzz.families import Case
from tests.passes.claims import audit, fuzzed

DCE = DeadCodeElimination()


def model(a, mask, b, scratch, c):
    live = ops.exp(a) + b
    ops.relu(mask)  # the only reader of mask is dead
    ops.softmax(live)  # dead, reads live values
    return live * c


def make_graph() -> Graph:
    return trace(
        model,
        TensorSpec((2, 8)),
        TensorSpec((64, 128), "float16"),
        TensorSpec((2, 8)),
        TensorSpec((16,), "bfloat16", "resident"),
        TensorSpec((2, 8)),
    )


def test_removes_dead_nodes_and_unread_inputs_keeping_order():
    g = make_graph()
    text, fp = str(g), g.fingerprint()
    result = DCE(g)
    out = result.graph
    assert result.changed
    assert out.inputs == ("a", "b", "c")
    assert sorted(n.op for n in out.nodes()) == sorted(["input"] * 3 + ["exp", "add", "mul"])
    assert "relu" not in out and "softmax" not in out and "mask" not in out and "scratch" not in out
    assert out.outputs == g.outputs
    # every remaining value is live
    assert out.ancestors(out.outputs) == {n.name for n in out.nodes()}
    assert out.input_nbytes() == g.input_nbytes() - 64 * 128 * 2
    assert out.input_nbytes("resident") == 0
    out.verify()
    assert parse_graph(str(out)) == out
    assert str(g) == text and g.fingerprint() == fp  # input untouched


def test_remarks_per_input_and_summary():
    result = DCE(make_graph())
    applied = result.applied()
    assert result.declined() == []
    assert [r.node for r in applied] == ["mask", "scratch", None]
    assert all(r.pass_name == "dce" for r in applied)
    mask, scratch, summary = applied
    assert "leaves the signature" in mask.message
    assert f"{64 * 128 * 2} bytes per call" in mask.message and "streamed" in mask.message
    assert "32 bytes of device memory" in scratch.message and "resident" in scratch.message  # not sent per call
    assert summary.message == "removed 2 dead node(s): relu, softmax"


def test_running_twice_equals_once():
    once = DCE(make_graph())
    twice = DCE(once.graph)
    assert not twice.changed
    assert twice.graph == once.graph
    assert twice.graph.fingerprint() == once.graph.fingerprint()
    assert [(r.kind, r.reason) for r in twice.remarks] == [("declined", "no_candidates")]


def test_fixed_point_with_dce_converges_in_two_iterations():
    result = PassManager([DCE], fixed_point=True).run(make_graph())
    assert [r.kind for r in result.remarks] == ["applied", "applied", "applied", "declined"]


def test_nothing_dead_declines():
    def f(x, y):
        return ops.matmul(x, y)

    g = trace(f, TensorSpec((2, 3)), TensorSpec((3, 4)))
    result = DCE(g)
    assert not result.changed
    assert result.graph == g
    assert [(r.kind, r.node, r.reason) for r in result.remarks] == [("declined", None, "no_candidates")]


def test_output_that_is_directly_an_input():
    def f(x, unused, y):
        ops.exp(unused)
        return x, ops.relu(y), x

    g = trace(f, TensorSpec((4,)), TensorSpec((4,)), TensorSpec((3,)))
    result = DCE(g)
    out = result.graph
    assert out.inputs == ("x", "y")
    assert out.outputs == ("x", "relu", "x")
    assert [n.name for n in out.nodes()] == ["x", "y", "relu"]
    assert [r.node for r in result.applied()] == ["unused", None]
    assert result.applied()[1].message == "removed 1 dead node(s): exp"
    out.verify()


def test_only_outputs_are_inputs():
    def f(x, y):
        return y

    result = DCE(trace(f, TensorSpec((4,)), TensorSpec((4,))))
    assert result.graph.inputs == ("y",)
    assert result.graph.outputs == ("y",)
    assert len(result.graph) == 1
    assert [r.node for r in result.remarks] == ["x"]  # no internal-node summary when none died


def test_long_dead_list_is_truncated():
    def f(x):
        for _ in range(12):
            ops.exp(x)
        return ops.relu(x)

    g = trace(f, TensorSpec((4,)))
    result = DCE(g)
    [summary] = result.applied()
    assert summary.message.startswith("removed 12 dead node(s): exp, exp_1,")
    assert summary.message.endswith(", ... (+4 more)")
    assert summary.message.count("exp") == 8
    assert [n.op for n in result.graph.nodes()] == ["input", "relu"]


def test_dead_chain_removed_in_reverse_order():
    def f(x):
        d = ops.exp(x)
        d = ops.relu(d)
        d = ops.softmax(d)  # chain of dead readers
        return x + 1.0

    g = trace(f, TensorSpec((4,)))
    result = DCE(g)
    assert {n.op for n in result.graph.nodes()} == {"input", "constant", "add"}
    assert result.graph.fingerprint() == g.fingerprint()  # dead nodes never entered the fingerprint


def test_every_remark_states_what_the_signature_and_the_graph_lose():
    """Each input remark's bytes are that input's (shape x numpy itemsize), in its role's unit, and sum per role
    to what ``input_nbytes`` loses; the summary's count and names are the nodes that left (tests/passes/claims.py)."""
    counts = audit(DCE, fuzzed(("chain", "sdpa"), 200) + [Case("dce", make_graph())])
    assert counts["checked"] == counts["applied"] >= 150
