"""from_jax: the KV-cache idioms of JAX code (``dynamic_update_slice``, ``dynamic_slice``, ``x.at[...].set``
scatters) import exactly, and flax nnx decode-mode attention imports, raises and computes what the module does."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import ModelImportError, from_jax
from attnpass.lowering import lower
from attnpass.passes import PassManager, parse_pipeline
from tests.util import assert_bits_equal, assert_close, lazy_import, requires

pytestmark = requires("jax", "mlx.core")
jax = lazy_import("jax")
jnp = lazy_import("jax.numpy")
lax = lazy_import("jax.lax")

# (name, function of (cache, row, index), the IR op that must carry it)
IDIOMS = [
    ("at-set", lambda c, k, i: c.at[:, i].set(k), "dynamic_update_slice"),
    ("at-set-clip", lambda c, k, i: c.at[:, i].set(k, mode="clip"), "dynamic_update_slice"),
    ("at-set-promise", lambda c, k, i: c.at[:, i].set(k, mode="promise_in_bounds"), "dynamic_update_slice"),
    ("at-set-point", lambda c, k, i: c.at[0, i, 1].set(k[0, 0]), "dynamic_update_slice"),
    ("update", lambda c, k, i: lax.dynamic_update_slice(c, k[:, None], (0, i, 0, 0)), "dynamic_update_slice"),
    ("update_in_dim", lambda c, k, i: lax.dynamic_update_slice_in_dim(c, k[:, None], i, 1), "dynamic_update_slice"),
    ("dynamic_slice", lambda c, k, i: lax.dynamic_slice(c, (0, i, 0, 1), (1, 2, 2, 2)) + k[:, :1, :2], "take"),
    ("slice_in_dim", lambda c, k, i: lax.dynamic_slice_in_dim(c, i, 3, axis=1) * k[:, None], "take"),
]


@pytest.mark.parametrize("index", [-5, -4, -1, 0, 2, 3, 4, 7])
@pytest.mark.parametrize("name, fn, op", IDIOMS, ids=[i[0] for i in IDIOMS])
def test_cache_idioms_are_exact_on_every_target_in_and_out_of_bounds(rng, name, fn, op, index):
    """Bit for bit what jax.jit computes, on all three targets: negative indices wrap (JAX's own select),
    out-of-bounds ones are clamped (dynamic slices, mode="clip") or drop the write (.at[].set's default)."""
    cache = rng.standard_normal((1, 4, 2, 3)).astype(np.float32)
    row = rng.standard_normal((1, 2, 3)).astype(np.float32)
    i = np.int32(index)
    imported = from_jax(fn, cache, row, i)
    assert op in [n.op for n in imported.graph.nodes()]
    expected = np.asarray(jax.jit(fn)(cache, row, i))
    for target in ("numpy", "mlx", "jax"):
        assert_bits_equal(run(lower(imported.graph, target), cache, row, i, **imported.params), expected)


IN_RANGE = [("two", [1, 4]), ("three", [5, 0, 2]), ("negative", [-1, 3]), ("2d", [[0, 1], [4, 5]])]
OUT_OF_RANGE = [("past-end", [6, 2]), ("out", [9, -8])]  # promise_in_bounds: a broken promise, not compared
ROW_CASES = [(name, p, mode) for name, p in IN_RANGE for mode in (None, "clip", "promise_in_bounds")]
ROW_CASES += [(name, p, mode) for name, p in OUT_OF_RANGE for mode in (None, "clip")]


@pytest.mark.parametrize("name, positions, mode", ROW_CASES, ids=[f"{c[0]}-{c[2]}" for c in ROW_CASES])
def test_rows_written_at_positions_are_exact_on_every_target(rng, name, positions, mode):
    """cache.at[:, positions].set(rows): one put_along_axis; negative positions wrap, out-of-range rows are
    dropped (clamped with mode="clip"), bit for bit what jax.jit computes. Positions are distinct (JAX leaves
    which of two writes to one row wins unspecified, and so does the IR)."""
    positions = np.asarray(positions, np.int32)
    cache = rng.standard_normal((2, 6, 3)).astype(np.float32)
    rows = rng.standard_normal((2, *positions.shape, 3)).astype(np.float32)

    def write(c, r, p):
        return c.at[:, p].set(r, mode=mode)

    imported = from_jax(write, cache, rows, positions)
    assert [n.op for n in imported.graph.nodes()].count("put_along_axis") == 1
    expected = np.asarray(jax.jit(write)(cache, rows, positions))
    for target in ("numpy", "mlx", "jax"):
        assert_bits_equal(run(lower(imported.graph, target), cache, rows, positions, **imported.params), expected)


POINTS = [("in-range", [[0, 3, 5], [1, 2, 4]]), ("wraps", [[-1, 0, 2], [1, -6, 3]])]
POINTS_OUT = [("slot-past-end", [[0, 6, 2], [1, 9, 3]]), ("negative-out", [[0, -7, 1], [1, 2, -9]])]
POINT_CASES = [(name, p, mode) for name, p in POINTS for mode in (None, "clip", "promise_in_bounds")]
POINT_CASES += [(name, p, mode) for name, p in POINTS_OUT for mode in (None, "clip")]


@pytest.mark.parametrize("name, slots, mode", POINT_CASES, ids=[f"{c[0]}-{c[2]}" for c in POINT_CASES])
def test_rows_written_at_points_of_two_axes_are_exact_on_every_target(rng, name, slots, mode):
    """Gemma 4's cache write ``cache.at[batch, slots].set(rows)`` (points over the batch and slot axes; also over
    two inner axes): one put_along_axis over the two axes flattened, bit for bit what jax.jit computes; a point
    out of either axis dropped, or each coordinate clamped (mode="clip")."""
    slots = np.array(slots, np.int32)
    cache = rng.standard_normal((2, 6, 2, 3)).astype(np.float32)
    rows = rng.standard_normal((2, 3, 2, 3)).astype(np.float32)
    batch = np.arange(2, dtype=np.int32)[:, None] * np.ones((1, 3), np.int32)

    def write(c, r, b, s):
        return c.at[b, s].set(r, mode=mode)

    def inner(c, r, b, s):  # the same points over axes 1 and 2 of a (3, 2, 6, 4) operand
        return c.at[:, b, s].set(r, mode=mode)

    inner_cache = rng.standard_normal((3, 2, 6, 4)).astype(np.float32)
    inner_rows = rng.standard_normal((3, 2, 3, 4)).astype(np.float32)
    for fn, args in ((write, (cache, rows, batch, slots)), (inner, (inner_cache, inner_rows, batch, slots))):
        imported = from_jax(fn, *args)
        assert [n.op for n in imported.graph.nodes()].count("put_along_axis") == 1
        expected = np.asarray(jax.jit(fn)(*args))
        for target in ("numpy", "mlx", "jax"):
            assert_bits_equal(run(lower(imported.graph, target), *args, **imported.params), expected)


def test_a_scatter_of_partial_windows_is_declined_by_name(rng):
    cache = rng.standard_normal((1, 6, 3)).astype(np.float32)
    rows = rng.standard_normal((2, 2)).astype(np.float32)
    positions = np.array([[0, 1], [0, 4]], np.int32)
    message = r"(?s)scatter of indices \[2, 3\].*only as whole rows along the scattered axes.*equation #\d+ scatter"
    with pytest.raises(ModelImportError, match=message):
        from_jax(lambda c, r, p: c.at[p[:, 0], p[:, 1], :2].set(r), cache, rows, positions)


SLOTS = [("in-range", [3, 0, 9]), ("past-end", [12, 14, 5]), ("negative", [-2, -20, 1])]


def _vmapped_write(old, new, slot):
    """EasyDeL's cache write (``TransformerCacheView``): each sequence's new rows at its own slot, a vmapped
    ``dynamic_update_slice`` (a scatter with operand batching dims, mode ``CLIP``)."""
    return jax.vmap(lambda o, n, s: lax.dynamic_update_slice(o, n, (s, 0, 0)))(old, new, slot)


def _vmapped_read(mask, start):
    """ejkernel's ``MaskInfo.apply_kv_lengths``: each sequence's query rows at its own start, a vmapped
    ``dynamic_slice`` (a gather with operand batching dims)."""
    return jax.vmap(lambda m, s: lax.dynamic_slice(m, (0, s, 0), (1, 2, m.shape[-1])))(mask, start)


@pytest.mark.parametrize("name, slots", SLOTS, ids=[c[0] for c in SLOTS])
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_a_vmapped_cache_write_and_read_are_exact_per_sequence(rng, name, slots, dtype):
    """One window per batch element, each at its own index (clamped where it does not fit, as
    ``dynamic_update_slice`` / ``dynamic_slice`` clamp): bit for bit what jax.jit computes on every target, the
    writes one ``dynamic_update_slice`` per sequence, the reads one ``take``."""
    dtype = jnp.dtype(dtype)
    old = rng.standard_normal((3, 16, 2, 4)).astype(dtype)
    new = rng.standard_normal((3, 5, 2, 4)).astype(dtype)
    slot = np.asarray(slots, np.int32)
    assert "operand_batching_dims=(0,)" in str(jax.make_jaxpr(_vmapped_write)(old, new, slot))
    mask = rng.standard_normal((3, 1, 16, 16)) > 0
    cases = ((_vmapped_write, (old, new, slot), "dynamic_update_slice", 3), (_vmapped_read, (mask, slot), "take", 3))
    for fn, args, op, count in cases:
        imported = from_jax(fn, *args)
        assert [n.op for n in imported.graph.nodes()].count(op) == count
        expected = np.asarray(jax.jit(fn)(*args))
        for target in ("numpy", "mlx", "jax"):
            assert_bits_equal(run(lower(imported.graph, target), *args, **imported.params), expected)


def test_a_vmapped_write_of_several_windows_per_sequence_is_declined_by_name(rng):
    """Two windows per sequence (a vmapped ``.at[positions].set``): not one window per batch element."""
    cache = rng.standard_normal((2, 8, 3)).astype(np.float32)
    rows = rng.standard_normal((2, 2, 3)).astype(np.float32)
    positions = np.array([[0, 4], [1, 5]], np.int32)
    message = r"(?s)operand batching dims \(0,\).*only one window per batch element.*equation #\d+ scatter"
    with pytest.raises(ModelImportError, match=message):
        from_jax(jax.vmap(lambda c, r, p: c.at[p].set(r)), cache, rows, positions)


def _decode_module(dtype: str):
    """A flax nnx MultiHeadAttention(decode=True) whose cache already holds 3 tokens, as (graphdef, state)."""
    from flax import nnx

    jdtype = {"f32": jnp.float32, "bf16": jnp.bfloat16}[dtype]
    module = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=True, dtype=jdtype, param_dtype=jdtype, rngs=nnx.Rngs(0)
    )
    module.init_cache((1, 6, 8), dtype=jdtype)
    graphdef, state = nnx.split(module)
    tokens = np.random.default_rng(1).standard_normal((3, 1, 1, 8)).astype(jdtype)
    for token in tokens:  # prefill the cache token by token through the module itself
        _y, state = jax.jit(lambda s, x: _step(graphdef, s, x))(state, token)
    return graphdef, state


def _step(graphdef, state, x):
    from flax import nnx

    module = nnx.merge(graphdef, state)
    return module(x), nnx.state(module)


@requires("flax")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_flax_nnx_decode_attention_imports_raises_and_matches_the_module(dtype):
    """One decode step (the cache and its index are inputs, the updated ones outputs): raise-attention finds the
    sdpa over the updated cache; every output of the raised graph matches the module's jitted step."""
    graphdef, state = _decode_module(dtype)
    x = np.random.default_rng(2).standard_normal((1, 1, 8)).astype(jnp.bfloat16 if dtype == "bf16" else np.float32)

    def step(state, x):
        return _step(graphdef, state, x)

    imported = from_jax(step, state, x)
    assert [n.op for n in imported.graph.nodes()].count("dynamic_update_slice") == 2  # keys and values
    raised = PassManager(parse_pipeline("raise-attention")).run(imported.graph).graph
    (sdpa,) = [n for n in raised.nodes() if n.op == "sdpa"]
    assert raised.node(sdpa.inputs[1]).type.shape == (1, 2, 6, 4)  # all 6 cache slots, the mask hides the empty ones
    leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves((state, x))]
    expected = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(jax.jit(step)(state, x))]
    for target in ("numpy", "jax", "mlx"):
        got = run(lower(raised, target), *leaves, **imported.params)
        assert len(got) == len(expected)
        for a, e in zip(got, expected):
            assert_close(a, e)


@requires("flax")
def test_flax_decode_through_a_captured_state_imports_and_raises():
    """The module merged inside the function from a captured state: flax's writes back to that module copy are
    equations whose results nothing reads, left out; the step raises and matches the module."""
    from flax import nnx

    graphdef, state = _decode_module("f32")
    x = np.random.default_rng(3).standard_normal((1, 1, 8)).astype(np.float32)

    def decode(x):
        return nnx.merge(graphdef, state, copy=True)(x)

    imported = from_jax(decode, x)
    raised = PassManager(parse_pipeline("raise-attention")).run(imported.graph).graph
    assert [n.op for n in raised.nodes()].count("sdpa") == 1
    assert_close(run(lower(raised, "numpy"), x, **imported.params), np.asarray(jax.jit(decode)(x)))


def _equinox_decoder(write: str):
    """An equinox module with its KV cache in ``eqx.nn.State``, equinox's way: ``eqx.nn.Linear`` projections (vmapped
    over the tokens), the new key and value rows written at the cache index (``write``:
    ``lax.dynamic_update_slice_in_dim`` or ``.at[i].set``), attention over every slot with the ones past the index
    filled with the dtype's min (as ``eqx.nn.MultiheadAttention`` masks)."""
    import equinox as eqx

    slots, heads, size = 6, 2, 4

    def put(cache, rows, i):
        if write == "dynamic_update_slice":
            return lax.dynamic_update_slice_in_dim(cache, rows, i, axis=0)
        return cache.at[i].set(rows[0])

    class Decoder(eqx.Module):
        q: eqx.nn.Linear
        k: eqx.nn.Linear
        v: eqx.nn.Linear
        cache: eqx.nn.StateIndex

        def __init__(self, key):
            kq, kk, kv = jax.random.split(key, 3)
            self.q, self.k, self.v = (eqx.nn.Linear(heads * size, heads * size, key=k) for k in (kq, kk, kv))
            empty = jnp.zeros((slots, heads, size))
            self.cache = eqx.nn.StateIndex((empty, empty, jnp.zeros((), jnp.int32)))

        def __call__(self, x, state):  # x: [1, features], one token
            keys, values, i = state.get(self.cache)
            q, k, v = (jax.vmap(proj)(x).reshape(1, heads, size) for proj in (self.q, self.k, self.v))
            keys, values = put(keys, k, i), put(values, v, i)
            scores = jnp.einsum("shd,thd->hst", q, keys) / np.sqrt(size)
            scores = jnp.where(jnp.arange(slots) <= i, scores, jnp.finfo(scores.dtype).min)
            y = jnp.einsum("hst,thd->shd", jax.nn.softmax(scores, axis=-1), values)
            return y, state.set(self.cache, (keys, values, i + 1))

    return eqx.nn.make_with_state(Decoder)(jax.random.PRNGKey(0))


@requires("equinox")
@pytest.mark.parametrize("write", ["dynamic_update_slice", "at-set"])
def test_equinox_state_cache_writes_import_raise_and_match_the_module(write):
    """A decode step of an equinox module whose KV cache is an ``eqx.nn.State`` (two tokens in, then the step):
    both writes are ``dynamic_update_slice``; raise-attention finds the sdpa over the written cache; every output
    (the attention and the new state) matches the module's jitted step."""
    module, state = _equinox_decoder(write)
    rng = np.random.default_rng(4)
    step = jax.jit(lambda state, x: module(x, state))
    for _ in range(2):
        _y, state = step(state, rng.standard_normal((1, 8)).astype(np.float32))
    x = rng.standard_normal((1, 8)).astype(np.float32)

    def decode(state, x):
        return module(x, state)

    imported = from_jax(decode, state, x)
    assert [n.op for n in imported.graph.nodes()].count("dynamic_update_slice") == 2  # keys and values
    raised = PassManager(parse_pipeline("raise-attention")).run(imported.graph).graph
    (sdpa,) = [n for n in raised.nodes() if n.op == "sdpa"]
    assert raised.node(sdpa.inputs[1]).type.shape[-2] == 6  # every cache slot, the mask hides the empty ones
    leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves((state, x))]
    expected = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(step(state, x))]
    assert int(expected[-1]) == 3  # the step advanced the index
    for target in ("numpy", "jax", "mlx"):
        got = run(lower(raised, target), *leaves, **imported.params)
        assert len(got) == len(expected)
        for a, e in zip(got, expected):
            assert_close(a, e)


@requires("flax")
def test_the_issues_flax_decode_step_lowers_to_jax_and_mlx_after_import_and_canonicalize():
    """Issue 32's repro: nnx.MultiHeadAttention(decode=True), 8 heads of 256 features, a 64-slot cache with 40
    filled. Lowering the import to JAX or MLX raised IndexError in the constant emitter (an empty constant; the
    emitter's own test is tests/lowering/test_codegen.py's); every output matches the module's jitted step,
    imported as it is and after canonicalize."""
    from flax import nnx

    module = nnx.MultiHeadAttention(num_heads=8, in_features=256, qkv_features=256, decode=True, rngs=nnx.Rngs(0))
    module.init_cache((1, 64, 256))
    graphdef, state = nnx.split(module)
    prefill = jax.jit(lambda s, x: _step(graphdef, s, x))
    for token in np.random.default_rng(3).standard_normal((40, 1, 1, 256)).astype(np.float32):
        _y, state = prefill(state, token)
    x = np.random.default_rng(4).standard_normal((1, 1, 256)).astype(np.float32)

    def step(state, x):
        return _step(graphdef, state, x)

    imported = from_jax(step, state, x)
    canonical = PassManager(parse_pipeline("canonicalize")).run(imported.graph).graph
    leaves = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves((state, x))]
    expected = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(jax.jit(step)(state, x))]
    for graph in (imported.graph, canonical):
        for target in ("jax", "mlx"):
            got = run(lower(graph, target), *leaves, **imported.params)
            assert len(got) == len(expected)
            for a, e in zip(got, expected):
                assert_close(a, e)
