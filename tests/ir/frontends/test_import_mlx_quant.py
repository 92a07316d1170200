"""from_mlx of quantized code: ``nn.QuantizedLinear`` and mlx-lm's quantized sdpa over a ``QuantizedKVCache``'s
(packed words, scales, biases) K/V import as ``quantized_matmul`` and reproduce MLX (bit for bit lowered to MLX,
within rounding on numpy and JAX); what is not imported is named."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import AttnpassError, ModelImportError, TensorSpec, from_mlx, ops, trace
from attnpass.lowering import lower
from tests.util import assert_bits_equal, assert_mlx_import_reproduces, lazy_import, random_array, requires

mx = lazy_import("mlx.core")
nn = lazy_import("mlx.nn")


def _ops(graph) -> list[str]:
    return [n.op for n in graph if n.op not in ("input", "constant")]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bias", [True, False])
@requires("mlx.core")
def test_quantized_linear_imports_as_quantized_matmul(rng, bits, bias):
    layer = nn.QuantizedLinear(128, 96, bias=bias, group_size=64, bits=bits)
    mx.eval(layer.parameters())
    x = mx.array(random_array(rng, (2, 3, 128), "float32"))
    imported = from_mlx(layer, x)
    node = next(n for n in imported.graph if n.op == "quantized_matmul")
    assert node.attrs == {"transpose": True, "group_size": 64, "bits": bits}
    assert imported.graph.node("weight").type.dtype.value == "int32"  # the packed words, bits kept
    assert_bits_equal(imported.params["weight"].view(np.uint32), np.array(layer.weight))
    assert_mlx_import_reproduces(imported, layer, x)


def _quantized_cache(rng, bits: int, length: int, heads: int = 2, dim: int = 64):
    """The (words, scales, biases) K and V a filled ``QuantizedKVCache`` hands to attention."""
    from mlx_lm.models.cache import QuantizedKVCache

    cache = QuantizedKVCache(group_size=64, bits=bits)
    k, v = (mx.array(random_array(rng, (1, heads, length, dim), "float32")) for _ in range(2))
    keys, values = cache.update_and_fetch(k, v)
    mx.eval(keys, values)
    return keys, values


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("queries", [1, 3])
@requires("mlx.core", "mlx_lm")
def test_mlx_lm_quantized_sdpa_over_a_quantized_cache_imports(rng, bits, queries):
    """GQA (4 query heads on 2 kv heads), decode (1 query, no mask) and a 3-query causal verify step."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    keys, values = _quantized_cache(rng, bits, length=40)
    assert isinstance(keys, tuple) and len(keys) == 3 and keys[0].dtype == mx.uint32
    mask = "causal" if queries > 1 else None

    def attend(q):
        return quantized_scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask, group_size=64, bits=bits)

    host = random_array(rng, (1, 4, queries, 64), "float32")
    imported = from_mlx(attend, mx.array(host))
    assert _ops(imported.graph).count("quantized_matmul") == 2
    transposes = sorted(n.attrs["transpose"] for n in imported.graph if n.op == "quantized_matmul")
    assert transposes == [False, True]  # scores = q @ K^T, out = p @ V
    # ``queries *= scale`` scales its argument in place: each call gets a fresh copy.
    assert_mlx_import_reproduces(imported, lambda q: attend(mx.array(np.array(q))), mx.array(host))


@requires("mlx.core")
def test_non_affine_quantized_matmul_is_declined(rng):
    """mxfp4's scales are uint8, which the IR has not: the import stops at them (QuantizedMatmul's own mode
    check is behind it)."""
    w = mx.array(random_array(rng, (64, 128), "float32"))
    wq, scales = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    mx.eval(wq, scales)

    def product(x):
        return mx.quantized_matmul(x, wq, scales, transpose=True, group_size=32, bits=4, mode="mxfp4")

    with pytest.raises(ModelImportError, match=r"captured array .*: dtype uint8 is not in the IR"):
        from_mlx(product, mx.zeros((2, 128)))


@requires("mlx.core")
def test_mx_dequantize_is_declined_by_name(rng):
    """mx.dequantize exports no primitive of its own (shifts of the packed words): the error says so."""
    wq, scales, biases = mx.quantize(mx.array(random_array(rng, (8, 128), "float32")), group_size=64, bits=4)
    mx.eval(wq, scales, biases)

    def weights(x):
        return x + mx.dequantize(wq, scales, biases, group_size=64, bits=4)

    with pytest.raises(ModelImportError, match=r"BitwiseBinary .*mx\.dequantize records no primitive"):
        from_mlx(weights, mx.zeros((8, 128)))


@requires("mlx.core")
def test_traced_dequantize_then_matmul_equals_quantized_matmul(rng):
    """The tracer builders: x @ dequantize(w)^T traced, lowered to MLX, is mx.quantized_matmul within rounding."""
    w = mx.array(random_array(rng, (32, 128), "float32"))
    wq, scales, biases = mx.quantize(w, group_size=32, bits=8)
    host = [np.array(wq).view(np.int32), np.array(scales), np.array(biases)]

    def fn(x, words, s, b):
        fused = ops.quantized_matmul(x, words, s, b, group_size=32, bits=8)
        unfused = ops.matmul(x, ops.transpose(ops.dequantize(words, s, b, group_size=32, bits=8)))
        return fused, unfused

    specs = [TensorSpec((3, 128), "float32"), *(TensorSpec(a.shape, a.dtype.name) for a in host)]
    graph = trace(fn, *specs)
    assert graph.node(graph.outputs[1]).type.shape == (3, 32)
    x = random_array(rng, (3, 128), "float32")
    fused, unfused = run(lower(graph, "mlx"), x, *host)
    expected = np.array(mx.quantized_matmul(mx.array(x), wq, scales, biases, group_size=32, bits=8))
    assert_bits_equal(np.asarray(fused), expected)
    np.testing.assert_allclose(np.asarray(unfused), expected, rtol=1e-5, atol=1e-4)


@requires("mlx.core", "mlx_lm")
@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_default_pipeline_keeps_the_quantized_sdpa_bits(rng, device):
    """Without raise-attention (which raises them to quantized_sdpa: tests/passes/analysis/test_quantized_attention.py)
    the device pipeline leaves the two quantized_matmuls in place and the MLX program keeps mlx-lm's bits."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from attnpass.passes import PassManager
    from attnpass.passes.device_pipelines import default_pipeline

    keys, values = _quantized_cache(rng, 8, length=40)

    def attend(q):
        return quantized_scaled_dot_product_attention(q, keys, values, scale=0.125, mask=None, group_size=64, bits=8)

    host = random_array(rng, (1, 4, 1, 64), "float32")
    imported = from_mlx(attend, mx.array(host))
    result = PassManager(default_pipeline(device)).run(imported.graph.copy())
    assert _ops(result.graph).count("quantized_matmul") == 2
    got = run(lower(result.graph, "mlx"), host, **imported.params)
    assert_bits_equal(np.asarray(got), np.array(attend(mx.array(host.copy()))))


@requires("mlx.core", "mlx_lm")
def test_quantized_kv_as_arguments_imports_as_int32_inputs_of_the_words_bits(rng):
    """K/V tuples passed as arguments (how a router hands a cache's state over): uint32 words become int32 inputs;
    the caller passes ``.view(int32)``, and the MLX program computes mlx-lm's bits."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    keys, values = _quantized_cache(rng, 4, length=70)

    def attend(q, kq, ks, kb, vq, vs, vb):
        return quantized_scaled_dot_product_attention(
            q, (kq, ks, kb), (vq, vs, vb), scale=0.125, mask=None, group_size=64, bits=4
        )

    host = random_array(rng, (1, 4, 1, 64), "float32")
    imported = from_mlx(attend, mx.array(host), *keys, *values)
    assert [imported.graph.node(n).type.dtype.value for n in ("kq", "vq")] == ["int32", "int32"]
    args = [x.view(mx.int32) if x.dtype == mx.uint32 else x for x in (*keys, *values)]
    got = run(lower(imported.graph, "mlx"), mx.array(host), *args)
    assert_bits_equal(np.asarray(got), np.array(attend(mx.array(host.copy()), *keys, *values)))
    with pytest.raises(AttnpassError, match=r"input kq: expected i32\[1,2,70,8\], got uint32"):
        run(lower(imported.graph, "mlx"), mx.array(host), *keys, *values)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@requires("mlx.core", "mlx_lm")
def test_quantized_kv_cache_update_imports_as_quantize(rng, bits, dtype):
    """What ``QuantizedKVCache.update_and_fetch`` runs on new keys: MLX's ``Quantize`` primitive, imported as one
    ``quantize`` per output; every target gives mx.quantize's raw bits (the words as int32)."""
    from attnpass.lowering.targets.mlx.target import to_numpy

    def update(keys):
        return mx.quantize(keys, group_size=64, bits=bits)

    keys = mx.array(random_array(rng, (1, 2, 5, 128), "float32")).astype(getattr(mx, dtype))
    imported = from_mlx(update, keys)
    nodes = [n for n in imported.graph if n.op == "quantize"]
    assert [n.attrs["output"] for n in nodes] == ["wq", "scales", "biases"]
    assert {(n.attrs["group_size"], n.attrs["bits"]) for n in nodes} == {(64, bits)}
    expected = [np.array(update(keys)[0]).view(np.int32)] + [to_numpy(a) for a in update(keys)[1:]]
    for target, x in (("mlx", keys), ("numpy", to_numpy(keys)), ("jax", to_numpy(keys))):
        for got, want in zip(run(lower(imported.graph, target), x), expected):
            assert_bits_equal(np.asarray(got), want)
