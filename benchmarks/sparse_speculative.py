"""Benchmark (not a test): mlx-lm's speculative generation of a learned-sparse model on a long cache, plain vs
``optimize``, paired.

The model is mlx-lm's own ``minimax_m3_vl.Model`` (the sweep's tiny configuration, its text configuration set to the
per-head geometry of ``benchmarks/sparse_layers.py``: 16 query heads over 1 KV head of 128, an indexer of 4 heads of
128, blocks of 128 keys, the top 16 with 1 forced local block), hidden ``--hidden``, ``--layers`` layers, every one
sparse, vocabulary 512. The draft is :func:`attnpass.models.tiny_lm` (llama, 2 layers, the same vocabulary). Each
repetition fills fresh caches of the model to ``T`` random rows (keys, values and index keys, through their own
``update_and_fetch``; the draft's cache starts empty), then ``mlx_lm.generate.speculative_generate_step`` makes
``--tokens`` tokens with ``--draft`` drafted per verify step (each verify step is a ``draft + 1``-row call of every
layer; greedy, so both sides accept the same drafts), plain and optimized in turn, the order alternating. The table
reports each side's median seconds, the median of the pairs' ratios and whether the tokens are identical. Plain
attends all ``T`` keys under the block mask in every layer; ``optimize`` gathers each row's 16 x 128 selected keys
(backends/mlx/selections.py), so the attention's work falls by ``T / 2048`` and the model's own indexer (``T`` index
keys per row, both sides) is what remains. ``--mode greedy`` times ``generate_step`` (one row per step) instead.

``--family longcat hy_v4`` (default ``minimax_m3`` alone) runs mlx-vlm's LongCat-Flash-Sparse and HY-V4 language
models the same way, at the per-head geometry ``benchmarks/sparse_layers.py`` uses for them (its ``GEOMETRY``; each
row keeps the top 2,048 tokens), from the mlx-vlm sweep's tiny configuration of the family with those fields,
``--hidden``, ``--layers`` and the vocabulary set, built in inference mode and called through the sweep's
``text_model()`` (as mlx-vlm's ``generate`` calls a language model: ids in, logits out, its own ``make_cache()``).
Their caches hold what sparse_layers' ``OneLayer.filled`` puts in (``LATENT``: a latent of 512 with rope keys of 64,
index keys of 128); a LongCat layer has two attention sublayers, so three caches (latent, index keys, the second
sublayer's latent), a HY-V4 layer two. Each family's context with the prompt's 2 tokens must exceed its top-k
(each model attends densely up to it). ``optimize`` routes their multi-row calls (the prompt's, each verify step's)
as in sparse_layers (``token_attention``: LongCat; ``dsa_attention``: HY-V4); their one-row calls the model gathers
itself, and the router declines those (``mla_absorbed``).

    python benchmarks/sparse_speculative.py [--family minimax_m3 longcat hy_v4] [--contexts 8192 32768]
        [--dtype float32 bfloat16] [--tokens 12] [--draft 3] [--reps 3] [--layers 1] [--hidden 1024]
        [--mode speculative greedy]
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from attnpass.backends.mlx import optimize
from attnpass.models import tiny_lm

ROOT = Path(__file__).resolve().parent.parent
GEOMETRY = dict(
    num_attention_heads=16, num_key_value_heads=1, head_dim=128, index_n_heads=4, index_head_dim=128,
    index_block_size=128, index_topk_blocks=16, index_local_blocks=1,
)  # fmt: skip
VOCAB = 512
PROMPT = [3, 17]
# Per family: the sweep's name of it, the field naming its layer count, its top-k in keys, and the (key, value) widths
# of each cache a layer holds, in its order (MiniMax: keys and values, index keys; LongCat: latent and rope keys, index
# keys, the second sublayer's latent and rope keys; HY-V4: latent and rope keys, index keys).
FAMILIES: dict[str, dict[str, Any]] = {
    "minimax_m3": {"name": "minimax_m3_vl", "layers": "num_hidden_layers", "topk": 16 * 128,
                   "caches": ((128, 128), (128, 0))},
    "longcat": {"name": "longcat_flash_sparse", "layers": "num_layers", "topk": 2048,
                "caches": ((512, 64), (128, 0), (512, 64))},
    "hy_v4": {"name": "hy_v4", "layers": "num_hidden_layers", "topk": 2048, "caches": ((512, 64), (128, 0))},
}  # fmt: skip


def _example(name: str) -> Any:
    """``examples/<name>.py`` as a module, registered before it runs (its dataclasses look their module up)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _sparse_layers() -> Any:
    """``benchmarks/sparse_layers.py`` as a module (its ``GEOMETRY`` of the mlx-vlm families)."""
    name = "sparse_layers_geometry"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "sparse_layers.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def model(layers: int, hidden: int, dtype: str, family: str = "minimax_m3") -> Any:
    """The family's model at its per-head geometry, every layer sparse, in inference mode, weights seeded: mlx-lm's
    MiniMax-M3 at :data:`GEOMETRY`, or an mlx-vlm language model at sparse_layers' ``GEOMETRY`` in the mlx-vlm
    sweep's ``text_model()``."""
    if family != "minimax_m3":
        return vlm_model(family, layers, hidden, dtype)
    sweep = _example("mlx_lm_sweep")
    module = importlib.import_module("mlx_lm.models.minimax_m3_vl")
    args = sweep.tiny_args("minimax_m3_vl", module)
    text = args["text_config"]
    text.update(GEOMETRY, hidden_size=hidden, num_hidden_layers=layers, vocab_size=VOCAB)
    for key in ("layer_types", "mlp_layer_types", "moe_layer_freq", "sparse_attention_freq"):
        if isinstance(text.get(key), list):
            text[key] = (text[key] * layers)[:layers]
    text["sparse_attention_freq"] = [1] * layers
    mx.random.seed(0)
    built = module.Model(module.ModelArgs.from_dict(args))
    built.set_dtype(getattr(mx, dtype))
    built.eval()
    mx.eval(built.parameters())
    assert all(layer.self_attn.is_sparse_attn for layer in built.layers), "a layer is not sparse"
    return built


def vlm_model(family: str, layers: int, hidden: int, dtype: str) -> Any:
    """mlx-vlm's ``family`` language model: the sweep's tiny configuration with sparse_layers' geometry, ``hidden``,
    ``layers`` (each with its own indexer) and :data:`VOCAB`, seeded, in the sweep's ``text_model()``, in inference
    mode (as ``mlx_vlm.load`` leaves a model)."""
    import dataclasses

    sweep = _example("mlx_vlm_sweep")
    language, args = sweep.tiny_configs(FAMILIES[family]["name"])
    fields = dict(_sparse_layers().GEOMETRY[family], hidden_size=hidden, vocab_size=VOCAB)
    fields.update({FAMILIES[family]["layers"]: layers, "max_position_embeddings": 1 << 20})
    if family == "hy_v4":
        fields["indexer_types"] = ["full"] * layers  # every layer its own indexer (the sweep's tiny one has two)

    class TextModel(sweep.text_model()):
        @property
        def layers(self) -> list:  # speculative_generate_step splits a prompt cache by len(model.layers)
            return self.language_model.layers

    mx.random.seed(0)
    built = TextModel(language(dataclasses.replace(args[0], **fields), *args[1:]))
    built.set_dtype(getattr(mx, dtype))
    built.eval()
    mx.eval(built.parameters())
    return built


def filled(built: Any, draft: Any, context: int, dtype: str, family: str = "minimax_m3") -> list:
    """The model's caches holding ``context`` random rows (seeded: every repetition the same) in each of a layer's
    caches (:data:`FAMILIES`, through their own ``update_and_fetch``), the draft's empty."""
    from mlx_lm.models.cache import make_prompt_cache

    mx.random.seed(context)
    caches = make_prompt_cache(built)
    widths = FAMILIES[family]["caches"]
    for cache in caches:
        for start in range(0, context, 8192):
            n = min(8192, context - start)
            for i, (k, v) in enumerate(widths):
                keys = mx.random.normal((1, 1, n, k)).astype(getattr(mx, dtype))
                values = mx.random.normal((1, 1, n, v)) if v else mx.zeros((1, 1, n, 0))
                cache[i].update_and_fetch(keys, values.astype(keys.dtype))
            mx.eval([(cache[i].keys, cache[i].values) for i in range(len(widths))])
    return caches + make_prompt_cache(draft)


def generate(built: Any, draft: Any, cache: list, args: argparse.Namespace) -> tuple[float, list[int]]:
    """Seconds to make ``args.tokens`` tokens on ``cache``, and the tokens."""
    from mlx_lm.generate import generate_step, speculative_generate_step

    prompt = mx.array(PROMPT)
    start = time.perf_counter()
    if args.mode == "speculative":
        steps = speculative_generate_step(
            prompt, built, draft, num_draft_tokens=args.draft, max_tokens=args.tokens, prompt_cache=cache
        )
        tokens = [int(t) for t, _, _ in steps]
    else:
        main = cache[: len(cache) - len(draft.layers)]
        tokens = [int(t) for t, _ in generate_step(prompt, built, max_tokens=args.tokens, prompt_cache=main)]
    return time.perf_counter() - start, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", nargs="+", default=["minimax_m3"], choices=list(FAMILIES))
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=12)
    parser.add_argument("--draft", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--mode", default="speculative", choices=["speculative", "greedy"])
    args = parser.parse_args(argv)
    for family in args.family:
        run(family, args)
    print(f"load after {os.getloadavg()[0]:.1f}")
    return 0


def run(family: str, args: argparse.Namespace) -> None:
    """One family's table: each dtype and context, plain vs ``optimize`` paired."""
    short = [c for c in args.contexts if c + len(PROMPT) <= FAMILIES[family]["topk"]]  # the prompt's rows join them
    assert not short, f"{family} attends densely at {short} keys (its top-k is {FAMILIES[family]['topk']} keys)"
    print(f"mlx {mx.__version__}; {family} ({FAMILIES[family]['name']}), {args.layers} sparse layer(s), top "
          f"{FAMILIES[family]['topk']} keys, {args.mode}, {args.tokens} tokens"
          f"{f', {args.draft} drafted per step' if args.mode == 'speculative' else ''}; "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print("| dtype | context | plain s | optimize s | paired ratio | tokens | routed / declined |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtype:
        plain, routed = (model(args.layers, args.hidden, dtype, family) for _ in range(2))
        draft = tiny_lm("llama", dtype=dtype)
        opt = optimize(routed)
        models = {"plain": plain, "optimize": routed}
        for context in args.contexts:
            times: dict[str, list[float]] = {"plain": [], "optimize": []}
            tokens: dict[str, list[int]] = {}
            for rep in range(args.reps + 1):  # the first pair warms up (and traces), untimed
                for name in ("plain", "optimize") if rep % 2 == 0 else ("optimize", "plain"):
                    cache = filled(plain, draft, context, dtype, family)
                    seconds, tokens[name] = generate(models[name], draft, cache, args)
                    if rep:
                        times[name].append(seconds)
            ratio = statistics.median(p / o for p, o in zip(times["plain"], times["optimize"]))
            same = "identical" if tokens["plain"] == tokens["optimize"] else "DIFFERENT"
            counts = f"{opt.routed} / {dict(opt.declined) or 0}"
            print(f"| {dtype} | {context} | {statistics.median(times['plain']):.2f} | "
                  f"{statistics.median(times['optimize']):.2f} | {ratio:.2f}x | {same} | {counts} |", flush=True)  # fmt: skip
        opt.restore()


if __name__ == "__main__":
    raise SystemExit(main())
