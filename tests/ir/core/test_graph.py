"""Graph, verifier, printer/parser, JSON and fingerprint tests (no backend needed).

Verifier tests corrupt a valid graph (``Graph.insert`` / ``replace_node``) and assert on the
message sections: the reason line, the ``at:`` line with the printed node, the ``context``
window, and a size bound.
"""

from __future__ import annotations

import builtins
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.ir import (
    AttnpassError,
    Graph,
    GraphFormatError,
    Node,
    OpDef,
    PrintSettings,
    SourceLoc,
    TensorType,
    VerifyError,
    format_graph,
    format_node,
    get_op,
    parse_graph,
    verify,
)


def t(shape, dtype="float32") -> TensorType:
    return TensorType(tuple(shape), dtype)


# ============================================================================ sample graphs


def attention_graph(scale=0.0625) -> Graph:
    g = Graph("attention")
    q = g.add_input("q", t((1, 24, 5, 256), "bfloat16"))
    k = g.add_input("k", t((1, 2, 64, 256), "bfloat16"), "resident")
    v = g.add_input("v", t((1, 2, 64, 256), "bfloat16"), "resident")
    g.set_outputs([g.add_node("sdpa", [q, k, v], {"scale": scale})])
    return g


def chain_graph(n: int) -> Graph:
    """x -> n000 -> n001 -> ... alternating exp/neg; names are zero-padded so none is a substring of another."""
    g = Graph("chain")
    prev = g.add_input("x", t((4, 8)))
    for i in range(n):
        prev = g.add_node("exp" if i % 2 == 0 else "neg", [prev], name=f"n{i:03d}")
    g.set_outputs([prev])
    return g


def rich_graph(nan=float("nan")) -> Graph:
    """Several dtypes, non-finite constants, resident inputs, an input returned as an output, multiple outputs."""
    g = Graph("rich")
    x = g.add_input("x", t((2, 3), "bfloat16"))
    m = g.add_input("m", t((2, 3), "bool"))
    idx = g.add_input("idx", t((4,), "int32"))
    h = g.add_input("h", t((3, 5), "float16"), "resident")
    values = (nan, math.inf, -math.inf, 0.5, -0.0, 1e-30)
    c = g.add_node("constant", [], {"value": values, "shape": (2, 3), "dtype": "float32"}, name="c")
    xf = g.add_node("cast", [x], {"dtype": "float32"}, name="xf")
    y = g.add_node("add", [xf, c], name="y")
    w = g.add_node("where", [m, y, c], name="w")
    s = g.add_node("sum", [w], {"axes": (1,), "keepdims": True}, name="s")
    tk = g.add_node("take", [h, idx], {"axis": 1}, name="tk")
    ci = g.add_node("constant", [], {"value": (1, 2, 3, 4), "shape": (4,), "dtype": "int32"}, name="ci")
    ii = g.add_node("add", [idx, ci], name="ii")
    cb = g.add_node("constant", [], {"value": (True,), "shape": (2, 3), "dtype": "bool"}, name="cb")
    sel = g.add_node("where", [cb, x, x], name="sel")
    sc = g.add_node("constant", [], {"value": (-math.inf,), "shape": (), "dtype": "bfloat16"}, name="sc")
    mx = g.add_node("maximum", [sel, sc], name="mx")
    g.set_outputs([s, tk, ii, mx, x])
    return g


def masked_sdpa_graph() -> Graph:
    g = Graph("masked")
    q = g.add_input("q", t((1, 4, 3, 8), "float16"))
    k = g.add_input("k", t((1, 2, 6, 8), "float16"), "resident")
    v = g.add_input("v", t((1, 2, 6, 8), "float16"), "resident")
    mask = g.add_input("mask", t((3, 6), "bool"))
    o = g.add_node("sdpa", {"q": q, "k": k, "v": v, "mask": mask}, {"causal": "bottom_right"})
    o2 = g.add_node("sdpa", [q, k, v], {"causal": "top_left", "scale": 0.125})
    scores = g.add_node("matmul", [k, g.add_node("transpose", [k], {"perm": (0, 1, 3, 2)})])  # [1,2,6,6]
    rows = g.add_node("slice", [scores], {"start": (0, 0, 0, 0), "stop": (1, 2, 6, 6), "step": (1, 1, 2, 1)})
    p = g.add_node("softmax", [rows], {"precise": True})
    r = g.add_node("reshape", [o], {"shape": (3, 32)})
    cat = g.add_node("concat", [o, o2], {"axis": 1})
    g.set_outputs([r, cat, p])
    return g


def scalar_graph() -> Graph:
    g = Graph("scalars")
    a = g.add_input("a", t(()))
    z = g.add_input("z", t((0, 3)))
    g.set_outputs([g.add_node("relu", [g.add_node("sub", [a, a])]), g.add_node("mul", [z, a])])
    return g


def imported_ops_graph() -> Graph:
    """The ops MLX imports added: rounding, argmax/argmin, conv1d, scan and remainder with every attribute."""
    g = Graph("imported_ops")
    x = g.add_input("x", t((2, 9, 4), "bfloat16"))
    w = g.add_input("w", t((6, 3, 2), "bfloat16"), "resident")
    conv = g.add_node("conv1d", [x, w], {"stride": 2, "padding": (1, 2), "dilation": 2, "groups": 2}, name="conv")
    r = g.add_node("round", [g.add_node("floor", [conv])], name="r")
    c = g.add_node("ceil", [x], name="c")
    hi = g.add_node("argmax", [r], {"axis": -1, "keepdims": True}, name="hi")
    lo = g.add_node("argmin", [c], {"axis": 1}, name="lo")
    scan = {"kind": "prod", "axis": 1, "reverse": True, "inclusive": False}
    cum = g.add_node("remainder", [g.add_node("scan", [c], scan, name="cum"), x], name="rem")
    g.set_outputs([hi, lo, cum])
    return g


SAMPLES = {
    "attention": attention_graph,
    "imported_ops": imported_ops_graph,
    "chain": lambda: chain_graph(12),
    "rich": rich_graph,
    "masked": masked_sdpa_graph,
    "scalars": scalar_graph,
}


@pytest.fixture(params=sorted(SAMPLES))
def sample(request) -> Graph:
    return SAMPLES[request.param]()


# ============================================================================ building and queries


def test_samples_verify(sample):
    assert sample.verify() is sample
    verify(sample)


def test_add_node_infers_types_and_names():
    g = attention_graph()
    assert g.node("sdpa").type == t((1, 24, 5, 256), "bfloat16")
    variants = {"logit_softcap": None, "window": None}
    assert g.node("sdpa").attrs == {"scale": 0.0625, "causal": "none", **variants}
    assert g.inputs == ("q", "k", "v") and g.outputs == ("sdpa",)
    assert g.add_node("sdpa", ["q", "k", "v"]) == "sdpa_1"
    assert g.add_node("sdpa", ["q", "k", "v"]) == "sdpa_2"
    assert [n.name for n in g.nodes()] == ["q", "k", "v", "sdpa", "sdpa_1", "sdpa_2"]
    assert "sdpa_1" in g and "nope" not in g and len(g) == 6


def test_add_node_errors():
    g = attention_graph()
    with pytest.raises(VerifyError, match=r"sdpa: operand 'kk' is not defined in graph attention"):
        g.add_node("sdpa", ["q", "kk", "v"])
    with pytest.raises(VerifyError, match=r"duplicate name 'q'"):
        g.add_node("exp", ["q"], name="q")
    with pytest.raises(VerifyError, match=r"duplicate name 'k'"):
        g.add_input("k", t((2,)))
    with pytest.raises(VerifyError, match="use Graph.add_input"):
        g.add_node("input", [], {"shape": (2,), "dtype": "float32"})
    with pytest.raises(AttnpassError, match=r"unknown op 'conv'"):
        g.add_node("conv", ["q"])
    with pytest.raises(GraphFormatError, match=r"invalid name 'x y'"):
        g.add_node("exp", ["q"], name="x y")
    with pytest.raises(GraphFormatError, match=r"invalid input name 'class'"):
        g.add_input("class", t((2,)))
    with pytest.raises(GraphFormatError, match=r"invalid graph name 'a-b'"):
        Graph("a-b")
    with pytest.raises(VerifyError, match=r"output 'ghost' is not defined"):
        g.set_outputs(["sdpa", "ghost"])
    assert len(g) == 4  # nothing was added by the failed calls


def test_nodes_are_immutable_values():
    g = attention_graph()
    n = g.node("sdpa")
    with pytest.raises(AttributeError):
        n.op = "exp"  # type: ignore[misc]
    with pytest.raises(TypeError):
        n.attrs["scale"] = 1.0  # type: ignore[index]
    n2 = n.replace(attrs={"scale": 0.125, "causal": "none"})
    assert n.attrs["scale"] == 0.0625 and n2.attrs["scale"] == 0.125 and n2 != n
    assert n.replace(loc=SourceLoc("f.py", 3)) == n  # locations are not part of identity


def test_users_and_ancestors():
    g = masked_sdpa_graph()
    assert [u.op for u in g.users("k")] == ["sdpa", "sdpa", "transpose", "matmul"]
    assert [u.name for u in g.users("mask")] == ["sdpa"]
    assert g.users("concat") == []
    assert [u.name for u in g.users("sdpa")] == ["reshape", "concat"]
    assert g.ancestors(["reshape"]) == {"reshape", "sdpa", "q", "k", "v", "mask"}
    assert g.descendants(["sdpa"]) == {"sdpa", "reshape", "concat"}
    names = [n.name for n in g.nodes()]
    for a in names:  # b reads a transitively exactly when a is one of b's ancestors
        assert g.descendants([a]) == {b for b in names if a in g.ancestors([b])}
    with pytest.raises(VerifyError, match="no value named 'ghost'"):
        g.users("ghost")
    with pytest.raises(VerifyError, match="no value named 'ghost'"):
        g.node("ghost")


def test_input_nbytes_by_role():
    g = attention_graph()
    assert g.input_nbytes() == g.input_nbytes("streamed") == 1 * 24 * 5 * 256 * 2
    assert g.input_nbytes("resident") == 2 * (1 * 2 * 64 * 256 * 2)
    assert g.input_role("k") == "resident" and g.input_role("q") == "streamed"
    kv = t((1, 2, 64, 256), "bfloat16")
    assert g.input_types() == [t((1, 24, 5, 256), "bfloat16"), kv, kv]
    with pytest.raises(ValueError, match="role must be one of"):
        g.input_nbytes("pinned")
    g2 = rich_graph()
    assert g2.input_nbytes("streamed") == 2 * 3 * 2 + 2 * 3 * 1 + 4 * 4
    assert g2.input_nbytes("resident") == 3 * 5 * 2


def test_set_inputs_reorders_signature():
    g = attention_graph()
    g.set_inputs(["k", "v", "q"])
    assert g.inputs == ("k", "v", "q")
    assert str(g).startswith("graph attention(k:bf16[1,2,64,256]{resident}, v:")
    with pytest.raises(VerifyError, match=r"signature \['k', 'q'\] must list each input node once"):
        g.set_inputs(["k", "q"])
    with pytest.raises(VerifyError, match="must list each input node once"):
        g.set_inputs(["k", "k", "q"])


# ============================================================================ mutation helpers


def test_replace_all_uses():
    g = chain_graph(4)  # x -> n000 exp -> n001 neg -> n002 exp -> n003 neg
    g.add_node("relu", ["n000"], name="alt")
    assert g.replace_all_uses("n001", "alt") == 1
    assert g.node("n002").inputs == ("alt",)
    assert g.replace_all_uses("n003", "alt") == 1  # the output use
    assert g.outputs == ("alt",)
    g.verify()
    g.remove_node("n003")
    g.remove_node("n002")
    g.remove_node("n001")
    assert [n.name for n in g] == ["x", "n000", "alt"]
    g.verify()


def test_replace_all_uses_counts_repeated_operands_and_skips_new():
    g = Graph("g")
    x = g.add_input("x", t((3,)))
    a = g.add_node("exp", [x], name="a")
    b = g.add_node("mul", [a, a], name="b")
    g.add_node("neg", [a], name="na")  # reads a itself: must not become a self-loop
    g.set_outputs([b, a])
    assert g.replace_all_uses("a", "na") == 3  # two operands of b and one output
    assert g.node("b").inputs == ("na", "na") and g.node("na").inputs == ("a",)
    assert g.outputs == ("b", "na")
    g.verify()


def test_replace_all_uses_type_mismatch():
    g = masked_sdpa_graph()
    message = "replace_all_uses: q : f16[1,4,3,8] and k : f16[1,2,6,8] differ in type"
    with pytest.raises(VerifyError, match=re.escape(message)):
        g.replace_all_uses("q", "k")
    g.verify()


def test_remove_node_errors():
    g = chain_graph(3)
    with pytest.raises(VerifyError, match=re.escape("remove_node: n000 is still used by ['n001']")):
        g.remove_node("n000")
    with pytest.raises(VerifyError, match="remove_node: n002 is still used by the graph outputs"):
        g.remove_node("n002")
    with pytest.raises(VerifyError, match="no value named 'ghost'"):
        g.remove_node("ghost")
    assert len(g) == 4


def test_remove_unused_input_leaves_signature():
    g = Graph("g")
    x = g.add_input("x", t((2,)))
    g.add_input("unused", t((3,)), "resident")
    g.set_outputs([g.add_node("exp", [x])])
    g.remove_node("unused")
    assert g.inputs == ("x",) and "unused" not in g and g.input_nbytes("resident") == 0
    g.verify()


def test_copy_is_independent():
    g = rich_graph()
    text, js, fp = str(g), g.to_json(), g.fingerprint()
    c = g.copy()
    assert c == g and c is not g and str(c) == text
    c.add_node("exp", ["y"], name="extra")
    c.replace_all_uses("mx", "x")
    c.remove_node("mx")
    c.remove_node("sc")
    c.set_inputs(["m", "x", "idx", "h"])
    c.set_outputs(["extra"])
    assert str(g) == text and g.to_json() == js and g.fingerprint() == fp
    assert "extra" not in g and "mx" in g and g.inputs == ("x", "m", "idx", "h")
    assert c != g
    g.verify()
    c.verify()


@pytest.mark.parametrize("edited", ["original", "copy"])
def test_copy_shares_edges_until_either_side_edits(edited):
    """Copies share the DAG until one of them changes an edge (copy on write): whichever side edits, the other
    keeps its users, reachability and order."""
    g = chain_graph(4)
    c = g.copy()
    assert c._dag is g._dag  # nothing copied yet
    text, users = str(g), [u.name for u in g.users("n001")]
    mine, other = (g, c) if edited == "original" else (c, g)
    mine.replace_node("n002", mine.node("n002").replace(inputs=("n000",)))
    mine.add_node("exp", ["n001"], name="extra")
    assert mine._dag is not other._dag
    assert str(other) == text and [u.name for u in other.users("n001")] == users == ["n002"]
    assert other.ancestors(["n002"]) == {"x", "n000", "n001", "n002"}
    assert [u.name for u in mine.users("n001")] == ["extra"] and mine.ancestors(["n002"]) == {"x", "n000", "n002"}
    for graph in (mine, other):  # networkx's views of either DAG (succ, pred, edges) agree with the operands
        edges = {(i, n.name) for n in graph.nodes() for i in n.inputs}
        assert set(graph._dag.edges) == edges == {(u, v) for v in graph._dag for u in graph._dag.predecessors(v)}
    other.verify()
    mine.verify()


# ============================================================================ verifier


def lines_of(exc: pytest.ExceptionInfo) -> list[str]:
    return str(exc.value).splitlines()


def assert_node_error(exc: pytest.ExceptionInfo, graph: Graph, node: Node, reason: str) -> list[str]:
    """Reason first, then ``at:`` with the node printed by the normal printer, then the context window."""
    lines = lines_of(exc)
    assert reason in lines[0]
    assert lines[1] == f"  at: {format_node(node)}"
    ctx = [i for i, ln in enumerate(lines) if ln.startswith("  context (nodes ")]
    assert len(ctx) == 1
    marked = [ln for ln in lines if ln.startswith("  >> ")]
    assert marked == [f"  >> {format_node(node)}"]
    return lines


def test_verifier_dangling_operand():
    g = chain_graph(6)
    bad = g.node("n003").replace(inputs=("ghost",))
    g.replace_node("n003", bad)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    lines = assert_node_error(exc, g, bad, "neg n003: operand 'ghost' is not defined (dangling value)")
    assert lines[1] == "  at: n003:f32[4,8] = neg ghost"


def test_verifier_cycle():
    g = chain_graph(5)
    g.replace_node("n001", g.node("n001").replace(inputs=("n003",)))
    with pytest.raises(VerifyError, match=r"graph chain: cycle through") as exc:
        g.verify()
    cycle = str(exc.value)
    assert all(name in cycle for name in ("n001", "n002", "n003"))
    assert "n000" not in cycle and "n004" not in cycle
    with pytest.raises(VerifyError, match="cycle"):
        g.nodes()


def test_verifier_wrong_annotated_type():
    g = chain_graph(6)
    bad = g.node("n002").replace(type=t((4, 9)))
    g.replace_node("n002", bad)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    assert_node_error(exc, g, bad, "exp n002: annotated type f32[4,9] but the shape rule gives f32[4,8]")


def test_verifier_wrong_annotated_dtype_of_input():
    g = attention_graph()
    bad = g.node("q").replace(type=t((1, 24, 5, 256), "float16"))
    g.replace_node("q", bad)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    assert_node_error(exc, g, bad, "input q: annotated type f16[1,24,5,256] but the shape rule gives bf16[1,24,5,256]")


def test_verifier_operand_change_breaks_typing():
    g = masked_sdpa_graph()
    node = g.node("sdpa")
    bad = node.replace(inputs=("q", "q", "v", "mask"))  # k := q: head counts 4 vs v's 2
    g.replace_node("sdpa", bad)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    reason = "sdpa sdpa: sdpa: k and v must agree on heads and length: k=f16[1,4,3,8] v=f16[1,2,6,8]"
    assert_node_error(exc, g, bad, reason)


@pytest.mark.parametrize(
    "name, attrs, reason",
    [
        (
            "n001",
            {"axis": -1},
            "softmax n001: attributes {'axis': -1} are not normalized ({'axis': -1, 'precise': False})",
        ),
        ("n002", {"perm": [1, 0]}, "transpose n002: attributes {'perm': [1, 0]} are not normalized ({'perm': (1, 0)})"),
        ("n003", {"axes": (0,), "keepdims": False, "extra": 1}, "sum n003: sum: unknown attribute(s) extra"),
        ("n004", {"dtype": "bf16"}, "cast n004: attributes {'dtype': 'bf16'} are not normalized"),
    ],
)
def test_verifier_non_normalized_attrs(name, attrs, reason):
    g = Graph("g")
    x = g.add_input("x", t((4, 8)))
    g.add_node("exp", [x], name="n000")
    g.add_node("softmax", ["n000"], name="n001")
    g.add_node("transpose", ["n001"], {"perm": (1, 0)}, name="n002")
    g.add_node("sum", ["n002"], {"axes": (0,)}, name="n003")
    g.add_node("cast", ["n003"], {"dtype": "bfloat16"}, name="n004")
    g.set_outputs(["n004"])
    g.verify()
    bad = g.node(name).replace(attrs=attrs)
    g.replace_node(name, bad)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    assert_node_error(exc, g, bad, reason)


def test_verifier_input_node_not_in_signature():
    g = attention_graph()
    stray = Node("extra", "input", (), get_op("input").normalize_attrs({"shape": (2,), "dtype": "float32"}), t((2,)))
    g.insert(stray)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    assert_node_error(exc, g, stray, "input node extra is not in the graph signature")


def test_verifier_unknown_op_and_arity():
    g = chain_graph(3)
    bad = Node("n001", "conv", ("n000",), {}, t((4, 8)))
    g.replace_node("n001", bad)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    assert_node_error(exc, g, bad, "conv n001: unknown op 'conv'")
    g = chain_graph(3)
    bad = g.node("n001").replace(inputs=("n000", "x"))
    g.replace_node("n001", bad)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    assert_node_error(exc, g, bad, "neg n001: neg: expected 1 operand(s) (x), got 2")


def test_verifier_invalid_value_name():
    g = chain_graph(2)
    g.insert(Node("bad name", "exp", ("x",), {}, t((4, 8))))
    with pytest.raises(VerifyError, match=r"invalid value name 'bad name'"):
        g.verify()


def test_verifier_no_outputs():
    g = Graph("empty")
    g.add_input("x", t((2,)))
    with pytest.raises(VerifyError, match=r"^graph empty: has no outputs$"):
        g.verify()


def test_verifier_undefined_output():
    g = chain_graph(2)
    g._outputs = ["n001", "ghost"]  # set_outputs refuses this; corrupt the field as a buggy pass might
    with pytest.raises(VerifyError, match=r"^graph chain: output 'ghost' is not defined$"):
        g.verify()


def test_verifier_signature_entry_not_an_input():
    g = chain_graph(2)
    g._inputs.append("n000")  # set_inputs refuses this
    with pytest.raises(VerifyError, match=r"signature entry 'n000' is not an input node"):
        g.verify()


def test_verifier_reports_source_location():
    g = chain_graph(3)
    bad = g.node("n001").replace(type=t((1,)), loc=SourceLoc("model.py", 42, "attend"))
    g.replace_node("n001", bad)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    lines = assert_node_error(exc, g, bad, "annotated type f32[1]")
    assert lines[2] == "  from: model.py:42 in attend"


def counting_shape_rules(monkeypatch) -> list[str]:
    """Record the op of every shape-rule run (``OpDef.result_type``) from now on."""
    runs: list[str] = []
    original = OpDef.result_type

    def counting(self, *args, **kwargs):
        runs.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OpDef, "result_type", counting)
    return runs


def test_verifier_rechecks_only_nodes_that_are_new_or_read_new_operands(monkeypatch):
    g = Graph("wide")
    for i in range(4):  # distinct shapes: no two nodes share an inference
        g.add_node("exp", [g.add_input(f"x{i}", t((i + 1, 8)))], name=f"e{i}")
    g.set_outputs([f"e{i}" for i in range(4)])
    runs = counting_shape_rules(monkeypatch)
    g.verify()
    assert runs == ["input"] * 4  # add_node ran the exp nodes' shape rule on these operands: accepted then
    runs.clear()
    g.verify()
    copy = g.copy()
    copy.verify()
    assert runs == []  # nothing changed: nothing re-inferred
    copy.replace_node("e1", copy.node("e1").replace())  # an equal node, but a new object: checked again
    copy.verify()
    assert runs == ["exp"]


def test_verifier_rechecks_a_reader_whose_operand_changed():
    g = chain_graph(4)
    g.verify()
    copy = g.copy()
    copy.retype_input("x", t((4, 9)))  # readers keep their type: n000 is now wrong though it is the same object
    with pytest.raises(VerifyError) as exc:
        copy.verify()
    assert_node_error(
        exc, copy, copy.node("n000"), "exp n000: annotated type f32[4,8] but the shape rule gives f32[4,9]"
    )
    g.verify()  # the original (and its memo) is untouched by the copy's edit
    copy.replace_node("n000", copy.node("n000").replace(inputs=("ghost",)))
    with pytest.raises(VerifyError, match="operand 'ghost' is not defined"):
        copy.verify()


def test_verifier_rechecks_sharding_against_a_new_mesh():
    g = Graph("sharded")
    g.set_mesh({"model": 2})
    x = g.add_input("x", t((4, 8)))
    g.set_sharding(x, ("model", None))
    g.set_outputs([g.add_node("exp", [x])])
    g.verify()
    copy = g.copy()
    copy._mesh = {"model": 3}  # set_mesh refuses this; corrupt the field as a buggy pass might
    with pytest.raises(VerifyError, match="dimension 0 of size 4 does not divide over mesh axis model of size 3"):
        copy.verify()


@pytest.mark.parametrize("where", [0, 100, 199])
def test_verifier_message_is_bounded_on_a_200_node_graph(where):
    g = chain_graph(200)
    name = f"n{where:03d}"
    bad = g.node(name).replace(type=t((4, 7)))
    g.replace_node(name, bad)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    lines = assert_node_error(exc, g, bad, f"{name}: annotated type f32[4,7] but the shape rule gives f32[4,8]")
    message = str(exc.value)
    pos = where + 1  # 'x' is node 0
    lo, hi = max(0, pos - 10), min(201, pos + 11)
    assert f"  context (nodes {lo}..{hi - 1} of 201):" in lines
    shown = [ln for ln in lines if ln.startswith(("  >> ", "     "))]
    assert len(shown) == hi - lo <= 21
    assert len(lines) <= 3 + 21 and len(message) < 2000
    for i in range(200):
        inside = lo <= i + 1 < hi
        assert (f"n{i:03d}:" in message) == inside, i


def test_verifier_window_uses_the_normal_printer():
    g = masked_sdpa_graph()
    bad = g.node("reshape").replace(type=t((3, 31), "float16"))
    g.replace_node("reshape", bad)
    with pytest.raises(VerifyError) as exc:
        g.verify()
    text = str(exc.value)
    body = format_graph(g).splitlines()[1:-2]  # node lines of the normal printer (inputs are in the header)
    for line in body:
        assert line.strip() in text


# ============================================================================ text form


ATTENTION_TEXT = """\
graph attention(q:bf16[1,24,5,256], k:bf16[1,2,64,256]{resident}, v:bf16[1,2,64,256]{resident}) {
  sdpa:bf16[1,24,5,256] = sdpa[scale=0.0625, causal='none'] q k v
  return sdpa
}"""

SMALL_TEXT = """\
graph small(x:f32[2,3], m:bool[2,3]) {
  c:f32[] = constant[value=(-inf,), shape=(), dtype='float32']
  w:f32[2,3] = where m x c
  s:f32[2,3] = softmax[axis=-1, precise=False] w
  tr:f32[3,2] = transpose[perm=(1, 0)] s
  k:f32[3,1] = sum[axes=(1,), keepdims=True] tr
  return tr, s, k
}"""


def small_graph() -> Graph:
    g = Graph("small")
    x = g.add_input("x", t((2, 3)))
    m = g.add_input("m", t((2, 3), "bool"))
    c = g.add_node("constant", [], {"value": (-math.inf,), "shape": (), "dtype": "float32"}, name="c")
    w = g.add_node("where", [m, x, c], name="w")
    s = g.add_node("softmax", [w], name="s")
    tr = g.add_node("transpose", [s], {"perm": (1, 0)}, name="tr")
    k = g.add_node("sum", [tr], {"axes": (1,), "keepdims": True}, name="k")
    g.set_outputs([tr, s, k])
    return g


def test_golden_text():
    assert str(attention_graph()) == ATTENTION_TEXT
    assert format_graph(small_graph()) == SMALL_TEXT
    assert parse_graph(SMALL_TEXT) == small_graph()
    assert parse_graph(ATTENTION_TEXT) == attention_graph()


def test_print_settings_show_locs():
    g = small_graph()
    g.replace_node("w", g.node("w").replace(loc=SourceLoc("model.py", 7, "f")))
    text = format_graph(g, PrintSettings(show_locs=True))
    assert "  w:f32[2,3] = where m x c  # model.py:7 in f" in text.splitlines()
    assert "#" not in str(g)
    assert parse_graph(text) == g  # comments are ignored by the parser
    assert format_graph(g, PrintSettings(indent="    ")).splitlines()[1] == "    " + SMALL_TEXT.splitlines()[1].strip()


def test_text_round_trip(sample):
    text = str(sample)
    back = parse_graph(text)
    assert back == sample
    assert str(back) == text
    assert back.fingerprint() == sample.fingerprint()


def test_text_round_trip_keeps_non_finite_constants():
    g = rich_graph()
    back = parse_graph(str(g))
    value = back.node("c").attrs["value"]
    assert math.isnan(value[0]) and value[1] == math.inf and value[2] == -math.inf
    assert math.copysign(1.0, value[4]) == -1.0  # -0.0 survives
    assert back.node("sc").attrs["value"] == (-math.inf,)
    assert back.node("cb").attrs["value"] == (True,) and type(back.node("cb").attrs["value"][0]) is bool


@pytest.mark.parametrize("nan", [float("nan"), math.nan, -float("nan"), float("inf") - float("inf")])
def test_round_trips_with_any_nan_object(nan):
    g = rich_graph(nan)
    assert parse_graph(str(g)) == g
    assert Graph.from_json(g.to_json()) == g
    assert rich_graph(nan) == rich_graph(float("nan"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "malformed graph text"),
        ("graph g(x:f32[2]) {\n  return x\n", "malformed graph text"),
        ("graf g(x:f32[2]) {\n  y:f32[2] = exp x\n  return y\n}", "malformed graph header"),
        ("graph g(x:f32[2) {\n  y:f32[2] = exp x\n  return y\n}", "malformed graph input 'x:f32[2'"),
        ("graph g(x:f64[2]) {\n  y:f32[2] = exp x\n  return y\n}", "unsupported dtype 'f64'"),
        ("graph g(x:f32[2]{pinned}) {\n  y:f32[2] = exp x\n  return y\n}", "attribute role"),
        ("graph g(x:f32[2]) {\n  y:f32[2] exp x\n  return y\n}", "line 2: malformed node 'y:f32[2] exp x'"),
        ("graph g(x:f32[2]) {\n  y:f32[2] = conv x\n  return y\n}", "unknown op 'conv'"),
        ("graph g(x:f32[2]) {\n  y:f32[2] = softmax[axis=] x\n  return y\n}", "malformed attributes [axis=]"),
        ("graph g(x:f32[2]) {\n  y:f32[2] = softmax[-'a'] x\n  return y\n}", "malformed attributes"),
        ("graph g(x:f32[2]) {\n  y:f32[2] = softmax[axis=-'a'] x\n  return y\n}", "malformed attributes"),
        ("graph g(x:f32[2]) {\n  y:f32[2] = softmax[**{}] x\n  return y\n}", "malformed attributes"),
        (
            "graph g(x:f32[2]) {\n  y:f32[2] = softmax[axis=0.5] x\n  return y\n}",
            "softmax y: attribute axis: expected an int, got 0.5",
        ),
        (
            "graph g(x:f32[2]) {\n  y:f32[3] = exp x\n  return y\n}",
            "annotated type f32[3] but the shape rule gives f32[2]",
        ),
        ("graph g(x:f32[2]) {\n  y:f32[2] = exp ghost\n  return y\n}", "operand 'ghost' is not defined"),
        ("graph g(x:f32[2]) {\n  y:f32[2] = exp x\n  return ghost\n}", "output 'ghost' is not defined"),
        ("graph g(x:f32[2]) {\n  class:f32[2] = exp x\n  return class\n}", "invalid value name 'class'"),
        ("graph g(x:f32[2]) {\n  1y:f32[2] = exp x\n  return 1y\n}", "invalid value name '1y'"),
        ("graph class(x:f32[2]) {\n  y:f32[2] = exp x\n  return y\n}", "invalid graph name 'class'"),
        ("graph g(x:f32[2], x:f32[2]) {\n  y:f32[2] = exp x\n  return y\n}", "duplicate name 'x'"),
    ],
)
def test_malformed_text(text, message):
    with pytest.raises(GraphFormatError, match=re.escape(message)):
        parse_graph(text)


def test_parsing_text_never_evaluates(tmp_path):
    sentinel = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {sentinel}')"
    texts = [
        f"graph g(x:f32[2]) {{\n  y:f32[2] = softmax[axis={payload}] x\n  return y\n}}",
        f"graph g(x:f32[2]) {{\n  y:f32[2] = constant[value=({payload},), shape=(2,), dtype='float32']\n  return y\n}}",
        f"graph g(x:f32[2]) {{\n  y:f32[2] = exp x\n  return {payload}\n}}",
    ]
    for text in texts:
        with pytest.raises(GraphFormatError):
            parse_graph(text)
    assert not sentinel.exists()


# ============================================================================ JSON form


def test_json_round_trip(sample):
    js = sample.to_json()
    back = Graph.from_json(js)
    assert back == sample
    assert back.to_json() == js
    assert Graph.from_json(js.encode()) == sample  # bytes are accepted
    assert back.fingerprint() == sample.fingerprint()
    assert json.loads(sample.to_json(indent=2)) == json.loads(js)


def test_json_is_strict_json_with_tagged_non_finite_floats():
    doc = json.loads(rich_graph().to_json())  # to_json uses allow_nan=False, so this is strict JSON
    const = next(n for n in doc["nodes"] if n["name"] == "c")
    assert const["attrs"]["value"][:3] == [{"float": "nan"}, {"float": "inf"}, {"float": "-inf"}]
    assert const["type"] == {"shape": [2, 3], "dtype": "float32"}
    assert doc["format"] == "attnpass.graph" and doc["version"] == 2
    assert doc["inputs"] == ["x", "m", "idx", "h"] and doc["outputs"] == ["s", "tk", "ii", "mx", "x"]


def test_json_keeps_source_locations():
    g = chain_graph(3)
    g.replace_node("n001", g.node("n001").replace(loc=SourceLoc("model.py", 12, "attend")))
    back = Graph.from_json(g.to_json())
    assert back.node("n001").loc == SourceLoc("model.py", 12, "attend")
    assert [n.loc for n in back] == [n.loc for n in g]


def good_doc() -> dict:
    return json.loads(chain_graph(2).to_json())


def mutate(**changes):
    def apply(doc):
        doc.update(changes)
        return doc

    return apply


def node_field(index, key, value):
    def apply(doc):
        if value is KeyError:
            del doc["nodes"][index][key]
        else:
            doc["nodes"][index][key] = value
        return doc

    return apply


def node_type(index, shape, dtype):
    return node_field(index, "type", {"shape": shape, "dtype": dtype})


def input_attrs(**changes):
    return node_field(0, "attrs", {"shape": [4, 8], "dtype": "float32", "role": "streamed", **changes})


def rename_everywhere(old, new):
    def apply(doc):
        return json.loads(json.dumps(doc).replace(f'"{old}"', json.dumps(new)))

    return apply


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: [d], 'not an attnpass graph: expected an object with "format": "attnpass.graph"'),
        (mutate(format="onnx"), "not an attnpass graph"),
        (lambda d: {k: v for k, v in d.items() if k != "format"}, "not an attnpass graph"),
        (mutate(version=3), "unsupported graph version 3; this library reads 2"),
        (mutate(version="1"), "unsupported graph version '1'"),
        (lambda d: {k: v for k, v in d.items() if k != "nodes"}, "graph: missing field 'nodes'"),
        (lambda d: {k: v for k, v in d.items() if k != "inputs"}, "graph: missing field 'inputs'"),
        (lambda d: {k: v for k, v in d.items() if k != "outputs"}, "graph: missing field 'outputs'"),
        (mutate(nodes={"x": 1}), "graph: field 'nodes' has the wrong kind (dict)"),
        (mutate(name=3), "graph: field 'name' has the wrong kind (int)"),
        (mutate(name="class"), "invalid graph name 'class'"),
        (node_field(1, "op", KeyError), "node 'n000': missing field 'op'"),
        (node_field(1, "name", KeyError), "node #1: missing field 'name'"),
        (node_field(1, "attrs", KeyError), "node 'n000': missing field 'attrs'"),
        (node_field(1, "type", KeyError), "node 'n000': missing field 'type'"),
        (lambda d: d["nodes"].__setitem__(1, "n000") or d, "node #1: expected an object, got str"),
        (node_field(1, "op", "conv"), "unknown op 'conv'"),
        (node_field(1, "op", 7), "node 'n000': field 'op' has the wrong kind (int)"),
        (node_field(1, "inputs", "x"), "node 'n000': field 'inputs' has the wrong kind (str)"),
        (node_field(1, "inputs", [0]), "node 'n000': inputs must be names"),
        (node_field(1, "inputs", ["ghost"]), "operand 'ghost' is not defined"),
        (node_type(1, "4,8", "float32"), "node 'n000': field 'shape' has the wrong kind (str)"),
        (node_type(1, [4, 8.0], "float32"), "node 'n000': shape [4, 8.0] must be a list of ints"),
        (node_type(1, [4, True], "float32"), "shape [4, True] must be a list of ints"),
        (node_type(1, [4, -8], "float32"), "shape must be a tuple of non-negative ints"),
        (node_type(1, [4, 8], "float64"), "unsupported dtype 'float64'"),
        (node_type(1, [4, 9], "float32"), "exp n000: annotated type f32[4,9] but the shape rule gives f32[4,8]"),
        (input_attrs(dtype="float64"), "input x: attribute dtype: unsupported dtype 'float64'"),
        (input_attrs(role="pinned"), "input x: attribute role: expected one of 'streamed', 'resident', got 'pinned'"),
        (input_attrs(shape=[4, -8]), "input: shape [4, -8] has negative dims"),
        (node_field(1, "attrs", {"axis": 0}), "exp n000: unknown attribute(s) axis"),
        (node_field(1, "attrs", {"x": {"eval": "1"}}), "unexpected attribute object {'eval': '1'}"),
        (node_field(0, "loc", {"file": "a.py"}), "missing field 'line'"),
        (mutate(inputs=["x", "x"]), "must list each input node once"),
        (mutate(inputs=[]), "signature [] must list each input node once: ['x']"),
        (mutate(outputs=["ghost"]), "output 'ghost' is not defined"),
        (mutate(outputs=[]), "has no outputs"),
        (mutate(outputs="n001"), "field 'outputs' has the wrong kind (str)"),
        (rename_everywhere("n000", "x; import os"), "invalid value name 'x; import os'"),
        (rename_everywhere("n000", "class"), "invalid value name 'class'"),
        (rename_everywhere("x", "__import__('os')"), "invalid value name \"__import__('os')\""),
        (rename_everywhere("n001", "n000"), "duplicate name 'n000'"),
    ],
)
def test_malformed_json(change, message):
    text = json.dumps(change(good_doc()))
    with pytest.raises(GraphFormatError, match=re.escape(message)):
        Graph.from_json(text)


@pytest.mark.parametrize("text", ["not json {", "", '{"format": ', b"\xff\xfe\x00"])
def test_malformed_json_syntax(text):
    with pytest.raises(GraphFormatError, match="malformed JSON"):
        Graph.from_json(text)


def test_good_doc_is_accepted():
    """The mutations above start from a document that loads (so each failure is due to its change)."""
    assert Graph.from_json(json.dumps(good_doc())) == chain_graph(2)


def test_loading_never_executes_code(tmp_path, monkeypatch):
    sentinel = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {sentinel}')"
    for change in (rename_everywhere("n000", payload), node_field(1, "op", payload), mutate(name=payload)):
        with pytest.raises(GraphFormatError):
            Graph.from_json(json.dumps(change(good_doc())))
    assert not sentinel.exists()

    def forbidden(*args, **kwargs):
        raise AssertionError("the loader called eval/exec")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    # (compile stays: ast.parse uses it to build a syntax tree, which executes nothing)
    g = rich_graph()
    assert Graph.from_json(g.to_json()) == g
    assert parse_graph(str(g)) == g


# ============================================================================ fingerprint


def build(
    names=("q", "k", "v", "scores", "p", "o"),
    dtype="bfloat16",
    scale=0.0625,
    kv_len=64,
    role="resident",
    act="exp",
    swap_operands=False,
    swap_outputs=False,
    swap_inputs=False,
    dead=False,
    graph_name="fp",
) -> Graph:
    """q, k, v -> scores = matmul(q, kT); p = act(scores) * scale; o = sdpa(q, k, v): two outputs."""
    nq, nk, nv, ns, np_, no = names
    g = Graph(graph_name)
    ins = [(nq, (1, 4, 3, 8), "streamed"), (nk, (1, 4, kv_len, 8), role), (nv, (1, 4, kv_len, 8), role)]
    if swap_inputs:
        ins = [ins[1], ins[0], ins[2]]
    for name, shape, r in ins:
        g.add_input(name, t(shape, dtype), r)
    if dead:
        g.add_node("relu", [nq], name="dead_relu")
    kt = g.add_node("transpose", [nk], {"perm": (0, 1, 3, 2)}, name=f"{ns}_kt")
    s = g.add_node("matmul", [nq, kt], name=ns)
    a = g.add_node(act, [s], name=f"{np_}_act")
    c = g.add_node("constant", [], {"value": (scale,), "shape": (), "dtype": dtype}, name=f"{np_}_c")
    p = g.add_node("sub", [c, a] if swap_operands else [a, c], name=np_)
    o = g.add_node("sdpa", [nq, nk, nv], {"scale": scale}, name=no)
    g.set_outputs([o, p] if swap_outputs else [p, o])
    return g


def test_fingerprint_is_stable_across_copies_and_round_trips():
    g = build()
    fp = g.fingerprint()
    assert re.fullmatch(r"[0-9a-f]{64}", fp)
    assert build().fingerprint() == fp
    assert g.copy().fingerprint() == fp
    assert Graph.from_json(g.to_json()).fingerprint() == fp
    assert parse_graph(str(g)).fingerprint() == fp
    assert g.fingerprint() == fp  # computing it does not change anything


def test_fingerprint_ignores_names_locations_and_graph_name():
    a = build()
    b = build(names=("query", "key", "value", "s", "probs", "out"), graph_name="other")
    assert a != b  # different names: structurally unequal...
    assert a.fingerprint() == b.fingerprint()  # ...but the same computation
    c = build()
    c.replace_node("p", c.node("p").replace(loc=SourceLoc("x.py", 1)))
    assert c.fingerprint() == a.fingerprint()


def test_fingerprint_ignores_dead_nodes():
    a = build()
    assert build(dead=True).fingerprint() == a.fingerprint()
    g = build()
    g.add_node("softmax", [g.add_node("exp", ["q"])])
    assert g.fingerprint() == a.fingerprint()


def test_fingerprint_ignores_insertion_order():
    a = Graph("g")
    x = a.add_input("x", t((3,)))
    e = a.add_node("exp", [x])
    n = a.add_node("neg", [x])
    a.set_outputs([a.add_node("add", [e, n])])
    b = Graph("g")
    x = b.add_input("x", t((3,)))
    n = b.add_node("neg", [x])
    e = b.add_node("exp", [x])
    b.set_outputs([b.add_node("add", [e, n])])
    assert a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"scale": 0.125},  # an attribute (sdpa scale and the constant's value)
        {"dtype": "float16"},  # dtypes
        {"kv_len": 65},  # shapes
        {"act": "neg"},  # an op
        {"swap_operands": True},  # operand order
        {"swap_outputs": True},  # output order
        {"role": "streamed"},  # input role
        {"swap_inputs": True},  # signature order
    ],
    ids=lambda c: next(iter(c)),
)
def test_fingerprint_changes_with_what_is_computed(change):
    assert build(**change).fingerprint() != build().fingerprint()


def test_fingerprint_distinguishes_each_single_attribute():
    base = masked_sdpa_graph()
    fps = {base.fingerprint()}
    for name, attrs in [
        ("sdpa", {"scale": None, "causal": "top_left", "logit_softcap": None, "window": None}),
        ("sdpa", {"scale": 0.5, "causal": "bottom_right", "logit_softcap": None, "window": None}),
        ("sdpa", {"scale": 0.125, "causal": "top_left", "logit_softcap": 30.0, "window": None}),
        (
            "sdpa",
            {
                "scale": 0.125,
                "causal": "top_left",
                "logit_softcap": None,
                "window": (2, None, None),
            },
        ),
        ("softmax", {"axis": -1, "precise": False}),
        ("slice", {"start": (0, 0, 1, 0), "stop": (1, 2, 6, 6), "step": (1, 1, 2, 1)}),  # same type
    ]:
        g = masked_sdpa_graph()
        node = g.node(name)
        new_type = get_op(node.op).result_type([g.node(i).type for i in node.inputs], attrs, optionals=node.optionals)
        g.replace_node(name, node.replace(attrs=attrs, type=new_type))
        g.verify()
        fps.add(g.fingerprint())
    assert len(fps) == 7


def test_fingerprint_of_dead_input_still_counts_in_signature():
    """Inputs are the program's signature: an unused input changes it (removing it is a pass's job)."""
    a = build()
    b = build()
    b.add_input("unused", t((2,)))
    assert a.fingerprint() != b.fingerprint()


def test_verifier_rejects_a_graph_name_changed_to_code_after_construction():
    from attnpass.ir import TensorSpec, ops, trace

    g = trace(lambda x: ops.exp(x), TensorSpec((2,), "float32"))
    g.name = 'x"""; import os; """'
    with pytest.raises(VerifyError, match="invalid graph name"):
        g.verify()


def test_copy_is_independent_and_keeps_the_order():
    from attnpass.ir import TensorSpec, ops, trace

    g = trace(lambda x: ops.exp(ops.neg(x)), TensorSpec((2,), "float32"))
    c = g.copy()
    assert c == g and [n.name for n in c.nodes()] == [n.name for n in g.nodes()]
    extra = c.add_node("relu", [c.outputs[0]])
    c.set_outputs([extra])
    assert extra not in g and g.outputs != c.outputs and len(g) == len(c) - 1


def test_remove_dead_and_prune():
    from attnpass.ir import TensorSpec, ops, trace

    def fn(x, unused):
        ops.neg(x)  # dead, outside the pruned cone
        y = ops.relu(x)
        return ops.exp(y)

    g = trace(fn, TensorSpec((2,), "float32"), TensorSpec((3,), "float32"))
    pruned = g.copy()
    pruned.replace_with("exp", pruned.add_node("exp", ["x"], name="exp_x"))
    assert [n.name for n in pruned.prune(["relu"])] == ["relu"]  # x is an input: it stays
    assert "neg" in pruned and pruned.inputs == ("x", "unused")
    g.replace_with("exp", g.add_node("exp", ["relu"], name="exp_relu"))
    assert [n.name for n in g.remove_dead()] == ["unused", "neg"]
    assert g.inputs == ("x",) and g.remove_dead() == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "unary", "remove", "rewire", "prune"]), st.integers(0, 10**6)), max_size=40
    )
)
def test_the_kept_order_equals_a_fresh_sort_after_any_edits(edits):
    """The order ``nodes()`` keeps across appends and removals (not re-sorted) is the stable topological order a
    fresh sort gives: operands first, ties by insertion, as networkx's lexicographical sort orders them."""
    g = Graph("edits")
    g.add_input("x", TensorType((3,), "float32"))
    g.set_outputs(["x"])
    for kind, pick in edits:
        names = [n.name for n in g.nodes()]  # reading the order between edits is what keeps it cached
        a, b = names[pick % len(names)], names[(pick // 7) % len(names)]
        if kind == "add":
            g.add_node("add", [a, b])
        elif kind == "unary":
            g.add_node("neg", [a])
        elif kind == "remove" and not g.users(a) and a not in g.outputs and a not in g.inputs:
            g.remove_node(a)
        elif kind == "rewire" and a not in g.inputs and b not in g.inputs and a != b and b not in g.descendants([a]):
            g.replace_all_uses(a, b)
        elif kind == "prune":
            g.prune([a])
        g.set_outputs([g.nodes()[-1].name])
    kept = [n.name for n in g.nodes()]
    fresh = g.copy()
    fresh._order = None  # force the full sort
    assert kept == [n.name for n in fresh.nodes()]
    assert kept == g._sorted_by_networkx()  # our sort is networkx's lexicographical one, ranks as the key


@pytest.mark.parametrize("odd", [True, 1.0, (1,)])
def test_a_node_alike_but_for_an_attribute_type_is_checked_on_its_own(odd):
    """The verifier infers nodes alike once, but ``1``, ``1.0`` and ``True`` are alike only to Python: a node whose
    int attribute is a bool or a float is rejected even after a normalized twin was accepted."""
    g = Graph("g")
    g.add_input("x", TensorType((2, 3), "float32"))
    twin = g.node(g.add_node("softmax", ["x"], {"axis": 1}))
    g.insert(Node("odd", "softmax", ("x",), {**twin.attrs, "axis": odd}, twin.type, None))
    g.set_outputs([twin.name, "odd"])
    with pytest.raises(VerifyError, match="softmax odd: .*attribute axis"):
        verify(g)
