"""sdpa's sinks operand and logit_softcap attribute in the IR (issue 23): verifier, printer, JSON, fingerprint."""

from __future__ import annotations

import pytest

from attnpass.ir import DType, Graph, ShapeError, TensorSpec, get_op, ops, parse_graph, trace

BF16, F32 = DType.bfloat16, DType.float32
Q, KV = TensorSpec((1, 4, 3, 8), BF16), TensorSpec((1, 2, 5, 8), BF16)


def graph(softcap: float | None = 30.0, sinks_dtype: DType = BF16) -> Graph:
    return trace(
        lambda q, k, v, m, s: ops.sdpa(q, k, v, mask=m, sinks=s, logit_softcap=softcap, causal="bottom_right"),
        Q, KV, KV, TensorSpec((3, 5), DType.bool), TensorSpec((4,), sinks_dtype), name="attention",
    )  # fmt: skip


def test_printed_and_json_forms_round_trip_the_variants():
    g = graph()
    (line,) = [line for line in str(g).splitlines() if "= sdpa[" in line]
    assert "logit_softcap=30.0] q k v mask=m sinks=s" in line
    assert parse_graph(str(g)) == g and Graph.from_json(g.to_json()) == g
    assert parse_graph(str(g)).fingerprint() == Graph.from_json(g.to_json()).fingerprint() == g.fingerprint()


def test_an_sdpa_without_the_variants_prints_as_before():
    g = trace(lambda q, k, v: ops.sdpa(q, k, v), Q, KV, KV)
    (line,) = [line for line in str(g).splitlines() if "= sdpa[" in line]
    assert line.endswith("= sdpa[scale=None, causal='none'] q k v")


def test_the_fingerprint_tells_each_variant_apart():
    prints = {graph(c).fingerprint() for c in (None, 30.0, 50.0)}
    without = trace(lambda q, k, v, m: ops.sdpa(q, k, v, mask=m, causal="bottom_right"),
                    Q, KV, KV, TensorSpec((3, 5), DType.bool))  # fmt: skip
    assert len(prints | {without.fingerprint()}) == 4


@pytest.mark.parametrize(
    "attrs, operands, optionals, message",
    [
        ({}, [Q, KV, KV, TensorSpec((1, 4), BF16)], ("sinks",), r"sinks .*\[1,4\].* must be \[Hq\] = \[4\]"),
        ({}, [Q, KV, KV, TensorSpec((4,), DType.int32)], ("sinks",), "must have q's dtype bfloat16"),
        ({"logit_softcap": 0.0}, [Q, KV, KV], (), "logit_softcap 0.0 must be > 0"),
        ({}, [Q, KV, KV], ("sinks",), r"expected 4 operand\(s\) \(q, k, v, sinks\), got 3"),
        ({}, [Q, KV, KV, TensorSpec((4,), BF16)], ("sinks",), None),
    ],
)
def test_the_verifier_names_what_is_wrong(attrs, operands, optionals, message):
    types = [s.type for s in operands]
    op = get_op("sdpa")
    if message is None:
        assert op.result_type(types, attrs, optionals=optionals).shape == (1, 4, 3, 8)
        return
    with pytest.raises(ShapeError, match=message):
        op.result_type(types, attrs, optionals=optionals)


def test_float32_q_takes_sinks_of_any_float_dtype():
    spec = TensorSpec((1, 4, 3, 8), F32), TensorSpec((1, 2, 5, 8), F32)
    g = trace(lambda q, k, v, s: ops.sdpa(q, k, v, sinks=s), spec[0], spec[1], spec[1], TensorSpec((4,), BF16))
    node = g.node(g.outputs[0])
    assert node.optionals == ("sinks",) and node.sinks == g.inputs[3] and node.mask is None


def test_sdpa_lse_refuses_sinks():
    with pytest.raises(ShapeError, match="sdpa_lse: a sinks operand .* is not supported"):
        get_op("sdpa_lse").result_type(
            [Q.type, KV.type, KV.type, TensorSpec((4,), BF16).type], {}, optionals=("sinks",)
        )
