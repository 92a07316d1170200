"""mlx-lm's attention over a QuantizedKVCache raised to ``quantized_sdpa`` and lowered GQA-folded.

The oracle is mlx-lm's own ``quantized_scaled_dot_product_attention``: the raised graph lowered to MLX gives
its bits (float32 and bfloat16, 4 and 8 bits, GQA, masks); numpy (float64 steps) and JAX (float32
accumulation) agree within rounding. Every pass that reads attention declines a ``quantized_sdpa`` by name.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import ShapeError, from_mlx
from attnpass.ir.core.printer import parse_type
from attnpass.ir.core.registry import get_op
from attnpass.lowering import lower
from attnpass.passes import PassManager, parse_pipeline
from tests.util import assert_bits_equal, lazy_import, random_array, requires

mx = lazy_import("mlx.core")


def _cache(rng, bits: int, length: int, hkv: int, dtype: str, dim: int = 64):
    """The (words, scales, biases) K and V of a filled mlx-lm ``QuantizedKVCache``."""
    from mlx_lm.models.cache import QuantizedKVCache

    cache = QuantizedKVCache(group_size=64, bits=bits)
    k, v = (mx.array(random_array(rng, (1, hkv, length, dim), "float32")).astype(getattr(mx, dtype)) for _ in "kv")
    keys, values = cache.update_and_fetch(k, v)
    mx.eval(keys, values)
    return keys, values


def _mask(rng, kind: str, rows: int, length: int, dtype: str):
    if kind == "none":
        return None
    if kind == "bool":
        return mx.array(np.tril(np.ones((rows, length), bool), length - rows))[None, None]
    return mx.array(random_array(rng, (1, 1, rows, length), "float32")).astype(getattr(mx, dtype))


def _attend(bits: int, mask):
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    def attend(q, kq, ks, kb, vq, vs, vb, *m):
        keys, values = (kq, ks, kb), (vq, vs, vb)
        out = quantized_scaled_dot_product_attention(q, keys, values, 0.125, m[0] if m else mask, 64, bits)
        return out

    return attend


def _raised(rng, bits, dtype, hq, hkv, rows, mask_kind, length=70):
    keys, values = _cache(rng, bits, length, hkv, dtype)
    q = mx.array(random_array(rng, (1, hq, rows, 64), "float32")).astype(getattr(mx, dtype))
    mask = _mask(rng, mask_kind, rows, length, dtype)
    args = [q, *keys, *values] + ([mask] if mask is not None else [])
    fn = _attend(bits, None)
    imported = from_mlx(lambda *a: fn(mx.array(a[0]), *a[1:]), *args)  # mlx-lm scales q in place: a copy
    result = PassManager(parse_pipeline("raise-attention")).run(imported.graph.copy())
    expected = fn(mx.array(q), *args[1:])
    words = [a.view(mx.int32) if a.dtype == mx.uint32 else a for a in args]
    return result, words, expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (2, 2), (8, 1)])
@pytest.mark.parametrize(("rows", "mask_kind"), [(1, "none"), (3, "bool"), (3, "additive")])
@requires("mlx.core", "mlx_lm")
def test_raised_quantized_attention_is_mlx_lm_bit_for_bit(rng, dtype, bits, hq, hkv, rows, mask_kind):
    result, args, expected = _raised(rng, bits, dtype, hq, hkv, rows, mask_kind)
    ops = [n.op for n in result.graph if n.op not in ("input", "constant")]
    assert ops == ["quantized_sdpa"], ops
    (remark,) = [r for r in result.remarks if r.kind == "applied" and "quantized_sdpa" in r.message]
    assert f"{hq} query heads on {hkv} kv heads, {bits}-bit K/V in groups of 64, scale 0.125" in remark.message
    assert (mask_kind == "none") == remark.message.endswith("mask none")
    node = next(n for n in result.graph if n.op == "quantized_sdpa")
    assert node.attrs == {"scale": 0.125, "group_size": 64, "bits": bits, "precision": "dtype"}
    from attnpass.lowering.targets.mlx.target import to_numpy

    assert_bits_equal(np.asarray(run(lower(result.graph, "mlx"), *args)), to_numpy(expected))
    host = [to_numpy(a) for a in args]
    numpy, jax = (np.asarray(run(lower(result.graph, t), *host)).astype(np.float64) for t in ("numpy", "jax"))
    mlx = to_numpy(expected).astype(np.float64)
    if dtype == "float32":
        np.testing.assert_allclose(numpy, mlx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(jax, mlx, rtol=1e-5, atol=1e-5)
    else:  # both sum in float32 or wider; MLX's CPU kernels add 64 and 70 products one by one in bfloat16
        np.testing.assert_allclose(jax, numpy, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(numpy, mlx, atol=0.1)


@requires("mlx.core", "mlx_lm")
def test_string_causal_mask_is_raised_too(rng):
    """mlx-lm's ``mask="causal"`` builds the mask from aranges inside the helper: still one quantized_sdpa."""
    keys, values = _cache(rng, 8, 40, 2, "float32")
    fn = _attend(8, "causal")
    q = mx.array(random_array(rng, (1, 4, 3, 64), "float32"))
    imported = from_mlx(lambda *a: fn(mx.array(a[0]), *a[1:]), q, *keys, *values)
    result = PassManager(parse_pipeline("raise-attention")).run(imported.graph.copy())
    assert sum(n.op == "quantized_sdpa" for n in result.graph) == 1
    assert not any(n.op == "quantized_matmul" for n in result.graph)
    words = [a.view(mx.int32) if a.dtype == mx.uint32 else a for a in (*keys, *values)]
    got = run(lower(result.graph, "mlx"), q, *words, **imported.params)
    assert_bits_equal(np.asarray(got), np.array(fn(mx.array(q), *keys, *values)))


@requires("mlx.core", "mlx_lm")
def test_decode_program_is_two_quantized_matmuls_over_the_packed_cache(rng):
    """GQA folded (8 query heads on 2 kv heads, one row each): the keys and values are neither broadcast to the
    query heads nor dequantized (no shifts of the words); one QuantizedMatmul each."""
    from attnpass.lowering.targets.mlx.target import count_primitives

    result, args, _ = _raised(rng, 4, "float32", 8, 2, 1, "none")
    program = lower(PassManager(parse_pipeline("decompose-sdpa{device=cpu}")).run(result.graph).graph, "mlx")
    counts = count_primitives(program, *[np.array(a) for a in args])
    assert counts["QuantizedMatmul"] == 2 and not {"BitwiseBinary", "Gather"} & set(counts), counts
    from attnpass.lowering.targets.mlx.runtime import quantized_sdpa

    records: list = []
    mx.export_function(records.append, lambda *a: quantized_sdpa(*a, scale=0.125, group_size=64, bits=4), *args)
    primitives = [r for r in records if r["type"] == "primitive"]
    matmuls = [r for r in primitives if r["name"] == "QuantizedMatmul"]
    assert [tuple(r["inputs"][0][1]) for r in matmuls] == [(1, 2, 4, 64), (1, 2, 4, 70)]  # 4 heads folded as rows
    assert [tuple(r["inputs"][1][1]) for r in matmuls] == [(1, 2, 70, 8)] * 2  # the cache's own [B, Hkv, T, words]
    broadcast = [tuple(r["inputs"][0][1]) for r in primitives if r["name"] == "Broadcast"]
    assert broadcast == [()], broadcast  # the scale alone


@pytest.mark.parametrize(
    "pipeline",
    [
        "head-chunk",
        "split-kv{shards=2}",
        "shard-attention{heads=model}",
        "decompose-sdpa{device=cpu}",
        "block-sparse",
    ],
)
@requires("mlx.core", "mlx_lm")
def test_passes_that_read_attention_decline_quantized_sdpa_by_name(rng, pipeline):
    result, _, _ = _raised(rng, 8, "float32", 4, 2, 3, "bool")
    after = PassManager(parse_pipeline(pipeline)).run(result.graph.copy())
    assert after.graph == result.graph  # left as it is
    node = next(n.name for n in result.graph if n.op == "quantized_sdpa")
    (remark,) = [r for r in after.remarks if r.node == node]
    assert remark.kind == "declined" and remark.message.startswith("quantized_sdpa: ")
    name = pipeline.split("{")[0]
    assert name in remark.message or "GQA-folded" in remark.message


def _manual(fill: float | None = None, axis: int = -1, divide: bool = False):
    """mlx-lm's quantized attention written out, with one thing changed."""

    def attend(q, kq, ks, kb, vq, vs, vb, mask):
        k, v = (kq, ks, kb), (vq, vs, vb)
        q = q / 8.0 if divide else q * 0.125
        s = mx.quantized_matmul(q, *k, transpose=True, group_size=64, bits=8)
        s = mx.where(mask, s, mx.finfo(s.dtype).min if fill is None else fill)
        return mx.quantized_matmul(mx.softmax(s, axis=axis, precise=True), *v, transpose=False, group_size=64, bits=8)

    return attend


@pytest.mark.parametrize(
    ("change", "code", "words"),
    [
        ({"fill": -1e9}, "mask_form", r"not where\(bool mask, scores, -3.40282e\+38\)"),
        ({"axis": -2}, "axes_mismatch", r"the softmax normalises axis 2, not the key axis"),
    ],
)
@requires("mlx.core", "mlx_lm")
def test_other_forms_are_declined_with_the_reason(rng, change, code, words):
    keys, values = _cache(rng, 8, 64, 2, "float32")
    mask = mx.array(np.tril(np.ones((64, 64), bool)))[None, None]
    q = mx.array(random_array(rng, (1, 2, 64, 64), "float32"))
    imported = from_mlx(_manual(**change), q, *keys, *values, mask)
    result = PassManager(parse_pipeline("raise-attention")).run(imported.graph.copy())
    assert not any(n.op == "quantized_sdpa" for n in result.graph)
    declined = [r for r in result.remarks if r.kind == "declined" and r.rule == "quantized-attention"]
    assert len(declined) == 1 and declined[0].reason == code, declined
    assert re.search(words, declined[0].message), declined  # the message names the offending value


@requires("mlx.core", "mlx_lm")
def test_a_divided_scale_is_not_taken_as_the_scale(rng):
    """``q / 8`` rounds as ``q * 0.125`` only for powers of two; the rule takes ``mul`` alone, and keeps the
    division in front of a scale-1 quantized_sdpa: still mlx-lm's bits."""
    keys, values = _cache(rng, 8, 64, 2, "float32")
    mask = mx.array(np.tril(np.ones((64, 64), bool)))[None, None]
    q = mx.array(random_array(rng, (1, 2, 64, 64), "float32"))
    fn = _manual(divide=True)
    imported = from_mlx(fn, q, *keys, *values, mask)
    result = PassManager(parse_pipeline("raise-attention")).run(imported.graph.copy())
    node = next(n for n in result.graph if n.op == "quantized_sdpa")
    assert node.attrs["scale"] == 1.0 and result.graph.node(node.inputs[0]).op == "div"
    words = [a.view(mx.int32) if a.dtype == mx.uint32 else a for a in (*keys, *values)]
    got = run(lower(result.graph, "mlx"), q, *words, mask)
    assert_bits_equal(np.asarray(got), np.array(fn(q, *keys, *values, mask)))


@pytest.mark.parametrize(
    ("types", "match"),
    [
        (["f32[1,4,1,64]", "i32[1,2,9,8]", "f32[1,2,9,1]", "f32[1,2,9,1]", "i32[1,2,9,8]", "f32[1,2,9,1]",
          "f32[1,2,9,1]"], None),
        (["f32[1,3,1,64]", "i32[1,2,9,8]", "f32[1,2,9,1]", "f32[1,2,9,1]", "i32[1,2,9,8]", "f32[1,2,9,1]",
          "f32[1,2,9,1]"], r"3 query heads are not a multiple of 2 kv heads"),
        (["f32[1,4,1,128]", "i32[1,2,9,8]", "f32[1,2,9,1]", "f32[1,2,9,1]", "i32[1,2,9,8]", "f32[1,2,9,1]",
          "f32[1,2,9,1]"], r"q f32\[1,4,1,128\] has head dim 128, the keys .* hold 64"),
        (["bf16[1,4,1,64]", "i32[1,2,9,8]", "f32[1,2,9,1]", "f32[1,2,9,1]", "i32[1,2,9,8]", "f32[1,2,9,1]",
          "f32[1,2,9,1]"], r"q and the K/V scales must share one float dtype"),
        (["f32[1,4,1,64]", "i32[1,2,9,8]", "f32[1,2,9,1]", "f32[1,2,9,1]", "i32[1,2,8,8]", "f32[1,2,8,1]",
          "f32[1,2,8,1]"], r"must share \[B, Hkv, T\]"),
        (["f32[1,4,1,64]", "i32[1,2,9,8]", "f32[1,2,9,1]", "f32[1,2,9,1]", "i32[1,2,9,8]", "f32[1,2,9,1]",
          "f32[1,2,9,1]", "bool[1,4,2,9]"], r"mask bool\[1,4,2,9\] does not broadcast to \[B, Hq, S, T\]"),
        (["f32[1,4,1,64]", "i32[1,2,9,8]", "f32[1,2,9,1]", "f32[1,2,9,1]", "i32[1,2,9,8]", "f32[1,2,9,1]",
          "f32[1,2,9,1]", "i32[1,1,1,9]"], r"mask i32\[1,1,1,9\] must be bool"),
    ],
)  # fmt: skip
def test_quantized_sdpa_shape_rule(types, match):
    attrs = {"scale": 0.125, "group_size": 64, "bits": 4}
    optionals = ("mask",) if len(types) == 8 else ()
    rule = functools.partial(get_op("quantized_sdpa").result_type, optionals=optionals)
    if match is None:
        assert rule([parse_type(t) for t in types], attrs) == parse_type("f32[1,4,1,64]")
        return
    with pytest.raises(ShapeError, match=r"^quantized_sdpa: .*" + match):
        rule([parse_type(t) for t in types], attrs)


@pytest.mark.parametrize("target", ["numpy", "mlx", "jax"])
@requires("mlx.core", "mlx_lm")
def test_a_row_without_keys_is_the_mean_of_v(rng, target):
    """The bool mask fills with the dtype's lowest finite value (mlx-lm's), not -inf: a query row the mask
    leaves without keys weighs all T keys equally, as docs/semantics.md §1.5 says."""
    from attnpass.ir import DType, TensorType
    from attnpass.ir.dialects.evaluate import dequantize
    from tests.util import one_op_graph

    keys, values = _cache(rng, 8, 40, 2, "float32")
    host = [np.array(a).view(np.int32) if a.dtype == mx.uint32 else np.array(a) for a in (*keys, *values)]
    q = random_array(rng, (1, 4, 2, 64), "float32")
    mask = np.ones((1, 1, 2, 40), bool)
    mask[..., 1, :] = False
    types = [TensorType(a.shape, DType.from_numpy(a.dtype)) for a in (q, *host, mask)]
    graph = one_op_graph("quantized_sdpa", types, {"scale": 0.125, "group_size": 64, "bits": 8})
    out = np.asarray(run(lower(graph, target), q, *host, mask))
    v = dequantize(*host[3:], group_size=64, bits=8, dtype="float32")  # [1, 2, 40, 64]
    mean = np.repeat(v.mean(axis=2), 2, axis=1)  # query head h reads kv head h // 2
    np.testing.assert_allclose(out[:, :, 1], mean, rtol=1e-5, atol=1e-5)
    assert not np.allclose(out[:, :, 0], mean, atol=1e-3)  # the row with keys attends


@pytest.mark.parametrize("device", ["cpu", "metal"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@requires("mlx.core", "mlx_lm")
@pytest.mark.parametrize("widen", [False, True])
def test_decompose_sdpa_widen_quantized_computes_a_half_float_quantized_sdpa_in_float32(rng, device, dtype, widen):
    """CPU, bfloat16, widen_quantized=true: precision float32, with the remark; the programs compute the float32
    semantics (MLX's CPU kernel summing float32 products; numpy in float64 steps rounded to float32), rounded once
    to bfloat16: within a bfloat16 step of each other. float32, another device or the default (the model's own
    bits): kept as it was, declined as already GQA-folded."""
    from attnpass.lowering.targets.mlx.target import to_numpy

    result, args, _ = _raised(rng, 8, dtype, 8, 2, 3, "bool")
    pipeline = f"decompose-sdpa{{device={device},widen_quantized={str(widen).lower()}}}"
    after = PassManager(parse_pipeline(pipeline)).run(result.graph.copy())
    (node,) = [n for n in after.graph if n.op == "quantized_sdpa"]
    (remark,) = [r for r in after.remarks if r.node == node.name]
    if device == "metal" or dtype == "float32" or not widen:
        assert remark.reason == "already_done"
        assert after.graph == result.graph and remark.kind == "declined"
        return
    assert node.attrs["precision"] == "float32" and remark.kind == "applied"
    assert remark.message.startswith("quantized_sdpa: precision float32 (device cpu): MLX's CPU quantized_matmul")
    assert "rounded once to bfloat16" in remark.message
    host = [to_numpy(a) for a in args]
    numpy, jax = (np.asarray(run(lower(after.graph, t), *host)).astype(np.float64) for t in ("numpy", "jax"))
    mlx = to_numpy(run(lower(after.graph, "mlx"), *args)).astype(np.float64)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(numpy), 2.0**-126))) - 7)  # a bfloat16 step at each value
    assert np.all(np.abs(mlx - numpy) <= step) and np.all(np.abs(jax - numpy) <= step)
