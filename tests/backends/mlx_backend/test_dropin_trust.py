"""What ``optimize`` promises a model it cannot compile a call of, a model that inspects itself, and the shadow mode.

- A program that fails to import, rewrite or lower runs the client's function (mlx-lm's helper), bit for bit,
  with one ``FallbackWarning`` per signature; ``strict=True`` raises ``SpecializationError``. It never runs
  attnpass's own program on real arrays.
- phi-2, phixtral, stablelm and cohere2 call the helper with float32 queries (stablelm: and keys) over float16
  values, which MLX promotes: their prompts over the traced programs' bounds (a prefill of more than 64 rows, a
  call without a cache) route, bit for bit, in float16, bfloat16 and float32.
- The optimized model's ``__call__`` keeps its signature: mlx-lm's ``input_embeddings`` generation runs.
- ``check=True`` computes every routed call both ways and raises, naming the layer, on a difference beyond the
  program's stated numerics.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest

from tests.util import assert_bits_equal, lazy_import, load_example, requires

pytestmark = requires("mlx.core", "mlx_lm")
mx = lazy_import("mlx.core")
zoo = load_example("model_zoo")

PROMPT = 80  # over the KVCache's 64 prefill rows: its calls go to the traced structured_attention program
PROMOTING = {  # families calling the helper with queries of another dtype than the values -> ModelArgs
    "phi": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
            "intermediate_size": 128, "vocab_size": 128},
    "phixtral": {"num_layers": 2, "model_dim": 64, "num_heads": 4, "num_local_experts": 2, "num_experts_per_tok": 1,
                 "vocab_size": 128, "rotary_dim": 8},
    "stablelm": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "vocab_size": 128, "intermediate_size": 128, "rope_theta": 10000.0, "use_qkv_bias": False,
                 "partial_rotary_factor": 0.25, "layer_norm_eps": 1e-5},
    "cohere2": {"num_hidden_layers": 2, "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 128, "intermediate_size": 128, "sliding_window": 16,
                "sliding_window_pattern": 2},
}  # fmt: skip
DTYPES = ("float16", "bfloat16", "float32")


def tiny(family: str, dtype: str):
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    fields = {f.name for f in dataclasses.fields(module.ModelArgs)}
    args = {"model_type": family, **{k: v for k, v in PROMOTING[family].items() if k in fields}}
    model = module.Model(module.ModelArgs(**args))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def logits(model, cached: bool):
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.arange(PROMPT)[None] % 100
    with zoo.bf16_gather_mm():  # phixtral's experts: MLX's CPU gather_mm is float32 only
        out = model(tokens, cache=make_prompt_cache(model)) if cached else model(tokens)
        mx.eval(out)
    return out


def as_numpy(x):
    import numpy as np

    return np.array(x.astype(mx.float32)) if x.dtype == mx.bfloat16 else np.array(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(PROMOTING))
def test_families_promoting_their_queries_route_bit_for_bit(family, dtype):
    from attnpass.backends.mlx import optimize

    model = tiny(family, dtype)
    plain = [logits(model, cached) for cached in (True, False)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FallbackWarning: every signature compiles
        with optimize(model, min_keys=0, strict=True, check=True) as opt:
            routed = [logits(model, cached) for cached in (True, False)]
    # imported with the promotion as casts, then each call routed or declined as one fused call (a causal prefill
    # of more than 8 rows on CPU keeps MLX's fused call): never a failed import, never attnpass's ops on arrays
    # (stablelm casts its keys after the cache's fetch: declined not_fetched, as they are not the cache's buffer)
    assert opt.routed + sum(opt.declined.values()) == 4
    assert set(opt.declined) <= {"fused_kernel_serves", "not_fetched"}, dict(opt.declined)
    for got, expected in zip(routed, plain):
        assert got.dtype == expected.dtype
        assert_bits_equal(as_numpy(got), as_numpy(expected))


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_promoted_decode_steps_run_a_compiled_program_bit_for_bit(dtype):
    # phi's one-row steps on a sliding-window cache: float32 queries over its float16 / bfloat16 buffer, each call a
    # compiled program holding the promotion's casts, mlx-lm's helper's bits (check=True compares every call)
    from mlx_lm.models.cache import make_prompt_cache

    from attnpass.backends.mlx import optimize

    model = tiny("phi", dtype)

    def run():
        cache = make_prompt_cache(model, max_kv_size=32)
        outs = [model(mx.arange(PROMPT)[None] % 100, cache=cache)]
        outs += [model(mx.array([[token]]), cache=cache) for token in (5, 6, 7)]
        mx.eval(outs)
        return outs

    plain = run()
    with optimize(model, min_keys=0, strict=True, check=True) as opt:
        routed = run()
    assert opt.routed == 6 and opt.declined == {"fused_kernel_serves": 2}, (opt.routed, dict(opt.declined))
    (entry,) = opt.programs["attention"].specializations
    assert entry.compiled and entry.ops["cast"] == 2
    for got, expected in zip(routed, plain):
        assert_bits_equal(as_numpy(got), as_numpy(expected))


@pytest.fixture
def failing_program(monkeypatch):
    """The traced structured_attention program made to fail its import: ``optimize``'s fallback is then tested."""
    from attnpass.backends.mlx import programs
    from attnpass.ir import ShapeError

    def broken(*args, **kwargs):
        raise ShapeError("a program that cannot be imported")

    spec = dataclasses.replace(programs.PROGRAMS["structured_attention"], fn=broken)
    monkeypatch.setitem(programs.PROGRAMS, "structured_attention", spec)


def test_a_program_that_fails_runs_the_clients_function_with_one_warning(failing_program):
    from attnpass.backends.mlx import optimize
    from attnpass.backends.specialize import FallbackWarning

    model = tiny("phi", "float16")
    plain = logits(model, cached=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with optimize(model, min_keys=0) as opt:
            first, second = logits(model, cached=True), logits(model, cached=True)
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1 and "a program that cannot be imported" in str(fallbacks[0].message)
    assert opt.routed == 0 and opt.declined == {"no_program": 4}
    assert_bits_equal(as_numpy(first), as_numpy(plain))
    assert_bits_equal(as_numpy(second), as_numpy(plain))


def test_strict_raises_specialization_error_when_a_program_fails(failing_program):
    from attnpass.backends.mlx import optimize
    from attnpass.backends.specialize import SpecializationError

    model = tiny("phi", "float16")
    with optimize(model, min_keys=0, strict=True), pytest.raises(SpecializationError, match="import failed"):
        logits(model, cached=True)


def test_the_optimized_call_keeps_its_signature_and_input_embeddings_generate_as_plain():
    from mlx_lm.generate import generate_step

    from attnpass.backends.mlx import optimize

    from attnpass.models.tiny_lm import tiny_lm

    model = tiny_lm("llama", dtype="float32")
    plain_signature = inspect.signature(model.__call__)
    prompt = mx.arange(12) % 100
    embeddings = model.model.embed_tokens(prompt)

    def tokens():
        steps = generate_step(prompt, model, max_tokens=6, input_embeddings=embeddings)
        return [int(t) for t, _ in steps]

    plain = tokens()
    with optimize(model, min_keys=0):
        assert inspect.signature(model.__call__) == plain_signature
        assert "input_embeddings" in inspect.signature(model.__call__).parameters
        assert tokens() == plain


def test_check_names_the_layer_of_a_call_beyond_its_stated_numerics(monkeypatch):
    from attnpass.backends.mlx import optimize, programs
    from attnpass.backends.mlx.check import CheckError
    from mlx_lm.models.cache import make_prompt_cache

    from tests.backends.mlx_backend.test_dropin_mlx_lm_router import mla_model

    model = mla_model("deepseek_v3", num_hidden_layers=2)
    tokens = mx.arange(24)[None] % 100
    with optimize(model, min_keys=0, check=True) as opt:  # the latent form, within its stated 1e-5: no error
        model(tokens, cache=make_prompt_cache(model))
    assert opt.routed == 2
    exact = dataclasses.replace(programs.PROGRAMS["mla_attention"], numerics={})  # claim bits it does not keep
    monkeypatch.setitem(programs.PROGRAMS, "mla_attention", exact)
    with optimize(model, min_keys=0, check=True), pytest.raises(CheckError) as raised:
        model(tokens, cache=make_prompt_cache(model))
    message = str(raised.value)
    assert "model.layers.0.self_attn" in message and "bit for bit in float32" in message
    assert "program mla_attention" in message and "cache KVCache" in message


def test_check_is_read_from_the_environment_and_an_explicit_argument_wins(monkeypatch):
    from attnpass.backends.mlx import optimize
    from attnpass.ir import AttnpassError
    from attnpass.backends.mlx.check import CHECK_ENV

    model = tiny("phi", "float32")
    monkeypatch.setenv(CHECK_ENV, "on")
    with optimize(model) as opt:
        assert opt.check
    with optimize(model, check=False) as opt:
        assert not opt.check
    monkeypatch.delenv(CHECK_ENV)
    with optimize(model) as opt:
        assert not opt.check
    with pytest.raises(AttnpassError, match="optimize: check must be True or False.*got 'yes'"):
        optimize(model, check="yes")


def test_check_leaves_a_call_it_cannot_evaluate_lazy_and_counts_it_unchecked():
    """A model a test builds and never evaluates: its queries come from what MLX's CPU cannot compute (a float16
    gather_mm). Under check=True the call is not compared and stays lazy (the test's outcome is plain's); the
    program's output fails to evaluate exactly as the client's."""
    import io

    from mlx_lm.models.cache import KVCache

    from attnpass.backends.mlx import optimize
    from tests.backends.mlx_backend.lm_probe import Probe

    experts = mx.gather_mm(mx.ones((4, 2, 64), mx.float16), mx.ones((3, 64, 64), mx.float16),
                           rhs_indices=mx.array([0, 1, 2, 0]))  # fmt: skip
    q, (k, v) = experts.reshape(1, 4, 2, 64), mx.ones((2, 1, 2, 1, 64), mx.float16)
    probe = Probe()
    with optimize(probe, min_keys=0, check=True) as opt:
        out = probe(q, k, v, KVCache())  # no error: nothing was evaluated
        assert opt.routed == 1 and opt.unchecked == 1
        report = io.StringIO()
        opt.explain(file=report)
    assert "1 routed call(s) not compared" in report.getvalue()
    with pytest.raises(RuntimeError, match="GatherMM"):
        mx.eval(out)
