"""The qsa-pool-cache pass: a decode loop from a prefilled block-key cache equals re-pooling every step, bit for bit.

Small model: K = 8 blocks of ratio 4, n_kv = 96 (24 blocks). The raw indexer-key cache holds the true
keys up to the current position and zeros beyond (a real cache before those cells are written), so a
block the cache missed or pooled too early would change the scores.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import Graph, TensorSpec, ops, parse_graph, trace
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, make_inputs, narrowed_inputs, padded_mask
from attnpass.passes import DeadCodeElimination, PassManager, QSAPoolCache, parse_pipeline
from attnpass.passes.rewrites.qsa_pool_cache import STORES, XLA_ROW_REDUCTION_ELEMENTS
from tests.fuzz.families import Case
from tests.passes.claims import audit, check_remarks, fuzzed
from tests.util import assert_bits_equal, lazy_import, requires, target_params

jax = lazy_import("jax")

SMALL = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=32, mask_rows=4, rotary_dim=8)
DIM_32 = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=32, budget=32, mask_rows=4, rotary_dim=16)
MODEL_INDEXER = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, budget=32, mask_rows=4)  # indexer 4 x 128, RoPE 64
N_KV, R = 96, SMALL.ratio


def cache_pipeline(**options) -> PassManager:
    return PassManager([QSAPoolCache(**options), DeadCodeElimination()])


def remark_of(result, kind: str = "declined") -> str:
    (remark,) = [r for r in result.remarks if r.pass_name == "qsa-pool-cache"]
    assert remark.kind == kind, str(remark)
    return remark.message


def reason_of(result) -> str:
    """The reason code of the pass's one decline."""
    (remark,) = [r for r in result.remarks if r.pass_name == "qsa-pool-cache"]
    assert remark.kind == "declined" and result.graph.node(remark.node).op == "qsa_block_scores", str(remark)
    return remark.reason


def step_function(graph: Graph, target: str):
    """Inputs by name -> a tuple of numpy outputs; JAX runs under jax.jit (a stateful program is jitted by lowering)."""
    program = lower(graph, target)
    if target == "jax" and not graph.state_pairs():
        program.fn = jax.jit(program.fn)

    def call(**kw):
        out = run(program, **kw)
        return out if isinstance(out, tuple) else (out,)

    return program, call


def decode_loop(
    target: str, *, batch: int, rows: int, steps: int, cfg: QSAConfig = SMALL, store: str = "keys", padded=None
) -> None:
    """Run the cached and the re-pooling layer side by side; compare selections, outputs and the cache bit for bit.

    ``padded``: the shape the one-block replay must run over (which of XLA's row-reduction regimes it is in).
    """
    masked = build_layer(cfg, N_KV, batch=batch, rows=rows)
    masked.set_outputs([*masked.outputs, "qsa_select"])
    cached = cache_pipeline(store=store).run(masked).graph
    if padded is not None:
        assert str(cached.node("mul_new").type) == padded  # RMSNorm's x * x over the padded block
        assert str(cached.node("mul_1_new_row").type) == f"f32[1,1,{cfg.idx_dim}]"  # x * rsqrt on the row alone
    _, run_masked = step_function(masked, target)
    program, run_cached = step_function(cached, target)
    rng = np.random.default_rng(rows * 10 + batch)
    base = make_inputs(cfg, N_KV, np.zeros((batch, rows), np.int32), seed=rows)
    history = rng.integers(38, 46, size=batch)  # tokens already in the cache per stream
    keys = base["idx_keys"].copy()
    raw = np.where(np.arange(N_KV)[None, :, None] < history[:, None, None], keys, 0).astype(np.float32)
    prefill = QSAPoolCache(store=store).prefill(masked)
    _, run_prefill = step_function(prefill, target)
    state = dict(zip(prefill.outputs, run_prefill(**{n: raw if n == "idx_keys" else base[n] for n in prefill.inputs})))
    assert list(state) == [name for name, _ in cached.state_pairs()]
    blocks_crossed = set()
    for step in range(steps):
        positions = (history[:, None] + step * rows + np.arange(rows)[None]).astype(np.int32)
        for b in range(batch):
            raw[b, positions[b]] = keys[b, positions[b]]  # this step's tokens enter the raw cache first
        blocks_crossed |= {int(p) // R for p in positions.ravel()}
        inputs = dict(base, idx_keys=raw.copy(), positions=positions, mask=padded_mask(cfg, positions, N_KV))
        inputs["q"] = rng.standard_normal(base["q"].shape, dtype=np.float32)
        inputs["idx_q"] = rng.standard_normal(base["idx_q"].shape, dtype=np.float32)
        out_masked, sel_masked = run_masked(**narrowed_inputs(masked, inputs))
        outs = run_cached(**narrowed_inputs(cached, {**inputs, **state}))
        assert_bits_equal(outs[1], sel_masked)
        assert_bits_equal(outs[0], out_masked)
        state = program.next_state(outs)
        # the selections rarely see a last-bit difference in a block key: compare the cache itself, every block
        # (complete or not), with the prefill over the raw cache as it now stands
        for name, want in zip(
            prefill.outputs, run_prefill(**{n: raw if n == "idx_keys" else base[n] for n in prefill.inputs})
        ):
            assert_bits_equal(state[name], want)
    assert len(blocks_crossed) >= 4 and max(history) + steps * rows > cfg.top_k_blocks * R  # selections drop blocks


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
def test_decode_loop_equals_repooling_bit_for_bit(target, store):
    decode_loop(target, batch=2, rows=1, steps=3 * R + 1, store=store)


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
def test_decode_loop_at_the_model_indexer_dims(target, store):
    decode_loop(target, batch=1, rows=1, steps=3 * R + 1, cfg=MODEL_INDEXER, store=store)


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
def test_verify_loop_with_several_rows_per_step(target):
    decode_loop(target, batch=1, rows=3, steps=6)


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize(
    "cfg, batch, padded",
    [
        (SMALL, 2, "f32[2,24,16]"),  # 2 x 24 x 16 < 4,096 elements: XLA's small-reduction regime, the cache's shape
        (MODEL_INDEXER, 1, "f32[1,24,128]"),  # 24 x 128 < 4,096: the small regime at the model's head dim
        (MODEL_INDEXER, 2, "f32[1,32,128]"),  # 48 x 128 >= 4,096: the large regime (a real cache), 32 rows of 128
        (DIM_32, 2, "f32[2,24,32]"),  # indexer head dim 32: every op run padded broke the bits on jax 0.10.2 too
    ],
    ids=["small-dims", "model-dims-small-regime", "model-dims-large-regime", "dim-32"],
)
def test_storing_the_block_keys_is_exact_in_both_xla_reduction_regimes(target, cfg, batch, padded):
    """The newest block's sums, run over a zero-padded shape, round as among all blocks (XLA_ROW_REDUCTION_ELEMENTS).

    Without the padding, JAX's cache differs from a fresh prefill in the last bit at the model's dims. With every op
    of the chain run padded (not only the sums), XLA vectorized the padded RoPE without the FMA its loops over the
    whole cache contract: the cache differed from the prefill in the last bits at dim 32 (jax 0.10.2, 0.11.2 and
    0.12.1) and at the small dims (0.12.1).
    """
    decode_loop(target, batch=batch, rows=1, steps=3 * R + 1, cfg=cfg, store="keys", padded=padded)


def test_rewrite_adds_one_state_pair_and_says_what_changed():
    masked = build_layer(SMALL, N_KV)
    result = cache_pipeline(store="pooled").run(masked)
    graph = result.graph
    assert graph.state_pairs() == (("idx_keys_blocks", 1),)
    assert str(graph.node("idx_keys_blocks").type) == "f32[1,24,16]"
    assert graph.input_role("idx_keys_blocks") == "resident"
    assert "qsa_pool" not in {n.op for n in graph.nodes() if n.type.shape[-2:] == (24, 16)}  # no whole-cache pool
    assert [n.op for n in graph.nodes()].count("dynamic_update_slice") == 1
    message = remark_of(result, "applied")
    for part in (
        "pooled keys (qsa_pool of idx_keys) now come from the new resident input idx_keys_blocks:f32[1,24,16], "
        "1,536 bytes, whose next value is output #1",
        "1 block(s) of 4 rows (256 bytes) are pooled and written instead of all 96 rows of idx_keys (6,144 bytes)",
        "5,888 bytes no longer read; 17 row-wise op(s) (add, concat, div, mul, rsqrt, slice, sub, sum) up to the "
        "block keys concat still run over all 24 blocks",
    ):
        assert part in message, message
    keys = cache_pipeline().run(masked)  # the default store
    assert "block keys concat (qsa_pool of idx_keys)" in remark_of(keys, "applied")
    assert (
        "17 row-wise op(s) (add, concat, div, mul, rsqrt, slice, sub, sum) up to the block keys run on the new "
        "block(s) only, not on 24 (each new block's sums run over it as row 0 of [1, 24] rows, the rest zeros, so "
        "that XLA's CPU row reduction rounds them as over all [1, 24] blocks: XLA_ROW_REDUCTION_ELEMENTS; the other "
        "ops run on its row alone)" in remark_of(keys, "applied")
    )
    deep = cache_pipeline().run(build_layer(MODEL_INDEXER, 1024))  # 256 blocks of 128: padded to 32 rows, not 256
    assert "run over it as row 0 of [1, 32] rows" in remark_of(deep, "applied")
    assert "rsqrt" not in {n.op for n in deep.graph.nodes() if n.type.shape[:2] == (1, 256)}
    assert "qsa_pool" not in {n.op for n in deep.graph.nodes() if n.type.shape[:2] == (1, 256)}
    assert parse_graph(str(graph)) == graph
    assert Graph.from_json(graph.to_json()) == graph
    assert "return sdpa, idx_keys_blocks_next -> idx_keys_blocks" in str(graph)
    two = cache_pipeline().run(build_layer(SMALL, N_KV, batch=2))  # several (stream, row) blocks: one write
    assert [n.op for n in two.graph.nodes()].count("put_along_axis") == 1
    assert "dynamic_update_slice" not in {n.op for n in two.graph.nodes()}
    assert "written with one put_along_axis of all 2 rows' blocks" in remark_of(two, "applied")
    assert "written with one dynamic_update_slice" in message
    again = cache_pipeline(store="pooled").run(graph)
    assert not again.changed and reason_of(again) == "qsa_form"


def _indexer(post=None, raw_role="resident", n_kv=12, rows=1, extra_output=False, raw_from=None):
    """A bare indexer step: pool -> post(pooled, table) -> scores -> select -> mask -> sdpa."""

    def step(q, k, raw, table, idx_q, positions):
        pooled = ops.qsa_pool(raw_from(raw) if raw_from else raw, ratio=2)
        keys = post(pooled, table) if post else pooled
        scores = ops.qsa_block_scores(idx_q, keys)
        sel = ops.qsa_select(scores, positions, ratio=2, top_k_blocks=2)
        out = ops.sdpa(q, k, k, mask=ops.qsa_mask(sel, positions, ratio=2, kv_len=n_kv))
        return (out, scores) if extra_output else out

    return trace(
        step,
        TensorSpec((1, 2, rows, 8)),
        TensorSpec((1, 1, n_kv, 8), role="resident"),
        TensorSpec((1, n_kv, 8), role=raw_role),
        TensorSpec((n_kv, 8), role="resident"),
        TensorSpec((1, rows, 2, 8)),
        TensorSpec((1, rows), "int32"),
    )


@pytest.mark.parametrize(
    "graph, reason",
    [
        (lambda: _indexer(raw_role="streamed"), "qsa_form"),
        (lambda: _indexer(raw_from=lambda r: r * 2.0), "qsa_form"),
        (lambda: _indexer(n_kv=13), "not_divisible"),
        (lambda: _indexer(post=lambda p, t: ops.softmax(p, axis=1)), "not_row_wise"),
        (lambda: _indexer(post=lambda p, t: ops.transpose(ops.transpose(p, (0, 2, 1)), (0, 2, 1))), "not_row_wise"),
        (lambda: _indexer(post=lambda p, t: p - ops.sum(p, axis=0, keepdims=True)), "not_row_wise"),
        (lambda: _indexer(extra_output=True), "other_readers"),
        (lambda: _indexer(rows=9), "too_many_rows"),
        (lambda: _indexer(), None),  # the control: this one applies
    ],
)
def test_each_precondition_declines_with_its_reason(graph, reason):
    g = graph()
    result = QSAPoolCache()(g)
    if reason is None:
        remark_of(result, "applied")
        return
    assert reason_of(result) == reason
    assert not result.changed and result.graph == g


def test_pooled_keys_read_elsewhere_keep_the_pooling():
    g = _indexer()
    g.set_outputs([*g.outputs, "qsa_pool"])
    assert reason_of(QSAPoolCache()(g)) == "other_readers"


@pytest.mark.parametrize("table", ["strided", "direct"])
def test_per_block_operands_are_read_at_the_new_block(table):
    """A table with one row per block, read through a strided slice or directly, is read at the block."""

    def post(pooled, t):
        rows = t[0:12:2] if table == "strided" else t[6:12]
        return pooled * rows - rows

    g = _indexer(post=post)
    cached = cache_pipeline(store="keys").run(g).graph
    takes = [n for n in cached.nodes() if n.op == "take" and n.inputs[0] in ("table", "slice")]
    assert len(takes) == 1 and cached.node(takes[0].name).type.shape[0] == 1  # one row, shared by both reads
    rng = np.random.default_rng(3)
    args = {
        n: rng.standard_normal(cached.node(n).type.shape, dtype=np.float32) for n in ("q", "k", "raw", "table", "idx_q")
    }
    state = {
        "raw_blocks": run(lower(QSAPoolCache(store="keys").prefill(g), "numpy"), raw=args["raw"], table=args["table"])
    }
    for p in range(5, 12):
        want = run(lower(g, "numpy"), **args, positions=np.array([[p]], np.int32))
        out, state["raw_blocks"] = run(lower(cached, "numpy"), **args, **state, positions=np.array([[p]], np.int32))
        assert_bits_equal(out, want)


def test_environment_switch_and_options(monkeypatch):
    g = build_layer(SMALL, N_KV)
    monkeypatch.setenv("ATTNPASS_QSA_POOL_CACHE", " Off ")
    assert reason_of(QSAPoolCache()(g)) == "disabled"
    assert remark_of(QSAPoolCache()(g)) == "disabled by ATTNPASS_QSA_POOL_CACHE=Off"  # it names the switch
    assert os.environ["ATTNPASS_QSA_POOL_CACHE"] == " Off "
    remark_of(QSAPoolCache(enabled=True)(g), "applied")
    assert parse_pipeline("qsa-pool-cache{max_rows=2,store=keys}") == [QSAPoolCache(max_rows=2, store="keys")]
    for bad in ({"max_rows": 0}, {"max_rows": True}, {"enabled": "yes"}, {"store": "raw"}):
        with pytest.raises(ValueError, match="QSAPoolCache"):
            QSAPoolCache(**bad)
    with pytest.raises(ValueError, match="no pooled block keys"):
        QSAPoolCache().prefill(trace(lambda x: ops.exp(x), TensorSpec((2,))))


@requires("mlx.core")
def test_bf16_keys_are_cached_in_f32_and_read_back_exactly():
    def post(pooled):
        return ops.cast(pooled, "bfloat16")

    def step(q, k, raw, idx_q, positions):
        keys = post(ops.qsa_pool(raw, ratio=2))
        sel = ops.qsa_select(ops.qsa_block_scores(idx_q, keys), positions, ratio=2, top_k_blocks=2)
        return ops.sdpa(q, k, k, mask=ops.qsa_mask(sel, positions, ratio=2, kv_len=12), scale=1 / math.sqrt(8))

    specs = (
        TensorSpec((1, 2, 1, 8)), TensorSpec((1, 1, 12, 8), role="resident"), TensorSpec((1, 12, 8), role="resident"),
        TensorSpec((1, 1, 2, 8), "bfloat16"), TensorSpec((1, 1), "int32"),
    )  # fmt: skip
    g = trace(step, *specs)
    cached = cache_pipeline(store="keys").run(g).graph
    assert str(cached.node("raw_blocks").type) == "f32[1,6,8]"
    assert cached.node(cached.node("block_scores").inputs[1]).op == "cast"  # bf16 keys read back from the f32 store
    rng = np.random.default_rng(0)
    args = {
        "q": rng.standard_normal((1, 2, 1, 8), dtype=np.float32),
        "k": rng.standard_normal((1, 1, 12, 8), dtype=np.float32),
        "raw": rng.standard_normal((1, 12, 8), dtype=np.float32),
        "idx_q": rng.standard_normal((1, 1, 2, 8)).astype(specs[3].type.dtype.numpy),
        "positions": np.array([[9]], np.int32),
    }
    prefill = lower(QSAPoolCache(store="keys").prefill(g), "mlx")
    cache = run(prefill, raw=args["raw"])
    out, _ = run(lower(cached, "mlx"), **args, raw_blocks=cache)
    assert_bits_equal(out, run(lower(g, "mlx"), **args))


def test_positions_past_the_raw_cache_rewrite_its_last_block():
    """The attention's cache may be longer than the indexer's: a row past the raw keys writes the last block again."""

    def step(q, k, raw, idx_q, positions):
        sel = ops.qsa_select(
            ops.qsa_block_scores(idx_q, ops.qsa_pool(raw, ratio=2)), positions, ratio=2, top_k_blocks=2
        )
        return ops.sdpa(q, k, k, mask=ops.qsa_mask(sel, positions, ratio=2, kv_len=12))

    specs = (
        TensorSpec((1, 2, 1, 8)), TensorSpec((1, 1, 12, 8), role="resident"), TensorSpec((1, 6, 8), role="resident"),
        TensorSpec((1, 1, 2, 8)), TensorSpec((1, 1), "int32"),
    )  # fmt: skip
    g = trace(step, *specs)
    cached = cache_pipeline().run(g).graph
    rng = np.random.default_rng(5)
    args = {n: rng.standard_normal(cached.node(n).type.shape, dtype=np.float32) for n in ("q", "k", "raw", "idx_q")}
    first = run(lower(QSAPoolCache().prefill(g), "numpy"), raw=args["raw"])
    for p in (5, 7, 11):  # the raw keys hold positions 0..5
        positions = np.array([[p]], np.int32)
        out, after = run(lower(cached, "numpy"), **args, raw_blocks=first, positions=positions)
        assert_bits_equal(out, run(lower(g, "numpy"), **args, positions=positions))
        assert_bits_equal(after, first)  # every block complete: the last one written with the value it holds


@pytest.mark.parametrize("store", STORES)
def test_every_remark_states_what_the_step_reads_and_writes(store):
    """Each remark's numbers, measured on the graphs: the cache input's type and bytes and its output, one write
    op, one new qsa_pool of `ratio` rows per block, the bytes of the raw keys the step still reads (its only live
    readers are the takes of those rows) and those it no longer reads, the row-wise ops between pool and block keys
    and where they run (the whole cache, or the new block padded in the regime of the whole cache's reduction)."""
    layers = [
        Case("qsa", build_layer(cfg, n_kv, batch=batch, rows=rows))
        for cfg, n_kv, batch, rows in ((SMALL, N_KV, 1, 1), (SMALL, N_KV, 2, 3), (MODEL_INDEXER, N_KV, 2, 1),
                                        (MODEL_INDEXER, 1024, 1, 1))
    ]  # fmt: skip
    counts = audit(QSAPoolCache(store=store), fuzzed(("qsa",), 200) + layers, anchor="qsa_block_scores")
    assert counts["checked"] == counts["applied"] >= 20


def test_raw_keys_read_elsewhere_are_not_claimed_unread():
    """When the attention reads the raw keys too, the remark names that reader instead of bytes no longer read."""

    def step(q, raw, idx_q, positions):
        scores = ops.qsa_block_scores(idx_q, ops.qsa_pool(raw, ratio=2))
        sel = ops.qsa_select(scores, positions, ratio=2, top_k_blocks=2)
        k = ops.reshape(raw, (1, 1, 12, 8))
        return ops.sdpa(q, k, k, mask=ops.qsa_mask(sel, positions, ratio=2, kv_len=12))

    specs = (TensorSpec((1, 2, 1, 8)), TensorSpec((1, 12, 8), role="resident"), TensorSpec((1, 1, 2, 8)))
    g = trace(step, *specs, TensorSpec((1, 1), "int32"))
    result = QSAPoolCache()(g)
    message = remark_of(result, "applied")
    assert "bytes no longer read" not in message
    assert "the pooling no longer reads the other 320 bytes, but raw is still read by reshape" in message
    assert check_remarks(g, result.graph, result.remarks, QSAPoolCache()) == 1


@requires("jax")
def test_xla_row_reductions_round_by_regime_as_the_padding_assumes():
    """The backend fact behind XLA_ROW_REDUCTION_ELEMENTS (docs/qsa.md, docs/semantics.md §4): on XLA's CPU a row sum of
    fewer elements than the threshold rounds otherwise than one of at least as many (about half the rows differ at
    D = 128), and within the large regime a row's bits depend on neither its place nor the other rows (zeros)."""
    d = 128
    rows = XLA_ROW_REDUCTION_ELEMENTS // d
    x = np.random.default_rng(0).standard_normal((2 * rows, d)).astype(np.float32)
    norm = jax.jit(lambda a: jax.numpy.sum(a * a, axis=-1))
    whole = np.asarray(norm(x))  # the large regime: 2 * 4,096 elements
    small = np.asarray(norm(x[: rows - 1]))  # 3,968 elements
    differ = np.mean(small.view(np.uint32) != whole[: rows - 1].view(np.uint32))
    assert 0.2 <= differ <= 0.8, differ
    assert_bits_equal(np.asarray(norm(x[:rows])), whole[:rows])  # 4,096 elements: the large regime
    padded = np.zeros((rows, d), np.float32)
    padded[0] = x[5]
    assert_bits_equal(np.asarray(norm(padded))[0], whole[5])  # row 0 of a zero pad rounds as row 5 among all
