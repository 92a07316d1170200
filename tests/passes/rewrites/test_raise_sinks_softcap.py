"""raise-attention on real model code with attention sinks and logit soft-capping (issue 23).

One attention layer of mlx-lm's gpt_oss (MLX's ``sinks=``, random logits per query head) and of gemma2
(``tanh(s / c) · c`` before the mask), tiny configs as the model zoo (examples/model_zoo.py) builds them,
imported, raised to one ``sdpa`` carrying the variant, lowered to numpy and MLX, and compared with the
module's own output."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from attnpass.backends import run, to_numpy
from attnpass.ir import from_mlx
from attnpass.lowering import lower
from attnpass.passes import RaiseAttention
from tests.util import load_example, requires

pytestmark = requires("mlx.core", "mlx_lm")
zoo = load_example("model_zoo")
S = 6


def layer_case(family: str, dtype: str):
    """``(fn, args, expected)``: layer 0's attention of a tiny ``family`` model on random input, causal mask."""
    import mlx.core as mx

    module = importlib.import_module(f"mlx_lm.models.{family}")
    fields = module.ModelArgs.__dataclass_fields__
    args = {k: v for k, v in {**zoo.COMMON, **zoo.FAMILIES[family]}.items() if k in fields}
    mx.random.seed(3)
    model = module.Model(module.ModelArgs(model_type=family, **args))
    attention = model.model.layers[0].self_attn
    if family == "gpt_oss":
        attention.sinks = mx.random.normal((zoo.HQ,)) * 2  # zeros by default: a splat
    model.set_dtype(mx.bfloat16 if dtype == "bf16" else mx.float32)
    mx.eval(model.parameters())
    x = (mx.random.normal((1, S, zoo.HIDDEN)) * 0.5).astype(mx.bfloat16 if dtype == "bf16" else mx.float32)
    mask = mx.array(np.tril(np.ones((S, S), bool)))

    def fn(x, mask):
        return attention(x, mask)

    return fn, (x, mask), np.asarray(fn(x, mask).astype(mx.float32)).astype(np.float64), attention


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("family", ["gpt_oss", "gemma2"])
def test_the_layer_raises_with_its_variant_and_computes_what_the_module_does(family, dtype):
    fn, args, expected, attention = layer_case(family, dtype)
    imported = from_mlx(fn, *args)
    result = RaiseAttention()(imported.graph)
    (sdpa,) = [n for n in result.graph.nodes() if n.op == "sdpa"]
    if family == "gpt_oss":
        assert sdpa.sinks is not None and sdpa.attrs["logit_softcap"] is None
        assert result.graph.node(sdpa.inputs[-1]).type.shape == (zoo.HQ,)
        assert any("sinks" in r.message for r in result.applied())
    else:
        assert sdpa.sinks is None and sdpa.attrs["logit_softcap"] == attention.attn_logit_softcapping
        assert any("logit_softcap 50" in r.message for r in result.applied())
    host = [to_numpy(a) for a in args]
    for target in ("numpy", "mlx"):
        got = run(lower(result.graph, target), *host, **imported.params).astype(np.float64)
        assert np.max(np.abs(got - expected)) <= zoo.tolerance(dtype, expected), target


def test_the_sinks_matter():
    """Not vacuous: the raised gpt_oss layer with its sinks zeroed differs from the module."""
    fn, args, expected, attention = layer_case("gpt_oss", "f32")
    import mlx.core as mx

    attention.sinks = mx.zeros((zoo.HQ,))
    imported = from_mlx(fn, *args)
    graph = RaiseAttention()(imported.graph).graph
    got = run(lower(graph, "numpy"), *[to_numpy(a) for a in args], **imported.params).astype(np.float64)
    assert np.max(np.abs(got - expected)) > 1e-3


def _capped(order: str):
    """A hand-written capped attention: ``order`` says where the mask and a late scale go around the cap."""
    from attnpass.ir import TensorSpec, ops, trace

    def fn(q, k, v, m):
        s = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * 0.25
        if order == "mask-first":
            s = ops.where(m, s, -1e30)
        s = ops.tanh(s / 30.0) * 30.0
        if order == "scale-after":
            s = s * 0.5
        if order != "mask-first":
            s = ops.where(m, s, -1e30)
        return ops.matmul(ops.softmax(s, axis=-1), v)

    specs = [TensorSpec((1, 2, 4, 8)), TensorSpec((1, 2, 5, 8)), TensorSpec((1, 2, 5, 8)), TensorSpec((4, 5), "bool")]
    return trace(fn, *specs, name="capped")


@pytest.mark.parametrize(
    "order, says",
    [
        ("mask-first", "softcap_form"),
        ("scale-after", "softcap_form"),
        ("cap-then-mask", None),
    ],
)
def test_a_cap_raises_only_between_the_scales_and_the_masks(order, says):
    graph = _capped(order)
    result = RaiseAttention()(graph)
    sdpas = [n for n in result.graph.nodes() if n.op == "sdpa"]
    if says is None:
        (sdpa,) = sdpas
        assert sdpa.attrs["logit_softcap"] == 30.0 and sdpa.attrs["scale"] == 0.25
        rng = np.random.default_rng(0)
        xs = [rng.normal(size=t.shape).astype(np.float32) * 3 for t in graph.input_types()[:3]]
        xs.append(np.tril(np.ones((4, 5), bool)))
        assert np.allclose(run(lower(result.graph, "numpy"), *xs), run(lower(graph, "numpy"), *xs), atol=1e-6)
        return
    assert not sdpas
    assert [r.reason for r in result.declined() if r.rule == "attention"] == [says], result.remarks


def test_a_per_head_mask_laid_out_kv_heads_by_group_is_raised_merged():
    """A root whose consecutive axes walk one score axis row-major ([Hkv, G] of the heads) is laid out merged
    as [Hq]: the per-head mask of a GQA attention written [B, Hkv, G, S, T] raises to a [1, Hq, S, T] mask."""
    from attnpass.ir import TensorSpec, ops, trace

    hkv, g, s, t, d = 2, 3, 4, 5, 8

    def fn(q, k, v, m):  # q [1, Hq, S, D] viewed [1, Hkv, G, S, D]; k, v [1, Hkv, 1, T, D]
        q = ops.reshape(q, (1, hkv, g, s, d))
        scores = ops.matmul(q, ops.transpose(ops.broadcast_to(k, (1, hkv, g, t, d)), (0, 1, 2, 4, 3))) * 0.25
        probs = ops.softmax(ops.where(m, scores, float("-inf")), axis=-1)
        return ops.matmul(probs, ops.broadcast_to(v, (1, hkv, g, t, d)))

    specs = [TensorSpec((1, hkv * g, s, d)), TensorSpec((1, hkv, 1, t, d)), TensorSpec((1, hkv, 1, t, d)),
             TensorSpec((1, hkv, g, s, t), "bool")]  # fmt: skip
    graph = trace(fn, *specs)
    result = RaiseAttention()(graph)
    (sdpa,) = [n for n in result.graph.nodes() if n.op == "sdpa"]
    assert result.graph.node(sdpa.inputs[3]).type.shape == (1, hkv * g, s, t)
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=sp.shape).astype(np.float32) for sp in specs[:3]]
    m = rng.random((1, hkv, g, s, t)) < 0.7
    m[..., 0] = True
    xs.append(m)
    assert np.allclose(run(lower(result.graph, "numpy"), *xs), run(lower(graph, "numpy"), *xs), atol=1e-6)
