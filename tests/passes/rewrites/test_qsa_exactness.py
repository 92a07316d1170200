"""Exactness of the gather rewrite: the gathered cell set is the masked path's set, and outputs agree.

Small model (K = 8 blocks, ratio 4, W = 35, threshold n_kv >= 70) so the gather applies early.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnpass.backends import run
from attnpass.lowering import lower
from attnpass.models import QSAConfig, build_layer, gather_pipeline, make_inputs, narrowed_inputs
from attnpass.passes import DeadCodeElimination, QSAGather
from tests.util import lazy_import, requires, target_params

jax = lazy_import("jax")

SMALL = QSAConfig(n_q_heads=4, n_kv_heads=2, head_dim=16, idx_dim=16, budget=32, mask_rows=4, rotary_dim=8)
K, R = SMALL.top_k_blocks, SMALL.ratio
BATCH = 2
_CACHE: dict = {}


def compiled(graph, target: str):
    """A callable taking the graph's inputs by name and returning numpy outputs (JAX jitted)."""
    program = lower(graph, target)
    if target != "jax":
        return lambda **kw: run(program, **kw)
    fn = jax.jit(program.fn)

    def call(**kw):
        out = fn(*program.bind(**kw))
        return tuple(np.asarray(o) for o in out) if isinstance(out, tuple) else np.asarray(out)

    return call


def probe(n_kv: int, target: str):
    """The rewritten layer with the masked path's qsa_mask and the gather's cells/validity as outputs."""
    key = (n_kv, target)
    if key not in _CACHE:
        rewritten = QSAGather()(build_layer(SMALL, n_kv, batch=BATCH)).graph
        rewritten.set_outputs(["qsa_select", "qsa_mask", "qsa_cells", "qsa_cell_valid"])
        graph = DeadCodeElimination()(rewritten).graph
        _CACHE[key] = (graph, compiled(graph, target))
    return _CACHE[key]


def check_cell_sets(n_kv: int, positions: np.ndarray, seed: int, tied: bool, target: str) -> None:
    graph, fn = probe(n_kv, target)
    inputs = make_inputs(SMALL, n_kv, positions, seed=seed)
    if tied:
        inputs["idx_q"][0] = 0.0  # stream 0: every block scores 0, the lowest ids must win
    sel, keep, cells, valid = fn(**narrowed_inputs(graph, inputs))
    for b in range(BATCH):
        p = int(positions[b, 0])
        n_complete, tail = (p + 1) // R, (p + 1) % R
        attended = np.flatnonzero(keep[b, 0, 0])
        gathered = cells[b, 0][valid[b, 0]]
        assert len(gathered) == len(set(gathered)) == min(K, n_complete) * R + tail  # no surplus, no missing
        np.testing.assert_array_equal(np.sort(gathered), attended)
        assert set(range(n_complete * R, p + 1)) <= set(gathered)  # the whole tail
        assert (cells[b, 0][~valid[b, 0]] == 0).all()
        if tied and b == 0:
            np.testing.assert_array_equal(sel[0, 0][sel[0, 0] >= 0], np.arange(min(K, n_complete)))


DEPTHS = [70, 71, 73, 128]  # at the threshold 2 * W = 70 and around it


@requires("mlx.core", "jax")
@pytest.mark.parametrize("n_kv", DEPTHS)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_gathered_cells_are_exactly_the_masked_set(n_kv, data):
    tails = data.draw(st.lists(st.integers(0, R - 1), min_size=BATCH, max_size=BATCH))
    blocks = data.draw(st.lists(st.integers(0, n_kv // R - 1), min_size=BATCH, max_size=BATCH))
    positions = np.array([[min(n_kv - 1, b * R + R - 1 + t)] for b, t in zip(blocks, tails)], np.int32)
    seed, tied = data.draw(st.integers(0, 2**16)), data.draw(st.booleans())
    for target in ("numpy", "mlx", "jax"):
        check_cell_sets(n_kv, positions, seed, tied, target)


@requires("mlx.core", "jax")
@pytest.mark.parametrize("tail", range(R))
def test_every_tail_length_at_depth(tail):
    n_kv = 72
    p = 63 + tail  # n_complete = 16 > K: a real selection, then a tail of `tail` cells
    positions = np.array([[p], [n_kv - 1]], np.int32)
    for target in ("numpy", "mlx", "jax"):
        check_cell_sets(n_kv, positions, seed=tail, tied=tail % 2 == 0, target=target)


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
def test_outputs_agree_with_the_masked_program(target):
    n_kv = 96
    masked = build_layer(SMALL, n_kv, batch=BATCH)
    gathered = gather_pipeline().run(masked).graph
    assert sum(n.op == "sdpa" for n in gathered.nodes()) == 1  # one dense call, the streams in its batch
    run_masked, run_gathered = compiled(masked, target), compiled(gathered, target)
    reference = compiled(masked, "numpy")
    for positions in ([[95], [70]], [[40], [93]], [[81], [66]]):
        inputs = make_inputs(SMALL, n_kv, np.array(positions), seed=sum(map(sum, positions)), hidden_fraction=0.15)
        want = reference(**inputs)
        got_masked = run_masked(**inputs)
        got_gathered = run_gathered(**narrowed_inputs(gathered, inputs))
        assert np.isfinite(got_gathered).all()
        np.testing.assert_allclose(got_masked, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_gathered, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_gathered, got_masked, rtol=1e-5, atol=1e-6)
