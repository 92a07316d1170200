"""The library zoo (examples/library_zoo.py, issue 32 item 6): penzai, Keras 3 and KerasHub on the JAX backend,
mlx-whisper, mlx-embeddings, MaxText and gemma (Python >= 3.12: `make zoo-jax-libraries`), EasyDeL (its own venv:
`make zoo-easydel`). Every case imports;
lowered to every installed target it is within the zoo's tolerance of the library's own output (float32 1e-4;
bfloat16 two steps of the largest value on its backend, four elsewhere); raise-attention raises every attention
layer, or declines the cases of :data:`library_zoo.DECLINED` with that reason code on every layer. Keras reads
its backend when it is first imported, so its cases run in a subprocess whose environment sets
``KERAS_BACKEND=jax``."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from attnpass.ir import ModelImportError, from_mlx
from tests.util import EXAMPLES_DIR, TARGET_MODULES, available, load_example, requires

lz = load_example("library_zoo")
zoo = lz.zoo

KERAS_HUB = pytest.mark.skipif(
    not available("keras_hub"),
    reason="needs keras_hub: pip install --no-deps keras-hub (not in an extra: it requires tensorflow-text)",
)


def installed_targets() -> tuple[str, ...]:
    return tuple(t for t in zoo.TARGETS if all(available(m) for m in TARGET_MODULES[t]))


def check(row: dict) -> None:
    """One case's row (``library_zoo.row_json``'s fields): imported, within the tolerances, raised or declined."""
    name = row["name"]
    assert row["imported"] == "yes", f"{name}: {row['imported']}"
    assert row["ok"], f"{name}: error {row['error']} > {row['bound']}; elsewhere {row['elsewhere']}"
    reason = next((r for prefix, r in lz.DECLINED.items() if name.startswith(prefix)), None)
    if reason is None:
        assert row["raised"] == row["layers"], f"{name}: raised {row['raised']}/{row['layers']}: {row['remark']}"
    else:
        assert row["raised"] == 0 and f"(attention, {reason})" in row["remark"], f"{name}: {row['remark']}"


NEEDS = {"penzai": ("jax", "penzai"), "mlx_whisper": ("mlx.core", "mlx_whisper"),
         "mlx_embeddings": ("mlx.core", "mlx_embeddings"), "maxtext": ("jax", "maxtext"),
         "gemma": ("jax", "gemma", "kauldron"), "easydel": ("jax", "easydel")}  # fmt: skip
IN_PROCESS = [c for c in lz.cases() if lz.library(c) in NEEDS]
EASYDEL = pytest.mark.skipif(
    not available("easydel"),
    reason="needs easydel 0.3.0, which pins jax 0.9 and flax 0.12.3: a venv of its own, made by `make zoo-easydel`",
)


def needs(case: zoo.Case) -> list[pytest.MarkDecorator]:
    """The marks that skip ``case`` where its library is not installed, saying where it is."""
    return [EASYDEL] if lz.library(case) == "easydel" else [requires(*NEEDS[lz.library(case)])]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=needs(c)) for c in IN_PROCESS])
def test_library_case(case):
    targets = installed_targets()
    row = zoo.run_case(case, targets)
    if lz.import_declined(case):
        assert lz.handled(row), f"{case.name}: {row.imported}"
        return
    assert sorted(row.elsewhere) == sorted(set(targets) - {case.backend})
    check(json.loads(lz.row_json(row)))


DECODE_STEPS = [c for c in lz.cases() if lz.library(c) in ("maxtext", "gemma", "easydel") and "/decode/" in c.name]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=needs(c)) for c in DECODE_STEPS])
def test_the_dropin_jit_runs_the_library_decode_step(case):
    """attnpass's ``jit`` (strict: imported and rewritten, no fallback to ``jax.jit``) on the library's own decode
    step, over its own cache: the logits and the updated cache within the zoo's tolerance of the library's."""
    _fn, _args, reference = case.make()
    assert lz.dropin_jit_error(case) <= zoo.tolerance(case.dtype, reference())


@EASYDEL
def test_easydel_default_bf16_attention_is_explained_as_bf16_not_float32_within_1e_5():
    """EasyDeL's default: a float32 model whose attention (and cache) is bfloat16. Under attnpass's ``jit`` both
    layers' attentions are raised; ``explain()`` states the bfloat16 attention's bound and that its rounding
    reaches the float32 logits (measured past 1e-5 here, within the bfloat16 bound), not 'float32 within 1e-5';
    the all-float32 model (the control) is stated and held to 1e-5."""
    from attnpass.backends.jax import jit

    for dtype, claim in (("f32-bf16-attention", "bf16 attention inside a float32 function"), ("f32", "float32 within")):
        case = lz.easydel_case("llama", "decode", dtype)
        fn, args, reference = case.make()
        fast = jit(fn, strict=True)
        error = float(np.max(np.abs(zoo.flat_output(fast(*args)).astype(np.float64) - reference())))
        out = io.StringIO()
        fast.explain(file=out, summary=True)
        note = out.getvalue().splitlines()[1]
        assert "numerics: attention raised to sdpa in 1 of 1 signature(s)" in note and claim in note, note
        assert sum(r.rule == "attention" and r.kind == "applied" for r in fast.specializations[0].remarks) == 2
        if dtype == "f32":
            assert error <= 1e-5 and "bf16" not in note
        else:
            assert 1e-5 < error <= zoo.tolerance("bf16", reference()) and "float32 within 1e-5" not in note


def _keras_rows(selection: str) -> list[dict]:
    """The cases whose name contains ``selection``, run in a subprocess on Keras's JAX backend."""
    script = EXAMPLES_DIR / "library_zoo.py"
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    done = subprocess.run(
        [sys.executable, str(script), "--json", "--everywhere", selection], capture_output=True, text=True, env=env
    )
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rows, done.stderr[-2000:]
    return rows


@requires("jax", "mlx.core", "keras")
def test_keras_multi_head_attention_on_the_jax_backend():
    rows = _keras_rows("keras.MultiHeadAttention")
    assert [r["name"] for r in rows] == [c.name for c in lz.cases() if c.name.startswith("keras.MultiHeadAttention")]
    for row in rows:
        check(row)


@KERAS_HUB
@requires("jax", "mlx.core", "keras")
def test_keras_hub_models_on_the_jax_backend():
    """Llama's backbone with a padding mask and its CausalLM's cached decode step raise; Gemma's, GPT-2's and
    BERT's masked softmax (``where(mask, softmax(...), 0)``: a row without keys is 0, not the mean of V) is
    declined by name, and the unraised graph still computes the backbone's output."""
    rows = _keras_rows("keras_hub.")
    assert len(rows) == sum(c.name.startswith("keras_hub.") for c in lz.cases())
    for row in rows:
        check(row)


@requires("mlx.core", "mlx_embeddings")
def test_an_encoder_left_in_training_mode_is_declined_with_the_model_eval_hint():
    import mlx.core as mx
    from mlx_embeddings.models import bert

    model = bert.Model(bert.ModelArgs(model_type="bert", num_hidden_layers=1, num_attention_heads=2, hidden_size=8,
                                      intermediate_size=16, max_position_embeddings=16, vocab_size=32))  # fmt: skip
    mx.eval(model.parameters())
    ids, mask = mx.array([[1, 2, 3, 4]]), mx.array([[1, 1, 1, 0]])
    with pytest.raises(ModelImportError, match=r"RandomBits.*training mode.*call model\.eval\(\) first"):
        from_mlx(lambda ids, mask: model(ids, attention_mask=mask).last_hidden_state, ids, mask)


KERAS_NAMES = """
import keras, numpy as np
from attnpass.ir import from_jax
layer = keras.layers.Dense(80, name="proj")
x = np.ones((2, 4), np.float32)
layer(x)
imported = from_jax(lambda x: layer(x), x)
print(imported.graph.inputs, imported.graph.node(imported.graph.inputs[1]).attrs.get("path"))
"""


@requires("jax", "keras")
def test_keras_weights_are_named_by_their_variable_paths():
    """A Keras layer's weights become inputs named after the variable's own path (``proj/kernel``), not after
    the layer object's internals."""
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    done = subprocess.run([sys.executable, "-c", KERAS_NAMES], capture_output=True, text=True, env=env)
    assert done.stdout.strip() == "('x', 'layer_proj_kernel') layer.proj/kernel", done.stderr[-2000:]
