"""Benchmark (not a test): mlx-vlm Qwen4-Exp prompt prefill with and without ``attnpass.backends.mlx.optimize``.

Model: the random language model of ``qwen4_exp_decode.py`` (real attention
geometry: 24 query / 2 KV heads, head dim 256, indexer 4 x 128, budget 2048,
ratio 4; three Gated-DeltaNet layers then a QSA layer, per 4 ``--layers``).

The realistic plain path is mlx-vlm's own: ``mlx_vlm.generate`` prefills a
prompt in chunks of ``prefill_step_size`` tokens (``DEFAULT_PREFILL_STEP_SIZE``,
2048), one model call per chunk over the growing caches, the caches evaluated
and ``mx.clear_cache()`` after each. (One call over a whole 32K prompt would
materialize ``24 x 32K x 32K`` f32 scores off Metal, 100 GB.) A chunk of ``C``
rows at depth ``d`` costs the masked path ``C x (d + C)`` cells of attention per
head and the tiled gather ``C x W`` (``W = 2051``), so the whole prefill's ratio
is the chunks' summed costs.

Per ``--lengths`` L (the optimized model's first call, which traces and compiles its program, timed apart):

- *chunk*: one model call of ``--rows`` R rows on caches filled directly with
  ``L - R`` random tokens (the last chunk of an L-token prompt; the linear
  layers start from zero state): plain vs optimized, ms per row;
- *QSA layer*: the same call's first QSA layer, part by part, ms per row: the
  indexer's selection, the q/k/v projections with the cache update, the
  model's dispatch (off Metal: dense SDPA under ``build_mask``) vs the routed
  program (qsa-gather's tiles), and inside the latter the K/V gather alone
  (the lowering's flat-view ``take`` of ``R x W`` random cells per KV head);
  then the union form, a prototype (:func:`union_attention`), over the first
  ``--union-rows`` rows for each of ``--union-tiles`` (scaled to ms per row,
  exact: its difference to the dispatch is in the printed max);
- *whole* (``--whole``): the whole L-token prompt prefilled as ``mlx_vlm.generate``
  does, in chunks of ``--chunk`` tokens, by three runs from fresh caches taking
  each chunk in turn (so a change of the machine's load falls on all three):
  optimized first (each chunk's new signature traced and compiled: the host
  seconds inside its QSA calls are printed), plain, optimized again on its own
  caches (the signature compiled: steady). Each chunk's seconds print beside the
  estimate for that chunk, then the prefix so far, itself a whole prefill:
  tokens/s, the measured ratios and the estimate's, and each run's greedy next
  token (asserted identical) with the largest difference of the last row's
  logits. The estimate is docs/qsa.md's per-chunk
  model with this run's constants from the *chunk* and *QSA layer* rows at L
  (ms per row at depth ``L``): the parts common to both paths ``c = optimize -
  select - routed``; a chunk of ``n`` rows ending at depth ``d`` costs plain
  ``n (c + (select + dispatch) d / L)`` and optimized ``n (c + select d / L +
  routed)`` where the run routed it (``n (c + (select + dispatch) d / L)``
  where it declined it).

    python benchmarks/qwen4_exp_prefill.py [--lengths 8192 32768] [--rows 256] [--layers 4] [--reps 1]
        [--dtype float32] [--union-rows 32] [--union-tiles 2 4 16] [--whole] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from qwen4_exp_decode import filled_cache, float32_moe, load, make_model, snapshot

from attnpass.backends.mlx import optimize

PREFILL_STEP_SIZE = 2048  # mlx_vlm.generate.common.DEFAULT_PREFILL_STEP_SIZE
WIDTH = 512 * 4 + 3  # W: top 512 blocks x ratio 4 + 3 tail cells


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    mx.eval(out)
    return time.perf_counter() - start, out


@dataclass
class Prefill:
    """One model's whole chunked prefill, advanced a chunk at a time: its caches, and per chunk its seconds, QSA calls
    routed, new signatures traced, host seconds inside the QSA calls and greedy next token; the last row's logits."""

    model: Any
    opt: Any = None
    cache: list = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    routed: list[int] = field(default_factory=list)
    traces: list[int] = field(default_factory=list)
    host: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logits: Any = None

    def step(self, rows) -> None:
        """One chunk as ``mlx_vlm.generate`` runs it: the model call, the caches evaluated, ``mx.clear_cache()``.

        With ``opt`` (the model's optimizer) the QSA calls are counted and their host time summed: a new
        signature's trace, passes and ``mx.compile`` happen there (the arithmetic is lazy)."""
        opt, host = self.opt, [0.0]
        if not self.cache:
            self.cache = self.model.make_cache()
        if opt is not None:
            attend = opt.attend

            def timed_attend(client, *args, **options):
                start = time.perf_counter()
                out = attend(client, *args, **options)
                host[0] += time.perf_counter() - start
                return out

            opt.attend = timed_attend
        counts = (opt.routed, opt.traces) if opt is not None else (0, 0)
        try:
            start = time.perf_counter()
            logits = self.model(rows, cache=self.cache).logits
            mx.eval([c.state for c in self.cache], logits[:, -1])
            self.seconds.append(time.perf_counter() - start)
        finally:
            if opt is not None:
                del opt.attend  # the instance attribute; the class's method again
        self.routed.append(opt.routed - counts[0] if opt is not None else 0)
        self.traces.append(opt.traces - counts[1] if opt is not None else 0)
        self.host.append(host[0])
        self.logits = logits[0, -1].astype(mx.float32)
        self.tokens.append(int(mx.argmax(self.logits).item()))
        mx.clear_cache()


def estimate(length: int, chunk: int, i: int, per_row: dict[str, float], routed: bool) -> tuple[float, float]:
    """(plain, optimized) seconds of chunk ``i`` of a whole ``length`` prefill in chunks of ``chunk`` by the
    per-chunk model of the module docstring, from ``per_row`` (ms per row at depth ``length``: ``optimize``,
    ``select``, ``plain`` the dispatch, ``routed``) and whether the run routed the chunk's QSA calls."""
    rows = min(chunk, length - i * chunk)
    scale = (i * chunk + rows) / length
    common = per_row["optimize"] - per_row["select"] - per_row["routed"]
    plain = common + (per_row["select"] + per_row["plain"]) * scale
    fast = common + per_row["select"] * scale + (per_row["routed"] if routed else per_row["plain"] * scale)
    return rows * plain / 1e3, rows * fast / 1e3


def whole_prefill(models: dict, opt, length: int, chunk: int, per_row: dict[str, float]) -> None:
    """The ``--whole`` runs of the module docstring, chunk by chunk in turn; after each chunk the prefix so far
    (itself a whole prefill of that many tokens) measured beside its estimate."""
    prompt = mx.array(np.random.default_rng(0).integers(0, 512, (1, length)), dtype=mx.int32)
    runs = {"first": Prefill(models["optimize"], opt), "plain": Prefill(models["plain"]),
            "steady": Prefill(models["optimize"], opt)}  # fmt: skip
    print(f"whole prompt of {length} in chunks of {chunk}, load {load()}; per chunk and run: seconds (estimate), "
          f"QSA calls routed, signatures traced, host s in QSA calls, greedy next token", flush=True)  # fmt: skip
    guess = []
    for i, s in enumerate(range(0, length, chunk)):
        for run in runs.values():
            run.step(prompt[:, s : s + chunk])
        depth = min(s + chunk, length)
        guess.append(estimate(length, chunk, i, per_row, runs["steady"].routed[i] > 0))
        for name, run in runs.items():
            est = guess[i][0 if name == "plain" else 1]
            print(f"  chunk {i} to depth {depth:6d}, {name:6s} {run.seconds[i]:8.1f} s ({est:7.1f})  routed "
                  f"{run.routed[i]}, traced {run.traces[i]}, host {run.host[i]:.2f} s, token {run.tokens[i]}")  # fmt: skip
        total = {k: sum(r.seconds) for k, r in runs.items()}
        host = {k: sum(r.host) for k, r in runs.items()}
        plain_est, fast_est = (sum(g[j] for g in guess) for j in (0, 1))
        tokens = {k: r.tokens[i] for k, r in runs.items()}
        diff = max(float(mx.max(mx.abs(r.logits - runs["plain"].logits)).item()) for r in runs.values())
        print(f"  whole {depth}: tok/s plain {depth / total['plain']:.2f}, optimize {depth / total['steady']:.2f}, "
              f"optimize's first run {depth / total['first']:.2f}; measured x{total['plain'] / total['steady']:.2f} "
              f"(first run, compile included, x{total['plain'] / total['first']:.2f}), estimate "
              f"x{plain_est / fast_est:.2f} (plain {plain_est:.0f} s, optimize {fast_est:.0f} s); first - steady "
              f"{total['first'] - total['steady']:.1f} s, of which host s in QSA calls {host['first']:.1f} "
              f"(trace, passes, mx.compile) vs {host['steady']:.1f}; greedy next token {tokens} "
              f"(max |logits - plain| {diff:.2e}), load {load()}", flush=True)  # fmt: skip
        assert len(set(tokens.values())) == 1, f"greedy next tokens differ after {depth} tokens: {tokens}"


def chunk_call(model, states: list, rows) -> float:
    """Seconds of one model call of ``rows`` on caches holding ``states`` (logits evaluated)."""
    cache = filled_cache(model, states)
    seconds, _ = timed(lambda: model(rows, cache=cache).logits)
    return seconds


def qsa_layer(model, opt, states: list, rows: int, dtype, union_rows: int, union_tiles: list[int]) -> dict[str, float]:
    """Seconds of the first QSA layer's parts for ``rows`` new rows on the filled cache (module docstring)."""
    from mlx_vlm.models.qwen4_exp.qsa_kernel import dispatch_qsa_attention

    from attnpass.backends.mlx.clients import QSA_DISPATCH

    route_qsa = QSA_DISPATCH.trampoline()

    index = next(i for i, s in enumerate(states) if s is not None)
    attention = model.layers[index].self_attn
    cache = filled_cache(model, states)[index]
    x = mx.random.normal((1, rows, attention.q_proj.weight.shape[1]), key=mx.random.key(2)).astype(dtype)
    parts = {}
    with opt.active():
        start = time.perf_counter()
        selection = attention.indexer.select(x, cache, None)
        mx.eval(selection.selected_blocks, selection.query_ends)
        parts["select"] = time.perf_counter() - start

        def project():
            q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
            return attention._prepare_projected_qkv(q, k, v, cache, None, None, None)[:3]

        parts["qkv"], (queries, keys, values) = timed(project)
        options = {"cache": cache, "scale": attention.scale, "block_size": 4, "causal": True, "mask": None,
                   "mask_factory": lambda: attention.indexer.build_mask(selection)}  # fmt: skip
        args = (queries, keys, values, selection.selected_blocks, selection.query_ends)
        mx.eval(route_qsa(*args, **options))  # traced and compiled: not timed
        parts["plain"], want = timed(lambda: dispatch_qsa_attention(*args, **options))
        parts["routed"], got = timed(lambda: route_qsa(*args, **options))
    buffer = cache.keys
    b, h, t, d = buffer.shape
    cells = (
        mx.random.randint(0, t, (b, rows, 1, WIDTH), key=mx.random.key(3)) + mx.arange(b * h)[None, None, :, None] * t
    )
    mx.eval(cells)
    flat = (cache.keys.reshape(b * h * t, d), cache.values.reshape(b * h * t, d))
    parts["gather"], _ = timed(lambda: [mx.take(f, cells, axis=0) for f in flat])
    parts["diff"] = float(mx.max(mx.abs(want.astype(mx.float32) - got.astype(mx.float32))).item())
    mask = attention.indexer.build_mask(selection)  # [B, 1, rows, T]: each row's visible cells
    for tile in union_tiles:
        seconds, out = timed(
            lambda n=tile: union_attention(queries[:, :, :union_rows], cache, mask, n, attention.scale)
        )
        parts[f"union{tile}"] = seconds * rows / union_rows  # scaled to ``rows`` like the other parts
        diff = float(mx.max(mx.abs(out.astype(mx.float32) - want[:, :, :union_rows].astype(mx.float32))).item())
        parts["diff"] = max(parts["diff"], diff)
    return parts


def union_attention(queries, cache, mask, tile: int, scale: float):
    """The union form (a prototype, not qsa-gather's): per tile of rows, K/V gathered once at the union of its
    rows' cells, deduplicated and compacted to a static ``U = min(tile * W, T)`` slots (``argpartition``), and
    each row masked to its own cells inside the union: the same visible set as the masked form."""
    b, h, t, d = cache.keys.shape
    width = min(tile * WIDTH, mask.shape[-1])  # the mask covers the cache's offset, the buffer may be longer
    outs = []
    for r0 in range(0, queries.shape[2], tile):
        rows = mask[:, 0, r0 : r0 + tile]  # [B, tile, T]
        union = mx.any(rows, axis=1)
        cells = mx.argpartition((~union).astype(mx.int8), width - 1, axis=-1)[:, :width]  # the union first
        flat = cells[:, None, :] + (mx.arange(b * h) * t).reshape(b, h, 1)
        k, v = (mx.take(x.reshape(b * h * t, d), flat, axis=0) for x in (cache.keys, cache.values))
        keep = mx.take_along_axis(rows, cells[:, None, :], axis=2)[:, None]  # [B, 1, tile, U]
        outs.append(mx.fast.scaled_dot_product_attention(queries[:, :, r0 : r0 + tile], k, v, scale=scale, mask=keep))
    return mx.concatenate(outs, axis=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--rows", type=int, default=256, help="rows of the measured chunk")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--union-rows", type=int, default=32, help="rows of the union prototype's measurement")
    parser.add_argument("--union-tiles", type=int, nargs="*", default=[2, 4, 16], help="union prototype tiles")
    parser.add_argument("--whole", action="store_true", help="also the whole prompt, chunked as mlx_vlm.generate")
    parser.add_argument("--chunk", type=int, default=PREFILL_STEP_SIZE, help="prefill_step_size of --whole")
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    undo = float32_moe(dtype)
    models = {"plain": make_model(args.layers, dtype), "optimize": make_model(args.layers, dtype)}
    opt = optimize(models["optimize"])
    print(f"qwen4-exp prefill, {args.layers} layers, {args.dtype}, mlx {mx.__version__}, {mx.default_device()}, "
          f"{args.rows} rows per measured chunk")  # fmt: skip
    try:
        for length in args.lengths:
            print(f"\n== L = {length}, load {load()}", flush=True)
            states = snapshot(models["plain"], length - args.rows, dtype)
            rows = mx.array(np.random.default_rng(0).integers(0, 512, (1, args.rows)), dtype=mx.int32)
            compile_s = chunk_call(models["optimize"], states, rows)
            times = {v: [chunk_call(models[v], states, rows) for _ in range(args.reps)] for v in models}
            plain, fast = (statistics.median(times[v]) * 1e3 / args.rows for v in models)
            print(f"chunk of {args.rows} rows at depth {length - args.rows}: ms/row plain {plain:.2f}, "
                  f"optimize {fast:.2f} (x{plain / fast:.2f}); first optimized call {compile_s:.1f} s")  # fmt: skip
            parts = qsa_layer(models["optimize"], opt, states, args.rows, dtype, args.union_rows, args.union_tiles)
            per_row = {k: v * 1e3 / args.rows for k, v in parts.items() if k != "diff"}
            print("QSA layer ms/row: " + ", ".join(f"{k} {v:.3f}" for k, v in per_row.items())
                  + f"; attention plain/routed x{parts['plain'] / parts['routed']:.2f}, "
                  f"max |diff| {parts['diff']:.2e}", flush=True)  # fmt: skip
            del states
            if args.whole:
                whole_prefill(models, opt, length, args.chunk, per_row | {"optimize": fast})
        print(f"\nrouted {opt.routed}, declined {dict(opt.declined)}, traces {opt.traces}, load {load()}")
        for name, program in opt.programs.items():
            print(f"program {name}: pipeline {program.pipeline}")
    finally:
        opt.restore()
        undo()


if __name__ == "__main__":
    main()
