"""Imported weights are first-class: module and pytree paths, the calling convention, safetensors beside the JSON.

Inputs made from captured arrays are named after where the function reaches
them (``model.layers.0.self_attn.q_proj.weight`` -> ``model_layers_0_self_attn_q_proj_weight``)
and keep that path as their ``path`` attribute; ``lower(imp.graph, target)(*args, **imp.params)``
runs them; ``ImportedGraph.save`` writes the graph JSON and a safetensors file
keyed by path, ``ImportedGraph.load`` and the CLI read both, and a graph whose
weights are missing says so.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.cli.main import main
from attnpass.ir import Graph, ImportedGraph, from_jax, from_mlx
from attnpass.ir.frontends.weights import WeightsError, weight_inputs, weights_file
from attnpass.lowering import lower
from tests.util import assert_bits_equal, random_array, requires

mlx_only = requires("mlx.core", "mlx.nn")


def _mlp(seed: int = 0):
    """A two-layer MLX module with biases: module paths ``layers.0.weight`` ... ``norm.weight``."""
    import mlx.core as mx
    import mlx.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [nn.Linear(16, 80), nn.Linear(80, 16)]
            self.norm = nn.RMSNorm(16)

        def __call__(self, x):
            return self.norm(self.layers[1](nn.gelu(self.layers[0](x))))

    mx.random.seed(seed)
    block = Block()
    mx.eval(block.parameters())
    return block


@mlx_only
def test_mlx_weights_keep_their_module_paths(rng):
    import mlx.core as mx

    block = _mlp()
    x = mx.array(random_array(rng, (2, 16), "float32"))
    imported = from_mlx(block, x)
    paths = weight_inputs(imported.graph)
    assert paths == {
        "layers_0_weight": "layers.0.weight",
        "layers_0_bias": "layers.0.bias",
        "layers_1_weight": "layers.1.weight",
    }  # fmt: skip  (the 16-element bias and norm weight are inlined constants)
    assert imported.graph.inputs == ("x", *paths)
    np.testing.assert_array_equal(imported.params["layers_0_weight"], np.array(block.layers[0].weight))
    out = lower(imported.graph, "mlx")(np.array(x), **imported.params)  # the documented calling convention
    np.testing.assert_array_equal(np.array(out), np.array(block(x)))


@mlx_only
def test_a_closure_names_the_module_unprefixed_and_other_state_by_its_variable(rng):
    import mlx.core as mx

    block = _mlp()
    memory = {"keys": [mx.array(random_array(rng, (8, 16), "float32"))]}
    mx.eval(memory["keys"][0])

    def step(x):
        return block(x) + (x @ memory["keys"][0].T).sum()

    imported = from_mlx(step, mx.array(random_array(rng, (2, 16), "float32")))
    paths = set(weight_inputs(imported.graph).values())
    assert paths == {"layers.0.weight", "layers.0.bias", "layers.1.weight", "memory.keys.0"}


@requires("jax")
def test_jax_pytree_arguments_and_captured_modules_keep_their_paths(rng):
    import jax.numpy as jnp

    params = {"layers": [{"w": jnp.asarray(random_array(rng, (16, 16), "float32"))}], "wq": jnp.ones((16, 16))}
    x = random_array(rng, (2, 16), "float32")
    imported = from_jax(lambda p, x: x @ p["wq"] @ p["layers"][0]["w"], params, x)
    graph = imported.graph
    assert graph.inputs == ("p_layers_0_w", "p_wq", "x")
    assert [graph.node(n).attrs["path"] for n in graph.inputs] == ["p['layers'][0]['w']", "p['wq']", None]
    assert weight_inputs(graph) == {}  # arguments: the caller passes them


@requires("equinox", "jax")
def test_equinox_module_weights_are_named_by_pytree_path(rng):
    import equinox as eqx
    import jax

    linear = eqx.nn.Linear(16, 8, key=jax.random.PRNGKey(0))
    x = random_array(rng, (16,), "float32")
    imported = from_jax(lambda x: linear(x), x)
    assert weight_inputs(imported.graph) == {"weight": "weight"}
    got = run(lower(imported.graph, "jax"), x, **imported.params)
    np.testing.assert_allclose(got, np.asarray(linear(x)), rtol=1e-6)


@mlx_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_save_and_load_round_trip_graph_and_safetensors(tmp_path, rng, dtype):
    import mlx.core as mx
    from safetensors import safe_open

    block = _mlp()
    block.set_dtype(getattr(mx, dtype))
    mx.eval(block.parameters())  # else the captured arrays are the float32 ones and an AsType
    x = mx.array(random_array(rng, (2, 16), "float32")).astype(getattr(mx, dtype))
    imported = from_mlx(block, x)
    graph_file, params_file = imported.save(tmp_path / "block.json")
    assert params_file == tmp_path / "block.safetensors" == weights_file(graph_file)
    with safe_open(str(params_file), "numpy") as f:
        assert sorted(f.keys()) == ["layers.0.bias", "layers.0.weight", "layers.1.weight"]
        assert f.metadata()["format"] == "attnpass.weights"
    assert params_file.read_bytes()[:1] != b"\x80"  # not a pickle
    loaded = ImportedGraph.load(graph_file)
    assert loaded.graph == imported.graph
    for name, value in imported.params.items():
        assert_bits_equal(loaded.params[name], value)
    host = np.array(x.astype(mx.float32)).astype(imported.graph.node("x").type.dtype.numpy)
    expected = run(lower(imported.graph, "mlx"), host, **imported.params)
    assert_bits_equal(run(lower(loaded.graph, "mlx"), host, **loaded.params), expected)


@mlx_only
def test_the_json_alone_names_its_weights_and_loading_it_says_what_is_missing(tmp_path, rng):
    import mlx.core as mx

    imported = from_mlx(_mlp(), mx.array(random_array(rng, (2, 16), "float32")))
    path = tmp_path / "alone.json"
    path.write_text(imported.graph.to_json())
    inputs = {n["name"]: n["attrs"]["path"] for n in json.loads(path.read_text())["nodes"] if n["op"] == "input"}
    assert inputs["layers_0_weight"] == "layers.0.weight" and inputs["x"] is None
    missing = r"3 imported weight input\(s\) \(layers.0.weight, .*no weights file beside it"
    with pytest.raises(WeightsError, match=missing):
        ImportedGraph.load(path)
    assert Graph.from_json(path.read_text()) == imported.graph  # the graph itself loads


@mlx_only
def test_weights_that_do_not_fit_the_graph_are_refused(tmp_path, rng):
    import mlx.core as mx
    from safetensors.numpy import save_file

    imported = from_mlx(_mlp(), mx.array(random_array(rng, (2, 16), "float32")))
    graph_file, params_file = imported.save(tmp_path / "g.json")
    tensors = {path: imported.params[name] for name, path in weight_inputs(imported.graph).items()}
    save_file({**tensors, "layers.0.weight": np.zeros((3, 3), np.float32)}, str(params_file))
    with pytest.raises(WeightsError, match=r"weight layers.0.weight is float32\[3, 3\], but graph .* is f32\[80,16\]"):
        ImportedGraph.load(graph_file)
    del tensors["layers.1.weight"]
    save_file(tensors, str(params_file))
    with pytest.raises(WeightsError, match=r"no tensor for weight\(s\) layers.1.weight"):
        ImportedGraph.load(graph_file)


@mlx_only
def test_cli_reads_the_sibling_weights_and_writes_them_beside_the_output(tmp_path, rng, capsys, monkeypatch):
    import mlx.core as mx

    monkeypatch.chdir(tmp_path)
    imported = from_mlx(_mlp(), mx.array(random_array(rng, (2, 16), "float32")))
    imported.save("g.json")
    assert main(["run", "-p", "dce", "g.json", "-o", "out.json"]) == 0
    assert "// wrote out.safetensors: 3 weights" in capsys.readouterr().out
    back = ImportedGraph.load("out.json")
    for name, value in imported.params.items():
        assert_bits_equal(back.params[name], value)
    (tmp_path / "elsewhere.safetensors").write_bytes((tmp_path / "g.safetensors").read_bytes())
    (tmp_path / "g.safetensors").unlink()
    assert main(["run", "-p", "dce", "g.json", "-o", "again.json"]) == 1
    assert "no weights file beside it (g.safetensors)" in capsys.readouterr().err
    assert main(["run", "-p", "dce", "g.json", "--params", "elsewhere.safetensors", "-o", "again.json"]) == 0
    assert ImportedGraph.load("again.json").params.keys() == imported.params.keys()


def test_two_weight_inputs_with_one_path_are_refused(tmp_path):
    from attnpass.ir import TensorType
    from attnpass.ir.frontends.weights import save_weights

    graph = Graph("twins")
    for name in ("a", "b"):
        graph.add_input(name, TensorType((2,), "float32"), "resident", path="layers.0.weight")
    graph.set_outputs(["a", "b"])
    values = {"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)}
    with pytest.raises(WeightsError, match=r"several weight inputs have the path layers.0.weight"):
        save_weights(graph, values, tmp_path / "twins.safetensors")


def _safetensors_keys(file) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), "numpy") as f:
        return sorted(f.keys())


@requires("mlx.core", "mlx_lm")
def test_an_mlx_lm_decode_step_names_its_kv_cache_by_path(tmp_path):
    """A KVCache's ``update_and_fetch`` overwrites ``cache.keys`` in place while the export traces; the
    captured buffers are still named after where the step reaches them, in the graph and on disk."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    args = llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
    )  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())

    def prefilled():
        cache = make_prompt_cache(model)
        model(mx.array([[5, 3, 9, 1, 7]]), cache=cache)
        mx.eval([c.keys for c in cache] + [c.values for c in cache])
        return cache

    reference, cache = prefilled(), prefilled()

    def decode(token):
        return model(token, cache=cache)

    imported = from_mlx(decode, mx.array([[12]]))
    caches = {f"cache_{i}_{kv}": f"cache.{i}.{kv}" for i in range(2) for kv in ("keys", "values")}
    paths = weight_inputs(imported.graph)
    assert {name: paths[name] for name in caches} == caches
    assert not [name for name in paths if name.startswith("param")]
    for i, layer in enumerate(reference):  # the buffers as prefilled, each under its own name
        assert_bits_equal(imported.params[f"cache_{i}_keys"], np.array(layer.keys))
        assert_bits_equal(imported.params[f"cache_{i}_values"], np.array(layer.values))
    _graph_file, params_file = imported.save(tmp_path / "decode.json")
    assert _safetensors_keys(params_file) == sorted(paths.values())
    assert set(caches.values()) <= set(_safetensors_keys(params_file))


@requires("jax")
def test_a_jax_decode_step_names_the_cache_it_closes_over_by_path(tmp_path, rng):
    """A closed-over cache (a JAX array, a numpy array, the attributes of a plain object), also under jit."""
    import jax
    import jax.numpy as jnp

    class Cache:  # not a pytree: reached by attribute
        def __init__(self) -> None:
            self.keys = jnp.asarray(random_array(rng, (1, 8, 2, 16), "float32"))
            self.values = random_array(rng, (1, 8, 2, 16), "float32")

    k_cache = jnp.asarray(random_array(rng, (1, 8, 2, 16), "float32"))
    v_cache = random_array(rng, (1, 8, 2, 16), "float32")
    layer = Cache()

    def decode(q, k, v):
        first = jax.nn.dot_product_attention(q, jnp.concatenate([k_cache, k], 1), jnp.concatenate([v_cache, v], 1))
        keys, values = jnp.concatenate([layer.keys, k], 1), jnp.concatenate([layer.values, v], 1)
        return jax.nn.dot_product_attention(first, keys, values)

    x = random_array(rng, (1, 1, 2, 16), "float32")
    expected = {"k_cache": "k_cache", "v_cache": "v_cache", "layer_keys": "layer.keys", "layer_values": "layer.values"}
    for fn in (decode, jax.jit(decode)):
        imported = from_jax(fn, x, x, x)
        assert weight_inputs(imported.graph) == expected
        assert imported.graph.inputs == ("q", "k", "v", *expected)
        np.testing.assert_array_equal(imported.params["v_cache"], v_cache)
        np.testing.assert_array_equal(imported.params["layer_keys"], np.asarray(layer.keys))
        _graph_file, params_file = imported.save(tmp_path / "decode.json")
        assert _safetensors_keys(params_file) == sorted(expected.values())
        got = run(lower(imported.graph, "numpy"), x, x, x, **imported.params)
        np.testing.assert_allclose(got, np.asarray(decode(x, x, x)), rtol=1e-5, atol=1e-6)


def test_a_path_becomes_a_safe_bounded_input_name():
    from attnpass.ir.core.types import MAX_NAME, check_identifier
    from attnpass.ir.frontends.importing import sanitize

    assert sanitize("model.layers.0.self_attn.cache.keys") == "model_layers_0_self_attn_cache_keys"
    assert sanitize("cache['k\"); import os #']") == "cache_k_import_os"
    assert sanitize("0.keys") == "p_0_keys"
    long = sanitize("a." * 400 + "keys")
    assert len(long) < MAX_NAME and long.endswith("_a_keys") and check_identifier(long)
    graph = Graph("g")
    assert check_identifier(graph.fresh_name(sanitize("class"))).startswith("class_")  # not the keyword


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_the_weights_file_has_the_mode_of_the_json_beside_it(tmp_path, umask):
    """As an ordinary open gives (``0o666 & ~umask``), through ``ImportedGraph.save`` and ``attnpass run -o``."""
    import os
    import stat

    from attnpass.ir import TensorType

    graph = Graph("moded")
    graph.add_input("w", TensorType((4, 4), "float32"), "resident", path="layers.0.weight")
    graph.set_outputs(["w"])
    imported = ImportedGraph(graph.verify(), {"w": np.arange(16, dtype=np.float32).reshape(4, 4)})
    old = os.umask(umask)
    try:
        files = [*imported.save(tmp_path / "g.json")]
        assert main(["run", "-q", "-p", "dce", str(files[0]), "-o", str(tmp_path / "out.json")]) == 0
        files += [tmp_path / "out.json", tmp_path / "out.safetensors"]
    finally:
        os.umask(old)
    modes = {file.name: oct(stat.S_IMODE(file.stat().st_mode)) for file in files}
    expected = oct(0o666 & ~umask)
    assert modes == dict.fromkeys(["g.json", "g.safetensors", "out.json", "out.safetensors"], expected)


@requires("jax")
def test_a_decorated_function_names_the_arrays_of_the_wrapper_and_of_the_function(rng):
    import functools

    import jax.numpy as jnp

    w = jnp.asarray(random_array(rng, (16, 16), "float32"))

    def with_bias(f):
        bias = jnp.asarray(random_array(rng, (8, 16), "float32"))

        @functools.wraps(f)
        def wrapper(x):
            return f(x) + bias

        return wrapper

    @with_bias
    def layer(x):
        return x @ w

    imported = from_jax(layer, random_array(rng, (8, 16), "float32"))
    assert weight_inputs(imported.graph) == {"w": "w", "bias": "bias"}


@requires("jax")
def test_a_hostile_pytree_key_names_a_runnable_input(rng):
    """A user's dict key reaches the input name only sanitized; the generated program runs."""
    import jax.numpy as jnp

    state = {'k"]\nimport os; os.system("x")#': jnp.asarray(random_array(rng, (8, 16), "float32"))}
    x = random_array(rng, (8, 16), "float32")
    imported = from_jax(lambda x: x + state['k"]\nimport os; os.system("x")#'], x)
    (name,) = weight_inputs(imported.graph)
    assert name == "state_k_nimport_os_os_system_x"  # the key as keystr quotes it: \\n, not a newline
    program = lower(imported.graph, "numpy")
    assert "os.system" not in program.source
    np.testing.assert_array_equal(run(program, x, **imported.params), x + np.asarray(next(iter(state.values()))))
