"""Named optional operands (``opt_operand("mask")`` in an ``OpDef``, ``Node.optionals``): accessors, building, printing, JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest

from attnpass.ir import DType, Graph, Node, ShapeError, TensorType, get_op, parse_graph, registered_ops
from attnpass.ir.core.registry import OpDef, Operand, operand, opt_operand, var_operand
from attnpass.ir.core.types import GraphFormatError

F32 = DType.float32


def sdpa_graph(**optional: bool) -> Graph:
    """An sdpa whose ``[4]`` input ``x`` is its mask (additive, broadcast over the keys: T = Hq = 4) or its sinks."""
    g = Graph("attention")
    q = g.add_input("q", TensorType((1, 4, 3, 8), F32))
    k = g.add_input("k", TensorType((1, 2, 4, 8), F32))
    v = g.add_input("v", TensorType((1, 2, 4, 8), F32))
    x = g.add_input("x", TensorType((4,), F32))
    g.set_outputs([g.add_node("sdpa", {"q": q, "k": k, "v": v, **{o: x for o, on in optional.items() if on}})])
    return g.verify()


def test_accessors_read_each_operand_by_name():
    node = sdpa_graph(sinks=True).node("sdpa")
    assert node.optionals == ("sinks",) and node.inputs == ("q", "k", "v", "x")
    assert (node.q, node.k, node.v, node.mask, node.sinks) == ("q", "k", "v", None, "x")
    assert node.operand("sinks") == "x" and node.operands == {"q": "q", "k": "k", "v": "v", "mask": None, "sinks": "x"}
    assert node.bind(["Q", "K", "V", "S"]) == {"q": "Q", "k": "K", "v": "V", "mask": None, "sinks": "S"}
    with pytest.raises(AttributeError, match=r"sdpa sdpa: no attribute or operand 'bias'; operands: q, k, v, mask\?"):
        node.bias  # noqa: B018
    with pytest.raises(AttributeError, match="no operand 'bias'"):
        node.operand("bias")
    assert not hasattr(sdpa_graph().node("q"), "mask")


def test_with_operands_moves_an_operand_between_slots():
    g = sdpa_graph(mask=True)
    node = g.node("sdpa").with_operands(mask=None, sinks="x")
    assert node.optionals == ("sinks",) and node.inputs == ("q", "k", "v", "x")
    both = g.node("sdpa").with_operands(sinks="x")
    assert both.optionals == ("mask", "sinks") and both.inputs == ("q", "k", "v", "x", "x")
    with pytest.raises(ShapeError, match="sdpa: missing required operand k"):
        g.node("sdpa").with_operands(k=None)


def test_the_same_value_as_mask_or_as_sinks_is_a_different_graph():
    masked, sunk = sdpa_graph(mask=True), sdpa_graph(sinks=True)
    assert masked != sunk and masked.fingerprint() != sunk.fingerprint()
    for g in (masked, sunk, sdpa_graph(mask=True, sinks=True), sdpa_graph()):
        assert parse_graph(str(g)) == g and Graph.from_json(g.to_json()) == g
    assert str(masked).splitlines()[1].endswith("q k v mask=x") and str(sunk).splitlines()[1].endswith("q k v sinks=x")
    assert "optionals" not in json.loads(sdpa_graph().to_json())["nodes"][-1]


@pytest.mark.parametrize(
    "operands, optionals, message",
    [
        (4, (), r"sdpa: expected 3 operand\(s\) \(q, k, v\), got 4; optional operands \(mask\?, sinks\?\) are given by name"),
        (4, ("bias",), "sdpa: unknown optional operand 'bias'; optional operands: mask, sinks"),
        (5, ("sinks", "mask"), r"sdpa: optional operands sinks, mask must each appear once, in the op's order \(mask, sinks\)"),
        (4, ("mask", "mask"), "must each appear once"),
        (3, ("mask",), r"sdpa: expected 4 operand\(s\) \(q, k, v, mask\), got 3"),
    ],
)  # fmt: skip
def test_check_operands_names_what_is_wrong(operands, optionals, message):
    with pytest.raises(ShapeError, match=message):
        get_op("sdpa").check_operands(operands, optionals)


def test_add_node_takes_optional_operands_only_by_name():
    g = sdpa_graph()
    with pytest.raises(ShapeError, match=r"optional operands \(mask\?, sinks\?\) are given by name"):
        g.add_node("sdpa", ["q", "k", "v", "x"])
    with pytest.raises(ShapeError, match="sdpa: unknown operand 'bias'"):
        g.add_node("sdpa", {"q": "q", "k": "k", "v": "v", "bias": "x"})


def test_the_verifier_checks_a_node_built_with_the_wrong_optionals():
    g = sdpa_graph(mask=True)
    g.replace_node("sdpa", g.node("sdpa").replace(optionals=("mask", "sinks")))
    with pytest.raises(Exception, match=r"sdpa sdpa: sdpa: expected 5 operand\(s\) \(q, k, v, mask, sinks\), got 4"):
        g.verify()


def test_an_op_record_lists_required_operands_first():
    with pytest.raises(ValueError, match="required ones first"):
        OpDef("bad", (opt_operand("mask"), operand("x")), lambda ts: ts[1])
    with pytest.raises(ValueError, match="required ones first"):
        OpDef("bad", (operand("x"), opt_operand("mask"), var_operand("xs")), lambda ts: ts[0])
    with pytest.raises(ValueError, match="each name once"):
        OpDef("bad", (operand("x"), opt_operand("x")), lambda ts: ts[0])


def test_operands_are_declared_as_records_not_strings():
    assert get_op("sdpa").operands == tuple(map(Operand, "qkv")) + (opt_operand("mask"), opt_operand("sinks"))
    assert get_op("sdpa").signature == "q, k, v, mask?, sinks?" and get_op("concat").signature == "*xs"
    with pytest.raises(TypeError, match=r"operand 'mask\?' is not an Operand; declare operands with operand\(name\)"):
        OpDef("bad", (operand("x"), "mask?"), lambda ts: ts[0])
    with pytest.raises(ValueError, match="operand 'mask\\?': the name is not an identifier"):
        opt_operand("mask?")
    with pytest.raises(ValueError, match="operand xs: optional or variadic, not both"):
        Operand("xs", optional=True, variadic=True)


def test_no_operand_name_is_hidden_by_a_node_attribute():
    """``node.<operand>`` reaches ``__getattr__`` only when Node has no attribute of that name."""
    taken = set(dir(Node)) | {f.name for f in dataclasses.fields(Node)}
    assert "type" in taken
    assert not {(op.name, o) for op in registered_ops().values() for o in op.operand_names if o in taken}


def test_a_variadic_op_has_no_named_operand():
    g = Graph("c")
    x = g.add_input("x", TensorType((2,), F32))
    node = g.node(g.add_node("concat", [x, x], {"axis": 0}))
    with pytest.raises(AttributeError, match=r"concat concat: no operand 'xs'; operands: \*xs"):
        node.operand("xs")
    with pytest.raises(AttributeError, match="no attribute or operand 'xs'"):
        node.xs  # noqa: B018


def _version_1(g: Graph, has_sinks: bool) -> str:
    """``g``'s JSON as version 1 wrote it: no optionals, sdpa's ``has_sinks`` attribute."""
    doc = json.loads(g.to_json())
    doc["version"] = 1
    for node in doc["nodes"]:
        node.pop("optionals", None)
        if node["op"] == "sdpa":
            node["attrs"]["has_sinks"] = has_sinks
    return json.dumps(doc)


@pytest.mark.parametrize("mask, sinks", [(False, False), (True, False), (False, True), (True, True)])
def test_version_1_documents_load_with_their_operands_named(mask, sinks):
    g = sdpa_graph(mask=mask, sinks=sinks)
    assert Graph.from_json(_version_1(g, sinks)) == g


def test_a_version_1_quantized_sdpa_mask_is_named():
    g = Graph("q")
    q = g.add_input("q", TensorType((1, 2, 1, 64), F32))
    words = [g.add_input(f"{x}q", TensorType((1, 1, 5, 8), DType.int32)) for x in "kv"]
    sb = [g.add_input(n, TensorType((1, 1, 5, 1), F32)) for n in ("ks", "kb", "vs", "vb")]
    m = g.add_input("m", TensorType((1, 5), DType.bool))
    operands = {"q": q, "kq": words[0], "ks": sb[0], "kb": sb[1], "vq": words[1], "vs": sb[2], "vb": sb[3], "mask": m}
    g.set_outputs([g.add_node("quantized_sdpa", operands, {"scale": 0.125})])
    assert g.node(g.outputs[0]).mask == "m"
    assert Graph.from_json(_version_1(g, False)) == g


def test_a_version_1_sdpa_flagging_sinks_it_lacks_fails_naming_the_node():
    with pytest.raises(GraphFormatError, match=r"sdpa: expected 4 operand\(s\) \(q, k, v, sinks\), got 3"):
        Graph.from_json(_version_1(sdpa_graph(), True))
