"""apply_rules, the driver under the rule-based passes: visiting order, one remark per candidate and rule (with
the rule as a field), declines, hit counts, sweeps, and its guards."""

from __future__ import annotations

import pytest

from attnpass.ir import Graph, Node, TensorSpec, ops, trace
from attnpass.passes import ANY, Decline, Remarks, Rewriter, Rule, apply_rules


def chain() -> Graph:
    """x -> exp -> exp -> neg -> exp: three exp candidates, in this order."""

    def f(x):
        return ops.exp(-ops.exp(ops.exp(x)))

    return trace(f, TensorSpec((2, 3)))


def exps(graph: Graph) -> list[str]:
    return [n.name for n in graph.nodes() if n.op == "exp"]


def to_relu(rw: Rewriter, node: Node) -> None:
    rw.replace_matched(rw.op("relu", node.inputs, {}, hint=f"{node.name}_relu"))


def rule(name: str, match, op: str = "exp") -> Rule:
    return Rule(name, op, match, to_relu, lambda node: f"{node.name} -> relu")


def test_one_remark_per_candidate_in_graph_order_with_the_rule_as_a_field():
    graph, remarks = chain(), Remarks("p")
    first, second, third = exps(graph)
    hits = apply_rules(
        graph, [rule("r", lambda g, n: Decline("too_hot", "too hot") if n.name == second else n)], remarks
    )
    assert hits == {"r": 2}
    assert [(r.kind, r.node, r.rule, r.reason) for r in remarks.items] == [
        ("applied", first, "r", "applied"),
        ("declined", second, "r", "too_hot"),
        ("applied", third, "r", "applied"),
    ]
    assert [r.message for r in remarks.items] == [f"{first} -> relu", "too hot", f"{third} -> relu"]
    assert exps(graph) == [second]


def test_not_a_candidate_leaves_no_remark_and_no_candidates_is_one_decline():
    graph, remarks = chain(), Remarks("p")
    assert apply_rules(graph, [rule("r", lambda g, n: None)], remarks) == {}
    assert [(r.kind, r.node, r.rule, r.reason) for r in remarks.items] == [("declined", None, "r", "no_candidates")]
    graph = chain()
    before = graph.fingerprint()
    remarks = Remarks("p")
    apply_rules(graph, [rule("r", lambda g, n: None, op="sdpa")], remarks)
    assert [(r.reason, r.message) for r in remarks.items] == [("no_candidates", "no sdpa nodes")]
    assert graph.fingerprint() == before


def test_the_first_matching_rule_wins_and_several_rules_report_their_hits():
    graph, remarks = chain(), Remarks("p")
    first, second, third = exps(graph)
    declines_first = rule("a", lambda g, n: Decline("not_first", "not the first") if n.name == first else None)
    takes_all = rule("b", lambda g, n: n)
    hits = apply_rules(graph, [declines_first, takes_all], remarks)
    assert hits == {"b": 3}
    decisions = [(r.kind, r.node, r.rule) for r in remarks.items if r.kind != "analysis"]
    # rule a declined the first node, then rule b rewrote it: a decline on a node that is gone is not reported
    assert decisions == [("applied", first, "b"), ("applied", second, "b"), ("applied", third, "b")]
    (summary,) = [r for r in remarks.items if r.kind == "analysis"]
    assert (summary.reason, summary.node, summary.rule) == ("rule_hits", None, None)
    assert summary.message == "rule hits: a 0, b 3; 0 candidate(s) declined"


def test_hit_counts_count_rewrites_per_rule_and_the_declines_left():
    graph, remarks = chain(), Remarks("p")
    first, second, third = exps(graph)
    only_first = rule("a", lambda g, n: n if n.name == first else None)
    declines_second = rule("b", lambda g, n: Decline("busy", "busy") if n.name == second else n)
    hits = apply_rules(graph, [only_first, declines_second], remarks)
    assert hits == {"a": 1, "b": 1}
    assert [(r.kind, r.node, r.rule, r.reason) for r in remarks.items] == [
        ("applied", first, "a", "applied"),
        ("declined", second, "b", "busy"),
        ("applied", third, "b", "applied"),
        ("analysis", None, None, "rule_hits"),
    ]
    assert remarks.items[-1].message == "rule hits: a 1, b 1; 1 candidate(s) declined"


def test_a_decline_names_the_node_where_the_precondition_failed():
    graph, remarks = chain(), Remarks("p")
    first = exps(graph)[0]
    apply_rules(graph, [rule("r", lambda g, n: Decline("its_input", "its input is x", node=n.inputs[0]))], remarks)
    by_node = {r.node: r for r in remarks.items}
    assert by_node[first].reason == "its_input"
    assert by_node[first].message == f"its input is x [at {graph.node(first).inputs[0]}]"
    assert all(r.kind == "declined" for r in remarks.items)


def test_decline_all_declines_every_candidate_without_matching():
    graph, remarks = chain(), Remarks("p")
    before = graph.fingerprint()

    def never(g, n):
        raise AssertionError("decline_all must not match")

    assert apply_rules(graph, [rule("r", never)], remarks, decline_all="switched off") == {}
    assert [(r.kind, r.reason, r.message) for r in remarks.items] == [("declined", "disabled", "switched off")] * 3
    assert graph.fingerprint() == before


def test_sweeps_revisit_declines_and_keep_the_last_decision():
    def f(x):
        return ops.neg(ops.neg(ops.neg(x)))

    def match(g: Graph, n: Node):  # a neg read by a neg declines; once its reader is gone, it applies
        return Decline("read_by_neg", "read by a neg") if any(u.op == "neg" for u in g.users(n.name)) else n

    negs = Rule("r", "neg", match, to_relu, lambda n: "neg -> relu")
    graph, remarks = trace(f, TensorSpec((4,))), Remarks("p")
    first, second, third = [n.name for n in graph.nodes() if n.op == "neg"]
    assert apply_rules(graph, [negs], remarks) == {"r": 1}  # one sweep: only the last neg
    assert [(r.kind, r.node) for r in remarks.items] == [("declined", first), ("declined", second), ("applied", third)]
    graph, remarks = trace(f, TensorSpec((4,))), Remarks("p")
    assert apply_rules(graph, [negs], remarks, max_sweeps=3) == {"r": 3}
    assert sorted((r.kind, r.node, r.rule) for r in remarks.items) == [
        ("applied", n, "r") for n in (first, second, third)
    ]
    assert not [n for n in graph.nodes() if n.op == "neg"]


def test_a_rewrite_that_does_not_replace_the_anchor_is_an_error():
    graph = chain()
    lazy = Rule("lazy", "exp", lambda g, n: n, lambda rw, n: None, lambda n: "nothing")
    with pytest.raises(
        AssertionError, match=r"rule lazy \(test_apply_rules.py:\d+\) rewrote .* without replace_matched"
    ):
        apply_rules(graph, [lazy], Remarks("p"))


def test_any_anchors_every_node_but_the_inputs():
    graph, seen = chain(), []
    apply_rules(graph, [rule("r", lambda g, n: seen.append(n.op), op=ANY)], Remarks("p"))
    assert "input" not in seen and seen.count("exp") == 3 and "neg" in seen
