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
        assert sdpa.attrs["has_sinks"] and sdpa.attrs["logit_softcap"] is None
        assert result.graph.node(sdpa.inputs[-1]).type.shape == (zoo.HQ,)
        assert any("sinks" in r.message for r in result.applied())
    else:
        assert not sdpa.attrs["has_sinks"] and sdpa.attrs["logit_softcap"] == attention.attn_logit_softcapping
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
