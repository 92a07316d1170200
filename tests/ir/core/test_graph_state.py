"""Stateful graphs: state pairs (print, JSON, verify, fingerprint), dynamic_update_slice, JAX donation."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import (
    Graph,
    GraphFormatError,
    ShapeError,
    TensorSpec,
    TensorType,
    VerifyError,
    ops,
    parse_graph,
    trace,
)
from attnpass.lowering import lower
from attnpass.passes import DeadCodeElimination, NarrowInputs
from tests.util import assert_bits_equal, lazy_import, requires

jnp = lazy_import("jax.numpy")

STATEFUL = """\
graph step(x:f32[1,3], cache:f32[4,3]{resident}, at:i32[2]) {
  dynamic_update_slice:f32[4,3] = dynamic_update_slice cache x at
  sum:f32[3] = sum[axes=(0,), keepdims=False] dynamic_update_slice
  return sum, dynamic_update_slice -> cache
}"""


def stateful() -> Graph:
    def step(x, cache, at):
        new = ops.dynamic_update_slice(cache, x, at)
        return ops.sum(new, axis=0), new

    g = trace(step, TensorSpec((1, 3)), TensorSpec((4, 3), role="resident"), TensorSpec((2,), "int32"))
    g.pair_state("cache", 1)
    return g.verify()


def test_state_round_trips_through_text_and_json():
    g = stateful()
    assert str(g) == STATEFUL
    assert g.state_pairs() == (("cache", 1),)
    assert g.is_state("cache") and not g.is_state("x") and not g.is_state("nowhere")
    assert parse_graph(STATEFUL) == g
    again = Graph.from_json(g.to_json())
    assert again == g and again.state_pairs() == (("cache", 1),)
    plain = stateful()
    plain._state.clear()
    assert plain != g and plain.fingerprint() != g.fingerprint()
    assert '"state"' not in plain.to_json()  # graphs without state keep their JSON form


@pytest.mark.parametrize(
    "text, message",
    [
        (STATEFUL.replace("{resident}", ""), "must be a resident input, cache is streamed"),
        (STATEFUL.replace("return sum, dynamic_update_slice -> cache", "return sum -> cache"), "differs in type"),
        (STATEFUL.replace("-> cache", "-> nothing"), "state 'nothing' is not a graph input"),
        (STATEFUL.replace("-> cache", "-> cache -> cache"), "state 'cache -> cache' is not a graph input"),
        (STATEFUL.replace("-> cache", "-> " + "c" * 10_000), r"state 'c+\.\.\.c+' is not a graph input"),
        (STATEFUL.replace("-> cache", "-> x"), "must be a resident input, x is streamed"),
    ],
)
def test_verifier_rejects_bad_pairs(text, message):
    with pytest.raises(GraphFormatError, match=message):
        parse_graph(text)


def test_each_input_and_each_output_in_one_pair_at_most():
    g = stateful()
    with pytest.raises(VerifyError, match="already updated by output #1"):
        g.pair_state("cache", 0)
    g.add_input("other", TensorType((4, 3), "float32"), "resident")
    g.pair_state("other", 1)
    with pytest.raises(VerifyError, match="that output already updates"):
        g.verify()
    doc = stateful().to_json().replace('"state": [["cache", 1]]', '"state": [["cache", 1], ["cache", 1]]')
    with pytest.raises(GraphFormatError, match="already updated"):
        Graph.from_json(doc)
    for bad in ('[["cache", "1"]]', '[["cache", true]]', '[["cache"]]', '["cache"]', '[["cache", 1, 2]]'):
        with pytest.raises(GraphFormatError, match="must be \\[input name, output position\\]"):
            Graph.from_json(stateful().to_json().replace('[["cache", 1]]', bad))
    for bad, message in (
        ('{"cache": 1}', "field 'state' has the wrong kind"),
        ('[["cache", 2]]', "the graph has 2 output"),
        ('[["cache", -1]]', "the graph has 2 output"),
        ('[["' + "n" * 100_000 + '", 1]]', "is not a graph input"),
    ):
        with pytest.raises(GraphFormatError, match=message) as info:
            Graph.from_json(stateful().to_json().replace('[["cache", 1]]', bad))
        assert len(str(info.value)) < 400  # quoted input stays short


def test_state_inputs_survive_dce_and_narrowing():
    def step(x, cache, at):
        return ops.sum(x, axis=0), ops.dynamic_update_slice(cache[0:2], x, at)

    g = trace(step, TensorSpec((1, 3)), TensorSpec((2, 3), role="resident"), TensorSpec((2,), "int32"))
    g.add_input("unread", TensorType((1, 3), "float32"), "resident")
    g.set_outputs([*g.outputs, "x"])
    g.pair_state("unread", 2)
    g.verify()
    result = DeadCodeElimination()(g)
    assert "unread" in result.graph.inputs  # nobody reads it, yet the caller carries it
    with pytest.raises(VerifyError, match="is state"):
        result.graph.copy().remove_node("unread")
    (remark,) = [r for r in NarrowInputs()(g).remarks if r.node == "unread"]
    assert (remark.kind, remark.reason) == ("declined", "interface")


def test_dynamic_update_slice_shape_rule():
    buf, upd = TensorSpec((4, 3)), TensorSpec((1, 3))
    with pytest.raises(ShapeError, match="must be i32\\[2\\]"):
        trace(lambda b, u, s: ops.dynamic_update_slice(b, u, s), buf, upd, TensorSpec((3,), "int32"))
    with pytest.raises(ShapeError, match="fit in it"):
        trace(lambda b, u, s: ops.dynamic_update_slice(b, u, s), buf, TensorSpec((5, 3)), TensorSpec((2,), "int32"))
    with pytest.raises(ShapeError, match="dtype"):
        trace(lambda b, u, s: ops.dynamic_update_slice(b, u, s), buf, upd, TensorSpec((2,), "float32"))


@requires("mlx.core", "jax")
@pytest.mark.parametrize("start", [(2, 0), (3, 0), (7, 1), (-2, -5), (0, 0)])
def test_dynamic_update_slice_agrees_bit_for_bit_and_clamps(start):
    g = stateful()
    rng = np.random.default_rng(sum(start) + 10)
    x, cache = rng.standard_normal((1, 3), dtype=np.float32), rng.standard_normal((4, 3), dtype=np.float32)
    at = np.array(start, np.int32)
    want = cache.copy()
    want[min(max(start[0], 0), 3)] = x[0]  # one row: the column offset clamps to 0
    for target in ("numpy", "mlx", "jax"):
        total, new = run(lower(g, target), x, cache.copy(), at)
        assert_bits_equal(new, want)
        assert total.shape == (3,)


@requires("mlx.core", "jax")
def test_jax_program_donates_state_and_the_loop_carries_it():
    program = lower(stateful(), "jax")
    assert "jax.jit(step, donate_argnums=(1,))" in program.source
    assert "donate" not in lower(stateful(), "mlx").source
    cache = jnp.zeros((4, 3), jnp.float32)
    state = {"cache": cache}
    for row in range(4):
        out = program(np.full((1, 3), row + 1, np.float32), state["cache"], np.array([row, 0], np.int32))
        state = program.next_state(out)
    assert cache.is_deleted()  # donated: XLA reused the buffer
    np.testing.assert_array_equal(np.asarray(state["cache"])[:, 0], [1, 2, 3, 4])


@requires("jax")
def test_an_eager_jax_program_neither_jits_nor_donates():
    program = lower(stateful(), "jax", jit=False)
    assert "jax.jit" not in program.source
    cache = jnp.zeros((4, 3), jnp.float32)
    out = program(np.ones((1, 3), np.float32), cache, np.array([2, 0], np.int32))
    assert not cache.is_deleted()  # eager: the buffer is not donated
    np.testing.assert_array_equal(np.asarray(program.next_state(out)["cache"])[:, 0], [0, 0, 1, 0])
