"""MaxText's sparse attention under ``jax.jit`` and attnpass's drop-in ``jit``, paired (runs in .venv-jax-libraries).

Two one-decoder-layer MaxText 0.2.5 models, built as its users build them
(``pyconfig.initialize`` of ``base.yml`` with overrides, ``from_config``, the
Linen model's ``apply`` with ``mutable=["cache"]``):

- ``dsa``: DeepSeek-V3.2 (``deepseek3.2-671b``: MLA with MaxText's absorbed
  latent cache and the DSA indexer, ``index_topk`` 2048 and ``indexer_mask_exact_topk``),
  DeepSeek's per-head dims (latent 512, rope 64, nope 128, value 128, indexer
  head 128), heads reduced (8 query, 4 indexer) so a CPU holds it;
- ``window``: Gemma-2 (``gemma2-2b``: a sliding-window layer with soft-capped
  logits, window ``--window``; its global layer rides along, as in the model).

Each model's cache is filled to ``T`` keys (random latents / keys, every
prefill slot a token; MaxText's own cache variables, shaped by ``eval_shape``
of its prefill, put on the device once, as a previous step leaves them) and one
``model_mode="autoregressive"`` step (one token: MaxText's autoregressive cache
refuses more, "Sequence length should be 1 during autoregression"; its multi-row
step over a cache, chunked prefill, does not run for MLA in 0.2.5: the MLA cache is
built with ``key_seq_len=PLACEHOLDER_SEQ_LEN`` (1), which ``kv_cache_chunked_prefill``
asserts equal to the chunk, ``MlaKVCache.__call__`` drops ``previous_chunk``, and the indexer's
mask is built over the chunk's own keys, an empty ``[..., 0, chunk]`` slice once those are patched) is
timed: plain ``jax.jit(step)`` and ``attnpass.backends.jax.jit(step)`` in turn, the
order alternating per repetition, the ratio the median of the pairs' ratios (plain
seconds / attnpass seconds). Each row also prints the largest output difference
(relative to the largest logit) and what the pipeline did to each attention
(applied / declined by code, from ``explain``). ``--profile`` prints, per row, the
XLA operations that take the most time in one attnpass step (``jax.profiler``).
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import time
from contextlib import redirect_stdout
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

VOCAB = 128
# DeepSeek-V3.2's per-head geometry (configs/models/deepseek3.2-671b.yml), heads reduced
DSA = {"model_name": "deepseek3.2-671b", "base_num_query_heads": 8, "base_num_kv_heads": 8,
       "first_num_dense_layers": 1, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
       "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_type": "default", "use_mla_absorbed_mqa": True,
       "mla_naive_kvcache": False, "indexer_n_heads": 4, "indexer_head_dim": 128, "indexer_topk": 2048}  # fmt: skip
# Gemma-2's per-head geometry (configs/models/gemma2-2b.yml: 8 query / 4 KV heads of 256), window from --window
WINDOW = {"model_name": "gemma2-2b", "base_num_query_heads": 8, "base_num_kv_heads": 4, "head_dim": 256}
PASSES = ("mla-absorb", "dsa-gather", "block-sparse", "qsa-gather")


def build(family: str, context: int, window: int) -> tuple[Any, Any, Any]:
    """The one-layer MaxText model of ``family``, its params and its cache filled to ``context`` keys."""
    import maxtext
    from maxtext.common.common_types import DECODING_ACTIVE_SEQUENCE_INDICATOR, MODEL_MODE_PREFILL
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    extra = dict(DSA) if family == "dsa" else dict(WINDOW, sliding_window_size=window)
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    config = pyconfig.initialize(
        ["", base], override_model_config=True, run_name="maxtext_sparse",
        base_output_directory=os.path.join(os.getcwd(), "out"), base_emb_dim=512, base_mlp_dim=512,
        base_moe_mlp_dim=512, base_num_decoder_layers=1, vocab_size=VOCAB, per_device_batch_size=1,
        max_target_length=context + 8, max_prefill_predict_length=context, scan_layers=False,
        attention="dot_product", dtype="float32", weight_dtype="float32", enable_checkpointing=False,
        skip_jax_distributed_system=True, enable_dropout=False, **extra,
    )  # fmt: skip
    model = model_creation_utils.from_config(config)
    ids = jnp.zeros((1, 8), jnp.int32)
    positions = jnp.arange(8, dtype=jnp.int32)[None]
    segments = jnp.ones((1, 8), jnp.int32)
    key = jax.random.PRNGKey(0)
    rngs = {"params": key, "aqt": key, "dropout": key}
    init = {"enable_dropout": False, "model_mode": MODEL_MODE_PREFILL}
    params = {"params": model.init(rngs, ids, positions, segments, **init)["params"]}
    ids = jnp.zeros((1, context), jnp.int32)
    positions = jnp.arange(context, dtype=jnp.int32)[None]
    segments = jnp.ones((1, context), jnp.int32)
    shapes = jax.eval_shape(
        lambda p: model.apply(p, ids, positions, segments, mutable=["cache"], **init)[1], params
    )  # the cache a prefill of `context` tokens writes, by shape only (the indexer's [T, T] scores are not run)
    rng = np.random.default_rng(0)

    def filled(path: tuple, leaf: Any) -> np.ndarray:
        name = jax.tree_util.keystr(path)
        if np.issubdtype(leaf.dtype, np.floating):
            return (rng.standard_normal(leaf.shape) * 0.5).astype(leaf.dtype)
        if "prefill_segment_id" in name:  # every prefill slot holds a token
            return np.full(leaf.shape, DECODING_ACTIVE_SEQUENCE_INDICATOR, leaf.dtype)
        return np.zeros(leaf.shape, leaf.dtype)  # the autoregressive cache is empty, its index 0

    cache = jax.tree_util.tree_map_with_path(filled, shapes)
    return model, params, jax.device_put(cache)  # on the device, as a previous step leaves it


def step_args(model: Any, params: Any, cache: Any, context: int) -> tuple[Any, tuple]:
    """One ``model_mode="autoregressive"`` step: one token at position ``context``."""
    from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE

    def step(params: Any, cache: Any, tokens: Any, positions: Any) -> Any:
        return model.apply({**params, **cache}, tokens, positions, enable_dropout=False,
                           model_mode=MODEL_MODE_AUTOREGRESSIVE, mutable=["cache"])  # fmt: skip

    tokens = jnp.array([[3]], jnp.int32)
    positions = jnp.array([[context]], jnp.int32)
    return step, (params, cache, tokens, positions)


def routes(compiled: Any) -> str:
    """What the sparse passes did to the step's attentions, from ``explain``."""
    text = io.StringIO()
    with redirect_stdout(text):
        report = compiled.explain()
    lines = (report or "") + text.getvalue()
    found = []
    for line in lines.splitlines():
        m = re.match(r"\s*\[([\w-]+)\] (applied|declined)", line)
        if m and m.group(1) in PASSES:
            code = re.search(r"\((\w+)\)", line) if m.group(2) == "declined" else None
            found.append(f"{m.group(1)} {m.group(2)}{' ' + code.group(1) if code else ''}")
    return "; ".join(dict.fromkeys(found)) or "-"


def timed(fn: Any, args: tuple) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def run_row(family: str, context: int, window: int, reps: int, profiled: bool = False) -> dict:
    """Plain ``jax.jit`` and attnpass's ``jit`` of one step, paired: seconds, ratio, difference, routes."""
    import attnpass.backends.jax as ajax

    model, params, cache = build(family, context, window)
    step, args = step_args(model, params, cache, context)
    plain, ours = jax.jit(step), ajax.jit(step, strict=True)
    ref, out = plain(*args), ours(*args)  # compile both, untimed
    logits, got = np.asarray(ref[0]), np.asarray(out[0])
    err = float(np.abs(got - logits).max() / np.abs(logits).max())
    times: dict[str, list[float]] = {"plain": [], "attnpass": []}
    for rep in range(reps):
        order = ("plain", "attnpass") if rep % 2 == 0 else ("attnpass", "plain")
        for name in order:
            times[name].append(timed(plain if name == "plain" else ours, args))
    ratio = statistics.median(p / a for p, a in zip(times["plain"], times["attnpass"]))
    row = {"family": family, "context": context, "plain": statistics.median(times["plain"]),
           "attnpass": statistics.median(times["attnpass"]), "ratio": ratio, "err": err, "routes": routes(ours)}  # fmt: skip
    if profiled:
        row["profile"] = profile(ours, args)
    return row


def profile(compiled: Any, args: tuple, top: int = 8, reps: int = 3) -> list[tuple[float, str]]:
    """The ``top`` XLA operations by time in one call of ``compiled`` (ms, name: the mean over ``reps`` calls,
    from ``jax.profiler``'s Perfetto trace), each with its shape and the JAX op it came from."""
    import glob
    import gzip
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(reps):
                jax.block_until_ready(compiled(*args))
        (path,) = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    times: dict[str, float] = {}
    for e in events:  # XLA's thunks: lower-case HLO names (fusions, copies), not the Python and runtime frames
        name = e.get("name", "")
        if e.get("ph") == "X" and re.fullmatch(r"[a-z][\w.-]*", name) and "dur" in e:
            times[name] = times.get(name, 0.0) + e["dur"] / 1e3 / reps
    origin = _origins(compiled, args)
    return sorted(((ms, f"{n} ({origin.get(n, '?')})") for n, ms in times.items()), reverse=True)[:top]


def _origins(compiled: Any, args: tuple) -> dict[str, str]:
    """HLO instruction name -> the shape and the JAX op it came from, read from the attnpass program compiled alone."""
    entry = compiled.specializations[0]
    leaves = jax.tree_util.tree_leaves(args)
    given = dict(zip(entry.imported.graph.inputs, leaves))
    target = entry.program.target
    ins = [given[n] if n in given else target.from_numpy(entry.imported.params[n]) for n in entry.program.input_names]
    text = jax.jit(entry.program.fn).lower(*ins).compile().as_text()
    found = {}
    for m in re.finditer(r"^\s*%?([\w.-]+) = (\S+) .*?op_name=\"([^\"]+)\"", text, re.MULTILINE):
        found[m.group(1)] = f"{m.group(2)} {m.group(3).rsplit('/', 1)[-1]}"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", default=["dsa", "window"], choices=["dsa", "window"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="the XLA ops taking most of one attnpass step")
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; float32; ratio = plain s / attnpass s (paired median)")
    print("| layer | T | plain jax.jit s | attnpass jit s | ratio | FLOP ratio | max diff | sparse passes |")
    print("|---|---|---|---|---|---|---|---|")
    for family in args.family:
        for context in args.contexts:
            r = run_row(family, context, args.window, args.reps, args.profile)
            flops = f"T/K = {context / 2048:.0f}" if family == "dsa" else f"T/W = {context / args.window:.0f}"
            print(
                f"| {family} | {context} | {r['plain']:.4f} | {r['attnpass']:.4f} | {r['ratio']:.2f} | {flops} | "
                f"{r['err']:.1e} | {r['routes']} |",
                flush=True,
            )
            for ms, name in r.get("profile", []):
                print(f"    {ms:7.1f} ms  {name}")


if __name__ == "__main__":
    main()
