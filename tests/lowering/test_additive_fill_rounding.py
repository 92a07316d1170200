"""An additive finite fill is added in the source's dtype on every route and target (issue 32, item 7).

``softmax(q·kᵀ·s + m) · v`` with a row of ``m`` at ``-1e9`` (BERT-style padding) or the dtype's lowest
value: the source rounds ``score + fill`` to the fill for every key of that row, so the row softmaxes to
equal weights, the mean of V. The numpy reference used to add the mask in float64 and return softmax of
the scores instead (0.16 off after raise-attention). Each MLX and JAX source, imported and run through
each route (raise-attention, then one rewrite), is lowered to numpy, MLX and JAX and compared with the
source: within the dtype's tolerance everywhere, and the fully covered rows the mean of V.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import DType, from_jax, from_mlx
from attnpass.lowering import lower
from attnpass.passes import PassManager, parse_pipeline
from tests.util import assert_close, lazy_import, random_array, requires, target_params

pytestmark = requires("mlx.core", "jax")

mx = lazy_import("mlx.core")
jnp = lazy_import("jax.numpy")
jax = lazy_import("jax")

HQ, HKV, S, T, D = 24, 2, 4, 8, 16  # GQA 12 over 4 rows: head-chunk applies; T = 2 shards of 4 for split-kv
ROUTES = (
    "",  # the import as it is
    "raise-attention",
    "raise-attention,canonicalize",
    "raise-attention,head-chunk",
    "raise-attention,split-kv",
    "raise-attention,block-sparse",
    "raise-attention,decompose-sdpa{device=cpu}",
    "raise-attention,decompose-sdpa{device=gpu}",
)
COVERED = (1, 3)  # the rows every key of which carries the fill


def _mask(dtype: DType) -> np.ndarray:
    m = np.zeros((S, T), np.float32)
    m[1] = -1e9
    m[2, : T // 2] = -1e9
    m[3] = float(dtype.finfo.min)
    return m.astype(dtype.numpy)


def _mlx_source(q, k, v, m):
    k, v = mx.repeat(k, HQ // HKV, axis=1), mx.repeat(v, HQ // HKV, axis=1)
    return mx.softmax((q @ k.transpose(0, 1, 3, 2)) * 0.25 + m, axis=-1) @ v


def _jax_source(q, k, v, m):
    k, v = jnp.repeat(k, HQ // HKV, axis=1), jnp.repeat(v, HQ // HKV, axis=1)
    return jax.nn.softmax((q @ jnp.swapaxes(k, -1, -2)) * 0.25 + m, axis=-1) @ v


def _case(source: str, dtype: DType):
    """The imported graph, the host inputs and the source's own output (a numpy array)."""
    rng = np.random.default_rng(32)
    q, k, v = (random_array(rng, shape, dtype) for shape in ((1, HQ, S, D), (1, HKV, T, D), (1, HKV, T, D)))
    host = (q, k, v, _mask(dtype))
    if source == "mlx":
        args = [mx.array(x.astype(np.float32)).astype(getattr(mx, dtype.value)) for x in host]
        out = _mlx_source(*args)
        return from_mlx(_mlx_source, *args), host, np.array(out.astype(mx.float32)).astype(dtype.numpy)
    return from_jax(_jax_source, *host), host, np.asarray(_jax_source(*host))


@pytest.mark.parametrize("target", target_params("numpy", "mlx", "jax"))
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "import")
@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=lambda d: d.short)
@pytest.mark.parametrize("source", ["mlx", "jax"])
def test_a_row_the_fill_covers_is_the_mean_of_v_on_every_route_and_target(source, dtype, route, target):
    imported, host, expected = _case(source, dtype)
    graph = PassManager(parse_pipeline(route)).run(imported.graph).graph if route else imported.graph
    if route and "device=cpu" not in route:
        assert "softmax" not in {n.op for n in graph.nodes()}  # raised: the route is the fused sdpa's
    out = run(lower(graph, target), *host, **imported.params)
    assert_close(out, expected, dtype)
    mean_v = np.repeat(host[2].astype(np.float64).mean(axis=2, keepdims=True), HQ // HKV, axis=1)
    for row in COVERED:
        assert_close(out[:, :, row : row + 1], mean_v.astype(dtype.numpy), dtype)
