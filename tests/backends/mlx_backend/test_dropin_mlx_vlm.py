"""``optimize`` on mlx-vlm language models: mlx-vlm's own helper as a registered client over mlx-vlm's own caches.

Each model is a tiny random language model built from its family's ``TextConfig``, run plain and optimized (in
the shadow mode: every routed call also computed by mlx-vlm's helper): a prompt over the KVCache's prefill rows
on the model's own caches, then decode steps; logits bit for bit, calls routed over mlx-vlm's ``KVCache``,
``RotatingKVCache`` and ``ChunkedKVCache``, the rest declined by code. A model calling no client raises
``NoClientError`` naming what its modules import.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from tests.util import assert_bits_equal, lazy_import, load_example, requires

pytestmark = requires("mlx.core", "mlx_lm", "mlx_vlm")
mx = lazy_import("mlx.core")
zoo = load_example("model_zoo")

TINY = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "rms_norm_eps": 1e-5,
}  # fmt: skip
FAMILIES = {  # family -> (extra TextConfig fields, the cache classes its make_cache gives, calls routed)
    "gemma3": ({"model_type": "gemma3_text", "sliding_window": 16, "sliding_window_pattern": 2},
               ["RotatingKVCache", "KVCache"], 6),
    "llama4": ({"model_type": "llama4"}, ["ChunkedKVCache", "ChunkedKVCache"], 6),
}  # fmt: skip


def language_model(family: str, dtype: str, extra: dict):
    config = importlib.import_module(f"mlx_vlm.models.{family}.config")
    language = importlib.import_module(f"mlx_vlm.models.{family}.language")
    fields = {f.name for f in dataclasses.fields(config.TextConfig)}
    mx.random.seed(0)
    model = language.LanguageModel(config.TextConfig(**{k: v for k, v in {**TINY, **extra}.items() if k in fields}))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def run(model):
    cache = model.make_cache()
    with zoo.bf16_gather_mm():  # llama4's experts: MLX's CPU gather_mm is float32 only
        outs = [model(mx.arange(80)[None] % 100, cache=cache).logits]
        outs += [model(mx.array([[token]]), cache=cache).logits for token in (3, 4, 5)]
        mx.eval(outs)
    return outs, cache


def as_numpy(x):
    import numpy as np

    return np.array(x.astype(mx.float32)) if x.dtype == mx.bfloat16 else np.array(x)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_an_mlx_vlm_language_model_routes_over_mlx_vlms_caches_bit_for_bit(family, dtype):
    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.clients import MLX_VLM_HELPER

    extra, caches, routed = FAMILIES[family]
    model = language_model(family, dtype, extra)
    plain, cache = run(model)
    assert [type(c).__module__ for c in cache] == ["mlx_vlm.models.cache"] * len(cache)
    assert [type(c).__name__ for c in cache] == caches
    with optimize(model, min_keys=0, strict=True, check=True) as opt:
        assert set(opt.modules.values()) == {MLX_VLM_HELPER}
        got, _ = run(model)
    # the 80-row prefills are kept as MLX's fused call (a causal prefill of more than 8 rows on CPU)
    assert opt.routed == routed and opt.declined == {"fused_kernel_serves": 2}, (opt.routed, dict(opt.declined))
    for a, b in zip(got, plain):
        assert_bits_equal(as_numpy(a), as_numpy(b))


def test_mlx_vlms_unrouted_caches_are_declined_by_name():
    from mlx_vlm.models.cache import ConcatenateKVCache

    from attnpass.backends.mlx import optimize

    extra, _, _ = FAMILIES["gemma3"]
    model = language_model("gemma3", "float32", extra)
    plain = model(mx.arange(8)[None], cache=[ConcatenateKVCache(), ConcatenateKVCache()]).logits
    with optimize(model, min_keys=0) as opt:
        got = model(mx.arange(8)[None], cache=[ConcatenateKVCache(), ConcatenateKVCache()]).logits
    assert opt.routed == 0 and opt.declined == {"cache_unrouted": 2}
    assert "ConcatenateKVCache" in opt.declines["cache_unrouted"].message
    assert_bits_equal(as_numpy(got), as_numpy(plain))


def test_a_model_calling_no_client_is_refused_by_code_naming_what_it_calls():
    import mlx.nn as nn

    from attnpass.backends.mlx import optimize
    from attnpass.backends.mlx.optimized import NoClientError

    class Direct(nn.Module):
        def __call__(self, q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0)

    with pytest.raises(NoClientError) as raised:
        optimize(Direct())
    message = str(raised.value)
    assert raised.value.code == "no_client" and isinstance(raised.value, ValueError)
    assert "no_client" in message and __name__ in message
    assert "mlx_lm.models.base.scaled_dot_product_attention" in message
    assert "mlx_vlm.models.base.scaled_dot_product_attention" in message
