"""from_jax of what MaxText, EasyDeL and gemma trace: the single-device identities (``sharding_constraint``,
``checkpoint_name``, ``device_put``, ``optimization_barrier``), ``unstack``, ``floor``/``ceil``/``round``, ``pad``,
``top_k``; dead equations skipped before a rule can refuse them; PRNG key inputs declined by name.

Each function is imported, lowered to numpy, MLX and JAX and compared with ``jax.jit`` of the function itself, bit
for bit: every one of these is exact (moves, rounding to integers, a selection). ``top_k``'s order is JAX's: the
largest first, equal values by lower index first, floats in IEEE total order (-NaN < -inf < -0.0 < +0.0 < +inf <
+NaN), checked on inputs full of ties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.ir import DType, ModelImportError, ShapeError, TensorSpec, TensorType, from_jax, ops, trace
from attnpass.ir.dialects.evaluate import rounded
from attnpass.lowering import lower
from attnpass.passes import PassManager, parse_pipeline
from tests.util import assert_bits_equal, assert_close, lazy_import, one_op_graph, requires

pytestmark = requires("jax", "mlx.core")
jax = lazy_import("jax")
jnp = lazy_import("jax.numpy")
lax = lazy_import("jax.lax")

EVERY = ("numpy", "mlx", "jax")
FEW = settings(max_examples=12, deadline=None)


def _ops(graph) -> list[str]:
    return [n.op for n in graph.nodes() if n.op != "input"]


def _expected(fn, *args) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(jax.jit(fn)(*args))]


def _check(fn, *args, nan_payloads: bool = False):
    """``fn`` imported and run on every target, bit for bit ``jax.jit(fn)`` (``nan_payloads``: a NaN only has to
    be a NaN, its payload is the target's, as MLX's float16 floor returns 0x7D00 for 0x7E00)."""
    imported = from_jax(fn, *args)
    expected = _expected(fn, *args)
    for target in EVERY:
        got = run(lower(imported.graph, target), *args, **imported.params)
        for actual, wanted in zip(got if len(expected) > 1 else [got], expected, strict=True):
            actual = np.asarray(actual)
            if nan_payloads and wanted.dtype.kind not in "iub":
                nan = np.isnan(wanted.astype(np.float64))
                np.testing.assert_array_equal(np.isnan(actual.astype(np.float64)), nan, err_msg=target)
                actual, wanted = actual[~nan], wanted[~nan]
            assert_bits_equal(actual, wanted)
    return imported


def _auto_mesh(sizes: dict[str, int]):
    from jax.sharding import AbstractMesh, AxisType

    return AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def _one_device_mesh(name: str = "model"):
    from jax.sharding import AxisType

    return jax.make_mesh((1,), (name,), axis_types=(AxisType.Auto,))


# ----------------------------------------------------------------------------- identities


def test_single_device_identities_forward_their_operands(rng):
    """``with_sharding_constraint``, ``checkpoint_name``, ``device_put`` and ``optimization_barrier`` (of a
    pytree: several operands) leave no node: the graph is the one of the same function without them."""
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = _one_device_mesh()
    x, y = (rng.standard_normal((2, 4)).astype(np.float32) for _ in range(2))

    def plain(x, y):
        return jnp.abs(x) * y, x - y

    def wrapped(x, y):
        x = lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(None, "model")))
        x = checkpoint_name(x, "query_proj")
        x, y = lax.optimization_barrier((x, jax.device_put(y)))
        a, b = plain(x, y)
        return checkpoint_name(a, "out"), jax.device_put(b)

    names = {eqn.primitive.name for eqn in jax.make_jaxpr(wrapped)(x, y).jaxpr.eqns}
    assert {"sharding_constraint", "name", "device_put", "optimization_barrier"} <= names
    imported = _check(wrapped, x, y)
    assert _ops(imported.graph) == _ops(from_jax(plain, x, y).graph)


def test_a_sharding_constraint_the_ir_can_say_is_kept_as_an_annotation():
    """A ``NamedSharding`` with one mesh axis or none per dimension becomes the value's annotation and its mesh's
    axes of size > 1 the graph's mesh (a size-1 axis shards nothing); several axes on one dimension, an
    unconstrained dimension, a dimension its axis does not divide, a second constraint on an annotated value and
    one over size-1 axes only are forwarded without one."""
    from jax.sharding import PartitionSpec as P

    x = jax.ShapeDtypeStruct((4, 6, 8), jnp.float32)

    def fn(x):
        y = jnp.tanh(x)
        a = lax.with_sharding_constraint(x, P("data", None, "model"))
        b = lax.with_sharding_constraint(
            y,
            P(
                ("data", "model"),
            ),
        )  # two axes on dimension 0
        c = lax.with_sharding_constraint(y * 2, P(None, P.UNCONSTRAINED, "model"))
        d = lax.with_sharding_constraint(y + 1, P(None, "model"))  # 6 does not divide over 4
        e = lax.with_sharding_constraint(a, P(None, "data"))  # x is annotated already
        f = lax.with_sharding_constraint(y - 1, P("stage"))  # size 1: shards nothing
        g = lax.with_sharding_constraint(y * y, P("stage", "data"))
        return a, b, c, d, e, f, g

    with jax.sharding.use_abstract_mesh(_auto_mesh({"stage": 1, "data": 2, "model": 4})):
        graph = from_jax(fn, x).graph
    assert list(graph.mesh_axes.items()) == [("data", 2), ("model", 4)]
    assert graph.node("x").sharding == ("data", None, "model")
    annotated = [graph.node(n).sharding for n in graph.outputs]
    assert annotated == [("data", None, "model"), None, None, None, ("data", None, "model"), None, (None, "data", None)]


def test_a_maxtext_style_attention_imports_and_raises_to_one_sdpa(rng):
    """MaxText's attention: projections constrained to a logical sharding and named for remat around q, k and v
    and the output, a causal mask, a float32 softmax, and a dead decode-length counter (a scatter-add nobody
    reads). It imports, and raise-attention makes it one ``sdpa``."""
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _one_device_mesh("tensor")
    b, s, d, h, dk = 1, 6, 16, 4, 8
    wq, wk, wv = (rng.standard_normal((d, h, dk)).astype(np.float32) * np.float32(0.2) for _ in range(3))
    wo = rng.standard_normal((h, dk, d)).astype(np.float32) * np.float32(0.2)
    x = rng.standard_normal((b, s, d)).astype(np.float32)

    def constrain(t, spec):
        return lax.with_sharding_constraint(t, NamedSharding(mesh, spec))

    def attention(x, lengths):
        heads = P(None, None, "tensor", None)
        q = checkpoint_name(constrain(jnp.einsum("bsd,dhk->bshk", x, wq), heads), "query_proj")
        k = checkpoint_name(constrain(jnp.einsum("bsd,dhk->bshk", x, wk), heads), "key_proj")
        v = checkpoint_name(constrain(jnp.einsum("bsd,dhk->bshk", x, wv), heads), "value_proj")
        scores = jnp.einsum("bshk,bthk->bhst", q, k) / np.float32(math.sqrt(dk))
        causal = jnp.tril(jnp.ones((s, s), bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
        out = checkpoint_name(jnp.einsum("bhst,bthk->bshk", weights, v), "attention_out")
        _ = lengths.at[0].add(1)  # the decode length counter: dead
        return constrain(jnp.einsum("bshk,hkd->bsd", out, wo), P(None, None, None))

    lengths = np.zeros((b,), np.int32)
    names = {eqn.primitive.name for eqn in jax.make_jaxpr(attention)(x, lengths).jaxpr.eqns}
    assert {"sharding_constraint", "name", "scatter-add"} <= names
    imported = from_jax(attention, x, lengths)
    assert not {"put_along_axis", "dynamic_update_slice"} & set(_ops(imported.graph))
    assert not imported.graph.mesh_axes  # one device: its size-1 axis shards nothing, no hint kept
    raised = PassManager(parse_pipeline("raise-attention")).run(imported.graph).graph
    assert _ops(raised).count("sdpa") == 1 and not {"softmax", "exp"} & set(_ops(raised))
    expected = np.asarray(jax.jit(attention)(x, lengths))
    for target in EVERY:
        assert_close(run(lower(raised, target), x, lengths, **imported.params), expected)


# ----------------------------------------------------------------------------- unstack


def test_unstack_bound_directly_is_one_slice_per_read_output(rng):
    """``lax.unstack_p`` (what JAX >= 0.11 traces ``k, v = kv`` as) along either axis; outputs nobody reads are
    not imported."""
    kv = rng.standard_normal((2, 3, 4)).astype(np.float32)
    _check(lambda kv: lax.unstack_p.bind(kv, axis=0), kv)
    _check(lambda kv: lax.unstack_p.bind(kv, axis=2), kv)
    imported = _check(lambda kv: lax.unstack_p.bind(kv, axis=1)[2] * 2, kv)
    assert _ops(imported.graph).count("slice") == 1


def test_tuple_unpacking_as_the_installed_jax_traces_it(rng):
    """``k, v = kv`` and ``for row in x`` in real code: ``unstack`` from JAX 0.11 on (slices and squeezes before);
    imported either way, bit for bit."""

    def step(kv, x):
        k, v = kv
        first, *_ = x
        return k - v + first + sum(row for row in x)  # no product: XLA may contract one into an FMA

    kv = rng.standard_normal((2, 3, 4)).astype(np.float32)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    traced = {e.primitive.name for e in jax.make_jaxpr(step)(kv, x).jaxpr.eqns}
    assert ("unstack" in traced) == (tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)), traced
    _check(step, kv, x)


# ----------------------------------------------------------------------------- floor, ceil, round


def _rounding_samples(rng, dtype) -> np.ndarray:
    """Halves (ties), values near integers, large ones, signed zeros, infinities, NaN; no subnormals (XLA on CPU
    flushes them)."""
    halves = rng.integers(-40, 40, 48) + 0.5
    near = rng.integers(-40, 40, 48) + rng.choice([-1e-2, -1e-3, 0.0, 1e-3, 1e-2], 48)
    ordinary = rng.standard_normal(48) * 10.0 ** rng.integers(-3, 4, 48)
    special = [0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997, -0.49999997, np.inf, -np.inf, np.nan]
    special += [1e30, -1e30, 2.0**22 + 0.5, -(2.0**22) - 0.5, 2.0**23 + 1]
    x = rounded(np.concatenate([halves, near, ordinary, special]), DType.from_numpy(np.dtype(dtype)))
    tiny = float(jnp.finfo(dtype).tiny)
    return x[~((np.abs(x.astype(np.float64)) < tiny) & (x != 0))]


INF_MINUS_INF = pytest.mark.filterwarnings(
    "ignore:invalid value encountered in subtract:RuntimeWarning"
)  # x - trunc(x)


@INF_MINUS_INF
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_floor_ceil_and_both_rounding_methods_are_bit_exact(rng, dtype):
    """``lax.round`` rounds halves away from zero (its default), ``jnp.round`` and ``TO_NEAREST_EVEN`` to even."""
    x = _rounding_samples(rng, jnp.dtype(dtype))
    even = lax.RoundingMethod.TO_NEAREST_EVEN
    imported = _check(
        lambda x: (jnp.floor(x), jnp.ceil(x), lax.round(x), lax.round(x, even), jnp.round(x)), x, nan_payloads=True
    )
    assert {"floor", "ceil", "round"} <= set(_ops(imported.graph))
    halves = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5], jnp.dtype(dtype))
    away, nearest = (np.asarray(run(lower(from_jax(f, halves).graph, "numpy"), halves)) for f in (lax.round, jnp.round))
    np.testing.assert_array_equal(away.astype(np.float32), [1, 2, 3, -1, -2, -3])
    np.testing.assert_array_equal(nearest.astype(np.float32), [0, 2, 2, -0.0, -2, -2])


@INF_MINUS_INF
@FEW
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=24))
def test_rounding_away_from_zero_of_any_float32_bits(bits):
    x = np.array(bits, np.uint32).view(np.float32)
    x = x[~((np.abs(x) < np.finfo(np.float32).tiny) & (x != 0))]  # no subnormals
    if x.size:
        _check(lambda x: (lax.round(x), lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN)), x, nan_payloads=True)


# ----------------------------------------------------------------------------- pad

PADS = [
    [(1, 2, 0), (0, 0, 0)],
    [(-1, 0, 0), (2, -3, 0)],  # negative low/high crop
    [(0, 0, 2), (1, 1, 1)],  # interior
    [(-2, 1, 1), (-1, -1, 3)],  # crops of the interior-padded array
    [(3, -4, 0), (0, 0, 0)],
]


@pytest.mark.parametrize("config", PADS, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "bool"])
def test_pad_low_high_interior_and_crops(rng, config, dtype):
    x = rng.standard_normal((3, 4)).astype(jnp.dtype(dtype)) if dtype != "bool" else rng.random((3, 4)) < 0.5
    fill = np.array(True if dtype == "bool" else -7, jnp.dtype(dtype))
    _check(lambda x, fill: lax.pad(x, fill, config), x, fill)
    _check(lambda x: lax.pad(x, fill, config), x)  # the padding value a literal


def test_jnp_pad_and_a_causal_conv_left_pad(rng):
    """``jnp.pad`` (constant mode) and the left pad of a causal convolution's input (gemma's/Mamba's)."""
    x = rng.standard_normal((2, 5, 3)).astype(np.float32)
    _check(lambda x: jnp.pad(x, ((0, 0), (3, 0), (0, 0))), x)
    _check(lambda x: jnp.pad(x, ((1, 1), (0, 2), (2, 0)), constant_values=1.5), x)


@FEW
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    data=st.data(),
)
def test_pad_of_any_shape_and_config(shape, data):
    config = [
        (data.draw(st.integers(-n, 3)), data.draw(st.integers(-n, 3)), data.draw(st.integers(0, 2))) for n in shape
    ]
    for axis, (low, high, interior) in enumerate(config):  # JAX's own rule: a size >= 0
        size = shape[axis] + max(shape[axis] - 1, 0) * interior
        if size + low + high < 0:
            config[axis] = (0, 0, interior)
    x = np.arange(math.prod(shape), dtype=np.int32).reshape(shape)
    _check(lambda x: lax.pad(x, np.int32(-1), config), x)


# ----------------------------------------------------------------------------- top_k


def test_top_k_ties_go_to_the_lower_index():
    """Equal values: lower index first (JAX's documented order), in values and indices."""
    x = np.array([[3, 1, 3, 2, 1, 3], [0, 0, 0, 0, 0, 0]], np.int32)
    imported = _check(lambda x: lax.top_k(x, 4), x)
    assert {"argtopk", "take_along_axis"} <= set(_ops(imported.graph))
    values, indices = run(lower(imported.graph, "numpy"), x)
    np.testing.assert_array_equal(indices, [[0, 2, 5, 3], [0, 1, 2, 3]])
    np.testing.assert_array_equal(values, [[3, 3, 3, 2], [0, 0, 0, 0]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_top_k_orders_floats_totally(dtype):
    """+NaN first, then +inf ... +0.0 before -0.0 ... -inf, -NaN last; equal bits by lower index."""
    row = np.array([1.0, np.nan, 2.0, -0.0, 0.0, -np.nan, -np.inf, np.inf, 0.0, -0.0, 2.0, 1.0], np.float32)
    x = np.stack([row, row[::-1]]).astype(jnp.dtype(dtype))
    _check(lambda x: lax.top_k(x, 12), x)
    _check(lambda x: lax.top_k(x, 5), x)


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_top_k_along_another_axis_and_of_every_size(rng, k):
    """``lax.top_k(x, k, axis=0)``, ``k`` from 0 to the whole axis; MoE routing's ``top_k`` of gate logits."""
    x = rng.integers(-2, 3, (5, 3, 4)).astype(np.float32)
    _check(lambda x: lax.top_k(x, k, axis=0), x)
    gates = rng.standard_normal((2, 3, 8)).astype(np.float32)
    _check(lambda g: lax.top_k(jax.nn.softmax(g, axis=-1), 2)[1], gates)


@settings(max_examples=8, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    data=st.data(),
)
def test_top_k_of_any_shape_with_many_ties(shape, data):
    axis = data.draw(st.integers(0, len(shape) - 1))
    k = data.draw(st.integers(0, shape[axis]))
    values = data.draw(st.lists(st.integers(-2, 2), min_size=math.prod(shape), max_size=math.prod(shape)))
    x = np.array(values, np.float32).reshape(shape)
    _check(lambda x: lax.top_k(x, k, axis=axis), x)
    _check(lambda x: lax.top_k(x.astype(jnp.int32), k, axis=axis), x)


def test_argtopk_shape_rule_and_builder():
    spec = TensorSpec((2, 5), "float32")
    assert trace(lambda x: ops.argtopk(x, 3), spec).node("argtopk").type == TensorType((2, 3), "int32")
    with pytest.raises(ShapeError, match=r"argtopk: k=6 out of range for axis -1 of f32\[2,5\] \(need 0 <= k <= 5\)"):
        trace(lambda x: ops.argtopk(x, 6), spec)
    with pytest.raises(ShapeError, match=r"argtopk: operand has dtype bool"):
        trace(lambda x: ops.argtopk(x, 1), TensorSpec((2,), "bool"))
    graph = one_op_graph("argtopk", [TensorType((4, 3), "int32")], {"k": 2, "axis": 0})
    x = np.array([[1, 5, 5], [5, 1, 5], [5, 5, 1], [0, 5, 5]], np.int32)
    for target in EVERY:
        np.testing.assert_array_equal(run(lower(graph, target), x), [[1, 0, 0], [2, 2, 1]])


# ----------------------------------------------------------------------------- dead equations, keys, errors


def test_dead_equations_are_skipped_before_a_rule_can_refuse_them(rng):
    """A dead scatter-add (a length counter), a dead ``sort`` and the dead output of an inlined ``jit`` are
    unsupported primitives nobody reads: the import skips them, and a captured array only they read is no input."""
    x = rng.standard_normal((2, 6)).astype(np.float32)
    table = rng.standard_normal((16, 6)).astype(np.float32)  # 96 elements: would be a resident input

    @jax.jit
    def both(x):
        return x + 1, jnp.sort(x @ table.T, axis=-1)

    def fn(x, lengths):
        lengths = lengths.at[0].add(1)
        _ = jnp.sort(x * table[:2], axis=-1)
        kept, _unused = both(x)
        return jnp.abs(kept)

    lengths = np.zeros((3,), np.int32)
    imported = _check(fn, x, lengths)
    assert _ops(imported.graph) == ["constant", "add", "abs"] and not imported.params
    assert imported.graph.inputs == ("x", "lengths")


def test_an_input_only_the_dead_outputs_of_a_call_read_is_not_imported(rng):
    """JAX's own dead-code elimination looks into calls: a key threaded through a ``checkpoint``'d layer (as nnx
    threads its RNG streams through MaxText's layers), whose result only the call's dead outputs carry, is dropped
    with everything that computes it (the key's ``random_seed`` and ``random_fold_in`` have no rule)."""
    x = rng.standard_normal((2, 6)).astype(np.float32)

    @jax.checkpoint
    def layer(x, key):
        return jnp.abs(x) - 1, jax.random.fold_in(key, 1), jax.random.normal(key, x.shape)

    def fn(x):
        key = jax.random.key(0)
        h, key, _noise = layer(x, key)
        h, _key, _noise = layer(h, key)
        return h * 2

    imported = _check(fn, x)
    assert imported.graph.inputs == ("x",) and not imported.params
    assert sorted(set(_ops(imported.graph))) == ["abs", "constant", "mul", "sub"]


def test_a_shard_map_over_one_device_is_its_body(rng):
    """``jax.shard_map`` over a one-device mesh (EasyDeL's ``attn_mechanism="sdpa"`` wraps its attention in one):
    the body sees the whole arrays, so it is imported in place (its ``pvary`` an identity), bit for bit; over a
    mesh of two devices the body computes one shard: declined, naming the mesh."""
    from jax.sharding import PartitionSpec

    x = rng.standard_normal((2, 4)).astype(np.float32)
    spec = PartitionSpec(None, "model")

    def on(mesh):
        return jax.shard_map(lambda x: jnp.abs(x) * 2, mesh=mesh, in_specs=spec, out_specs=spec)

    imported = _check(on(_one_device_mesh()), x)
    assert {"abs", "mul"} <= set(_ops(imported.graph)) <= {"abs", "mul", "constant", "cast"}  # jax 0.12 casts the 2
    with pytest.raises(ModelImportError, match=r"shard_map over AbstractMesh\('model': 2.*one of 2 shards"):
        from_jax(on(_auto_mesh({"model": 2})), x)


def _ramp_table():
    """EasyDeL's yarn RoPE ramp (``_yarn_linear_ramp_mask``): its top nudged by a ``lax.cond`` where it equals its
    bottom, in a ``jit`` of no operand."""
    low, high = jnp.floor(jnp.float32(1.7)), jnp.ceil(jnp.float32(5.2))
    high = lax.cond(low == high, lambda h: h + 0.001, lambda h: h, high)
    return jnp.clip((jnp.arange(8, dtype=jnp.float32) - low) / (high - low), 0, 1)


@pytest.mark.parametrize("index", [-3, 0, 1, 2, 5])
def test_cond_and_switch_are_every_branch_and_a_select(rng, index):
    """``lax.cond`` on a constant (EasyDeL's yarn ramp) or on an argument and ``lax.switch`` of three branches, an
    index out of range included: each branch imported, the index's result chosen by ``where``, bit for bit on
    every target; a branch output nobody reads is not imported."""
    x = rng.standard_normal((3, 8)).astype(np.float32)
    i = np.int32(index)
    table = jax.jit(_ramp_table)
    imported = _check(lambda x: x * table(), x)
    assert "where" in _ops(imported.graph)
    _check(lambda x, i: lax.cond(i > 0, lambda y: (y + 1, y * 3), lambda y: (y * 2, -y), x), x, i)
    branches = [lambda y: y * y, lambda y: y * 2, lambda y: -y]
    _check(lambda x, i: lax.switch(i, branches, x), x, i)
    raw = _check(lambda x, i: lax.cond_p.bind(i, x, branches=tuple(jax.make_jaxpr(f)(x) for f in branches)), x, i)
    assert _ops(raw.graph).count("where") == 2
    first = _check(lambda x, i: lax.cond(i > 0, lambda y: (y + 1, jnp.sort(y)), lambda y: (y, y), x)[0], x, i)
    assert "sort" not in str(first.graph)


@pytest.mark.parametrize("mode", [None, "clip", "drop"])
def test_scatter_add_of_one_window_adds_where_the_window_fits(rng, mode):
    """``x.at[i].add(u)`` of one window (MaxText's cache length counters, a row of a cache): bit for bit, a window
    past the end dropped (``FILL_OR_DROP``, the default) or its index clamped (``clip``); the whole operand with
    no index (``lengths.at[:].add(1)``)."""
    x = rng.standard_normal((5, 4)).astype(np.float32)
    row = rng.standard_normal((4,)).astype(np.float32)
    part = rng.standard_normal((3,)).astype(np.float32)
    for i in (np.int32(1), np.int32(4), np.int32(7), np.int32(-1)):
        _check(lambda x, row, i: x.at[i].add(row, mode=mode), x, row, i)
        _check(lambda x, part, i: x.at[i, 1:].add(part, mode=mode), x, part, i)
    lengths = np.array([3, 0, 7], np.int32)
    imported = _check(lambda n: n.at[:].add(1), lengths)
    assert "scatter" not in " ".join(_ops(imported.graph))


def test_scatter_add_of_several_windows_is_declined_by_name(rng):
    x = np.zeros((5,), np.float32)
    with pytest.raises(ModelImportError, match=r"scatter-add of indices \[3, 1\].*only one window"):
        from_jax(lambda x: x.at[np.array([0, 2, 2])].add(1.0), x)


def test_a_live_unsupported_primitive_is_one_error_naming_it(rng):
    x = np.zeros((3,), np.int32)
    with pytest.raises(ModelImportError) as err:
        from_jax(lambda n: jnp.sort(n), x)
    message = str(err.value)
    assert message.startswith("unsupported JAX primitive sort; the JAX importer supports ")
    assert "top_k" in message and "pad" in message and "sharding_constraint" in message and "equation #" in message


def test_a_prng_key_input_is_declined_by_name(rng):
    x = rng.standard_normal((3,)).astype(np.float32)
    key = jax.random.key(0)
    with pytest.raises(ModelImportError, match=r"input key is a PRNG key array \(key<fry>\[\].*no key type"):
        from_jax(lambda x, key: x + jax.random.normal(key, x.shape), x, key)
    with pytest.raises(ModelImportError, match=r"input keys\[0\] is a PRNG key array"):
        from_jax(lambda x, keys: x * 2, x, [key, key])
    with pytest.raises(ModelImportError, match=r"captured array .* is a PRNG key array"):
        from_jax(lambda x: x + jax.random.normal(key, x.shape), x)
