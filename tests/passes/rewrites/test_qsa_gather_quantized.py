"""qsa-gather over a quantized cache: ``quantized_sdpa`` masked by a QSA selection -> the selected cells' packed rows.

The masked form attends the whole quantized cache (MLX's packed words, scales and biases); the rewrite gathers
the six K/V arrays at each row's ``W`` cells and runs one ``quantized_sdpa`` over them. Checked against the
masked form on numpy, MLX and JAX (the same cells attended, reduction order aside), and structurally: the
cache's arrays are read by the gathers alone, nothing is dequantized.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.passes import DeadCodeElimination, PassManager, QSAGather
from tests.util import requires

B, HQ, HKV, T, D, GROUP, BITS, RATIO = 1, 4, 2, 64, 32, 32, 8, 2
WORDS, GROUPS = D * BITS // 32, D // GROUP
W = 3 * RATIO + RATIO - 1  # top 3 blocks and the tail
KV = ("kq", "ks", "kb", "vq", "vs", "vb")


def _specs(rows: int, visibility: bool) -> list[TensorSpec]:
    parts = [TensorSpec((B, HKV, T, WORDS), "int32"), TensorSpec((B, HKV, T, GROUPS)), TensorSpec((B, HKV, T, GROUPS))]
    specs = [TensorSpec((B, HQ, rows, D)), *parts, *parts]
    specs += [TensorSpec((B, rows, 3), "int32"), TensorSpec((B, rows), "int32")]
    return specs + ([TensorSpec((B, 1, rows, T))] if visibility else [])


def _masked(q, kq, ks, kb, vq, vs, vb, selection, positions):
    keep = ops.qsa_mask(selection, positions, ratio=RATIO, kv_len=T)
    return ops.quantized_sdpa(q, (kq, ks, kb), (vq, vs, vb), mask=keep, scale=0.3, group_size=GROUP, bits=BITS)


def _visible(q, kq, ks, kb, vq, vs, vb, selection, positions, vis):
    """The additive form: ``where(qsa_mask, vis, -inf)``."""
    mask = ops.where(ops.qsa_mask(selection, positions, ratio=RATIO, kv_len=T), vis, -math.inf)
    return ops.quantized_sdpa(q, (kq, ks, kb), (vq, vs, vb), mask=mask, scale=0.3, group_size=GROUP, bits=BITS)


def _arguments(rng, rows: int, visibility: bool) -> list[np.ndarray]:
    """A quantized cache (``mx.quantize`` of random K/V), queries, distinct selections and positions."""
    import mlx.core as mx

    parts = []
    for _ in "kv":
        words, scales, biases = mx.quantize(mx.array(rng.standard_normal((B, HKV, T, D)), mx.float32), GROUP, BITS)
        parts += [np.array(words.view(mx.int32)), np.array(scales), np.array(biases)]
    positions = np.array([T - rows - 3 + np.arange(rows)], np.int32)
    blocks = [rng.permutation((p + 1) // RATIO)[:3] for p in positions[0]]
    args = [rng.standard_normal((B, HQ, rows, D)).astype(np.float32), *parts, np.array([blocks], np.int32), positions]
    return args + ([rng.standard_normal((B, 1, rows, T)).astype(np.float32)] if visibility else [])


def _gathered(rows: int, visibility: bool, **options):
    masked = trace(_visible if visibility else _masked, *_specs(rows, visibility))
    options = {"selection_input": "selection", **options}
    return masked, PassManager([QSAGather(**options), DeadCodeElimination()]).run(masked)


@requires("mlx.core")
@pytest.mark.parametrize("target", ["numpy", "mlx", "jax"])
@pytest.mark.parametrize(("rows", "visibility"), [(1, False), (3, False), (1, True), (20, False)])
def test_the_selected_cells_packed_rows_are_gathered_and_attended_as_the_masked_form(rng, target, rows, visibility):
    if target == "jax":
        pytest.importorskip("jax")
    masked, result = _gathered(rows, visibility, prefill_tile=8)
    graph = result.graph
    (remark,) = [r for r in result.remarks if r.pass_name == "qsa-gather" and r.kind == "applied"]
    tiles = -(-rows // 8) if rows > 8 else 1
    gathers = [n for n in graph.nodes() if n.op == "qsa_gather"]
    assert len(gathers) == 6 * tiles and "qsa_mask" not in {n.op for n in graph.nodes()}
    assert not {"dequantize", "sdpa", "quantized_matmul"} & {n.op for n in graph.nodes()}
    # the cache's six arrays are read by the gathers alone, each gather is [B*S, Hkv, W, words|groups]
    for name in KV:
        assert {n.op for n in graph.nodes() if name in n.inputs} == {"qsa_gather"}
    tile = min(rows, 8)
    assert {n.type.shape for n in gathers} >= {(B * tile, HKV, W, WORDS), (B * tile, HKV, W, GROUPS)}
    attention = [n for n in graph.nodes() if n.op == "quantized_sdpa"]
    assert len(attention) == tiles
    assert all(n.attrs == {"scale": 0.3, "group_size": GROUP, "bits": BITS, "precision": "dtype"} for n in attention)
    assert "one qsa_gather each of the K and V words, scales and biases [B*" in remark.message
    assert "and one quantized_sdpa" in remark.message and f"W={W}" in remark.message
    assert remark.message.endswith("only the gathered cells' packed rows are read, none dequantized beforehand")
    args = _arguments(rng, rows, visibility)
    want = np.asarray(run(lower(masked, target), *args))
    got = np.asarray(run(lower(graph, target), *args))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_a_quantized_sdpa_without_a_qsa_mask_is_declined_with_the_reason():
    def plain(q, kq, ks, kb, vq, vs, vb, mask):
        return ops.quantized_sdpa(q, (kq, ks, kb), (vq, vs, vb), mask=mask, scale=0.3, group_size=GROUP, bits=BITS)

    def unmasked(q, kq, ks, kb, vq, vs, vb):
        return ops.quantized_sdpa(q, (kq, ks, kb), (vq, vs, vb), scale=0.3, group_size=GROUP, bits=BITS)

    specs = _specs(1, False)[:7]
    for fn, extra, words in (
        (plain, [TensorSpec((B, 1, 1, T), "bool")], "the mask is graph input mask, not qsa_mask"),
        (unmasked, [], "quantized_sdpa has no mask"),
    ):
        graph = trace(fn, *specs, *extra)
        result = PassManager([QSAGather()]).run(graph)
        (remark,) = [r for r in result.remarks if r.pass_name == "qsa-gather" and r.node is not None]
        assert remark.kind == "declined" and remark.reason == "mask_not_selection", remark
        assert words in remark.message and result.graph == graph
