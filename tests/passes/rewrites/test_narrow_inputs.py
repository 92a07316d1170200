"""NarrowInputs: inputs read only through one fixed slice shrink to it; the signature says so."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import TensorSpec, ops, parse_graph, trace
from attnpass.lowering import lower
from attnpass.passes import DeadCodeElimination, NarrowInputs, PassManager
from tests.fuzz.families import Case
from tests.passes.claims import audit, fuzzed

NARROW = NarrowInputs()


def model(x, mask, w):
    rows = mask[:, 1:3, ::2]  # two slices with the same bounds
    again = mask[:, 1:3, ::2]
    return ops.matmul(x, w) + rows + again


SPECS = (TensorSpec((2, 2, 4)), TensorSpec((2, 64, 8), "float16", "resident"), TensorSpec((4, 4)))


def typed(x, mask, w):
    return model(x, ops.cast(mask, "float32"), w)


def test_input_read_through_one_slice_is_narrowed_in_place():
    def f(x, mask, w):
        return ops.matmul(x, w) + ops.cast(mask[:, 1:3, ::2], "float32")

    g = trace(f, *SPECS)
    result = NARROW(g)
    out = result.graph
    assert result.changed
    assert out.inputs == ("x", "mask", "w")  # same name, same place
    assert str(out.node("mask").type) == "f16[2,2,4]" and out.input_role("mask") == "resident"
    assert "slice" not in {n.op for n in out.nodes()}
    assert out.input_nbytes("resident") == 2 * 2 * 4 * 2
    assert parse_graph(str(out)) == out
    (applied,) = result.applied()
    assert applied.node == "mask"
    assert applied.message == (
        "read only through the slice [0:2, 1:3, 0:8:2]: input mask:f16[2,64,8] narrowed to f16[2,2,4] "
        f"(resident), {2 * 64 * 8 * 2} -> {2 * 2 * 4 * 2} bytes of device memory"  # resident: not sent per call
    )
    rng = np.random.default_rng(0)
    x, mask, w = (
        rng.standard_normal((2, 2, 4), np.float32),
        rng.standard_normal((2, 64, 8)).astype(np.float16),
        rng.standard_normal((4, 4), np.float32),
    )
    program = lower(out, "numpy")
    assert program.signature() == [
        ("x", out.node("x").type, "streamed"),
        ("mask", out.node("mask").type, "resident"),
        ("w", out.node("w").type, "streamed"),
    ]
    np.testing.assert_array_equal(run(program, x, mask[:, 1:3, ::2], w), run(lower(g, "numpy"), x, mask, w))


def test_identical_slices_share_the_narrowed_input_and_others_decline():
    g = trace(typed, *SPECS)
    result = NARROW(g)
    # mask is read by cast, so nothing narrows; the remark says why, one per input
    assert not result.changed
    assert [(r.kind, r.node, r.reason) for r in result.remarks] == [
        ("declined", "x", "read_whole"),
        ("declined", "mask", "read_whole"),
        ("declined", "w", "read_whole"),
    ]
    assert "read by cast" in result.remarks[1].message  # it names the reader that is not a slice
    g2 = trace(model, TensorSpec((2, 2, 4)), TensorSpec((2, 64, 8)), TensorSpec((4, 4)))
    out = NARROW(g2).graph
    assert str(out.node("mask").type) == "f32[2,2,4]"
    assert "slice" not in {n.op for n in out.nodes()} and len(out.users("mask")) == 2


@pytest.mark.parametrize(
    "fn, reason",
    [
        (lambda x: x[0:1] + x[1:2], "slices_differ"),
        (lambda x: ops.exp(ops.slice(x, [0], [4])), "read_whole"),
        (lambda x: x, "interface"),
    ],
)
def test_declines_with_reasons(fn, reason):
    g = trace(fn, TensorSpec((4,)))
    result = NARROW(g)
    assert not result.changed
    assert [(r.node, r.reason) for r in result.declined()] == [("x", reason)]


def test_unread_input_is_left_to_dce():
    def f(x, unused):
        return ops.exp(x)

    result = NARROW(trace(f, TensorSpec((2,)), TensorSpec((3,))))
    assert ("unused", "unused") in [(r.node, r.reason) for r in result.declined()]


def test_dce_then_narrow_reduces_a_padded_mask_to_one_row():
    def f(q, mask):
        ops.exp(mask)  # a dead reader: DCE must run first
        return q + mask[:, 0:1, :]

    g = trace(f, TensorSpec((1, 1, 16)), TensorSpec((1, 64, 16)))
    assert NARROW(g).changed is False
    result = PassManager([DeadCodeElimination(), NarrowInputs()]).run(g)
    assert g.input_nbytes() == 16 * 4 + 64 * 16 * 4
    assert result.graph.input_nbytes() == 16 * 4 + 16 * 4


def test_every_remark_states_the_bytes_its_input_loses():
    """Each remark's window is its slices' bounds and gives the new type; its bytes are the old and new input's
    (shape x numpy itemsize) and sum per role to what ``input_nbytes`` loses (tests/passes/claims.py)."""

    def resident_mask(x, mask, w):
        return ops.matmul(x, w) + ops.cast(mask[:, 1:3, ::2], "float32")

    padded = TensorSpec((2, 64, 8), role="resident")
    cases = [Case("narrow", trace(resident_mask, *SPECS)), Case("narrow", trace(model, SPECS[0], padded, SPECS[2]))]
    cases += fuzzed(("sdpa", "chain"), 200)
    counts = audit(NARROW, cases, before=lambda g: DeadCodeElimination()(g).graph, anchor="input")
    assert counts["applied"] >= 20 and counts["checked"] >= counts["applied"] + 100  # declines with counts too
