"""Whole decoder blocks from flax and equinox, with the user's Megatron shardings, on 8 simulated CPU devices.

``python -m tests.jax_model_mesh_cases [CASE ...]`` must run with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set before JAX is imported: the test starts it as a
subprocess). Each case builds a 2-layer decode step of a user's model: flax nnx (``nnx.Linear``,
``nnx.RMSNorm``, ``jax.nn.dot_product_attention`` over rows-first ``[B, T, Hkv, D]`` caches) or equinox
(``eqx.nn.Linear`` over ``jax.vmap``, ``eqx.nn.RMSNorm``, a hand-written GQA einsum attention with
``jnp.repeat``ed K/V over unbatched ``[T, Hkv, D]`` caches), each layer writing the step's K/V into its
caches (``dynamic_update_slice``) and attending the caches, then a GELU MLP, both with residuals. The import
(``from_jax``) makes the weights resident inputs named after their paths; the user annotates them as Megatron
does (:data:`MEGATRON`: Q/K/V and the MLP's up projection column-parallel, O and down row-parallel, over
``model``), then ``raise-attention,shard-attention{heads=model}`` annotates the attention, and the program is
lowered on the mesh, compiled, and run on random inputs. One JSON line per case: the shard-attention remarks,
the collectives of the partitioned HLO, the bytes each device holds of each input (``addressable_shards``) and
its sharding, and the outputs' error against the module's own output (``jax.jit``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from attnpass.ir.frontends.import_jax import from_jax
from attnpass.lowering import lower
from attnpass.passes import PassManager, parse_pipeline
from tests.sharded_cases import held_per_input, relative_error

MESH = {"model": 8}
LAYERS, T, HQ, HD, HIDDEN, FFN, POS = 2, 64, 16, 16, 128, 256, 40
PIPELINE = "raise-attention,shard-attention{heads=model}"
# projection -> the sharding of its weight, by the weight's layout (flax kernel [in, out]; equinox weight [out, in])
MEGATRON = {
    "flax": {"q": (None, "model"), "k": (None, "model"), "v": (None, "model"), "o": ("model", None),
             "up": (None, "model"), "down": ("model", None)},
    "equinox": {"q": ("model", None), "k": ("model", None), "v": ("model", None), "o": (None, "model"),
                "up": ("model", None), "down": (None, "model")},
}  # fmt: skip


def flax_step(kv_heads: int) -> tuple[Callable, tuple]:
    """A flax nnx decode step (one token, batch 1) of a 2-layer decoder, and its example arguments."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            def linear(n_in: int, n_out: int) -> nnx.Linear:
                return nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs)

            self.q, self.k, self.v = (
                linear(HIDDEN, HQ * HD),
                linear(HIDDEN, kv_heads * HD),
                linear(HIDDEN, kv_heads * HD),
            )
            self.o, self.up, self.down = linear(HQ * HD, HIDDEN), linear(HIDDEN, FFN), linear(FFN, HIDDEN)
            self.norm1, self.norm2 = nnx.RMSNorm(HIDDEN, rngs=rngs), nnx.RMSNorm(HIDDEN, rngs=rngs)

        def __call__(self, x: Any, k_cache: Any, v_cache: Any, pos: Any) -> tuple:
            b, s, _ = x.shape
            h = self.norm1(x)
            q = self.q(h).reshape(b, s, HQ, HD)
            k, v = self.k(h).reshape(b, s, kv_heads, HD), self.v(h).reshape(b, s, kv_heads, HD)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, pos, 0, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, pos, 0, 0))
            mask = (jnp.arange(T) <= pos)[None, None, None, :]
            x = x + self.o(jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask).reshape(b, s, HQ * HD))
            return x + self.down(jax.nn.gelu(self.up(self.norm2(x)))), k_cache, v_cache

    rngs = nnx.Rngs(0)
    layers = [Block(rngs) for _ in range(LAYERS)]
    caches = (1, T, kv_heads, HD)
    return _stacked(layers), _arguments((1, 1, HIDDEN), caches)


def equinox_step(kv_heads: int) -> tuple[Callable, tuple]:
    """An equinox decode step (one token, unbatched) of a 2-layer decoder, and its example arguments."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    class Block(eqx.Module):
        q: eqx.nn.Linear
        k: eqx.nn.Linear
        v: eqx.nn.Linear
        o: eqx.nn.Linear
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        norm1: eqx.nn.RMSNorm
        norm2: eqx.nn.RMSNorm

        def __init__(self, key: Any) -> None:
            keys = iter(jax.random.split(key, 6))

            def linear(n_in: int, n_out: int) -> eqx.nn.Linear:
                return eqx.nn.Linear(n_in, n_out, use_bias=False, key=next(keys))

            self.q, self.k, self.v = (
                linear(HIDDEN, HQ * HD),
                linear(HIDDEN, kv_heads * HD),
                linear(HIDDEN, kv_heads * HD),
            )
            self.o, self.up, self.down = linear(HQ * HD, HIDDEN), linear(HIDDEN, FFN), linear(FFN, HIDDEN)
            self.norm1, self.norm2 = eqx.nn.RMSNorm(HIDDEN), eqx.nn.RMSNorm(HIDDEN)

        def __call__(self, x: Any, k_cache: Any, v_cache: Any, pos: Any) -> tuple:
            s = x.shape[0]
            h = jax.vmap(self.norm1)(x)
            q = jax.vmap(self.q)(h).reshape(s, HQ, HD)
            k, v = jax.vmap(self.k)(h).reshape(s, kv_heads, HD), jax.vmap(self.v)(h).reshape(s, kv_heads, HD)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k, (pos, 0, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v, (pos, 0, 0))
            keys, values = (jnp.repeat(c, HQ // kv_heads, axis=1) for c in (k_cache, v_cache))
            scores = jnp.einsum("shd,thd->hst", q, keys) / jnp.sqrt(HD)
            scores = jnp.where(jnp.arange(T)[None, None, :] <= pos, scores, -jnp.inf)
            attended = jnp.einsum("hst,thd->shd", jax.nn.softmax(scores, axis=-1), values).reshape(s, HQ * HD)
            x = x + jax.vmap(self.o)(attended)
            return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(x)))), k_cache, v_cache

    layers = [Block(key) for key in jax.random.split(jax.random.PRNGKey(0), LAYERS)]
    return _stacked(layers), _arguments((1, HIDDEN), (T, kv_heads, HD))


def _stacked(layers: list) -> Callable:
    def step(x: Any, k_caches: list, v_caches: list, pos: Any) -> tuple:
        written_k, written_v = [], []
        for layer, k_cache, v_cache in zip(layers, k_caches, v_caches):
            x, k_cache, v_cache = layer(x, k_cache, v_cache, pos)
            written_k.append(k_cache)
            written_v.append(v_cache)
        return x, written_k, written_v

    return step


def _arguments(token: tuple[int, ...], cache: tuple[int, ...]) -> tuple:
    rng = np.random.default_rng(0)
    caches = [[rng.standard_normal(cache).astype(np.float32) for _ in range(LAYERS)] for _ in range(2)]
    return rng.standard_normal(token).astype(np.float32), *caches, np.int32(POS)


# case -> (library, KV heads, the user's annotation of the caches, if any)
CASES: dict[str, tuple[str, int, tuple | None]] = {
    "flax-nnx-heads": ("flax", 8, None),
    "equinox-heads": ("equinox", 8, None),
    "flax-nnx-4-kv-heads-declined": ("flax", 4, None),  # 8 devices cannot hold whole KV groups of 4 heads
    "equinox-caches-on-keys-declined": ("equinox", 8, ("model", None, None)),  # the user split the caches' T
}
STEPS = {"flax": flax_step, "equinox": equinox_step}


def measure(name: str) -> dict[str, Any]:
    import jax

    from attnpass.backends.spmd import collectives
    from attnpass.lowering.targets.jax.sharding import make_mesh

    library, kv_heads, cache_sharding = CASES[name]
    step, args = STEPS[library](kv_heads)
    imported = from_jax(step, *args)
    graph = imported.graph
    graph.set_mesh(MESH)
    weights = {}
    for value in graph.inputs:
        parts = value.split("_")  # layers_0_q_kernel_value (flax), layers_0_q_weight (equinox)
        if parts[0] == "layers" and parts[2] in MEGATRON[library]:
            graph.set_sharding(value, MEGATRON[library][parts[2]])
            weights[value] = list(MEGATRON[library][parts[2]])
        elif cache_sharding is not None and value.startswith(("k_caches", "v_caches")):
            graph.set_sharding(value, cache_sharding)
    result = PassManager(parse_pipeline(PIPELINE)).run(graph)
    program = lower(result.graph, "jax", mesh=make_mesh(MESH))
    bound = program.bind(*jax.tree_util.tree_leaves(args), **imported.params)
    compiled = program.fn.lower(*bound).compile()
    outputs = jax.tree_util.tree_leaves(program.fn(*bound))
    expected = jax.tree_util.tree_leaves(jax.jit(step)(*args))
    return {
        "case": name,
        "remarks": [str(r) for r in result.remarks if r.pass_name == "shard-attention"],
        "reasons": [r.reason for r in result.remarks if r.pass_name == "shard-attention" and r.kind == "declined"],
        "collectives": collectives(compiled.as_text()),
        "inputs": held_per_input(program, bound, compiled),
        "shardings": {n: list(program.graph.node(n).sharding or ()) for n in program.input_names},
        "weights": weights,
        "caches": [n for n in program.input_names if n.startswith(("k_caches", "v_caches"))],
        "hidden_bytes": int(np.asarray(args[0]).nbytes),
        "errors": [relative_error(np.asarray(o), np.asarray(e)) for o, e in zip(outputs, expected, strict=True)],
        "layers": LAYERS,
        "devices": len(jax.devices()),
    }


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        print(json.dumps(measure(name)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
