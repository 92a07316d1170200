"""Benchmark (not a test): MLA absorbed vs expanded attention, and dsa-gather's tiles, MLX on CPU.

DeepSeek's per-head geometry (latent rank R = 512, nope dim 128, value dim 128, scale 1/sqrt(192)) with
``--heads`` heads (default 8), batch 1; the traced form is the expanded call mlx-lm makes for more than one
query row (docs/mla.md, "The traced form"): ``k = latent @ w_uk``, ``v = latent @ w_uvᵀ``, ``sdpa`` with the
rope scores as an additive mask. Both variants go through the cpu default pipeline (``default_pipeline("cpu",
keep_signature=True)``) with ``mla-absorb`` off (``expanded``) or forced (``absorbed``), lowered to MLX.

``crossover``: for T in ``--t`` (default 4096, 8192) and every row count in ``--rows`` (default 1 to 512), the
median seconds of ``--reps`` interleaved calls of each variant and their ratio; the measured crossover is where
expanded / absorbed falls through 1 (interpolated in log rows), printed beside the FLOP model's
(:func:`attnpass.passes.mla_crossover`) and their quotient, the device's ``mla_crossover_factor``.

``tiles``: one DSA call (T = 8192, top-k 2048, ``--dsa-rows`` rows, absorbed) with ``dsa-gather`` at several
``tile_bytes``, against the absorbed masked call (no gather), side by side.

``numerics``: the largest error relative to the output's magnitude (max |diff| / max |reference|) of the
traced call and of its rewrites (absorbed; absorbed and gathered) on MLX and JAX against the numpy reference
of the traced call (float64, rounded per node), over 24 random small geometries per dtype (H 1-8, L 2-16,
T 64-512, R 16-512, K 8-64), inputs of a model's scales; docs/mla.md, "Numerics".

    python benchmarks/mla_absorb.py [--quick] [--heads 8] [--t 4096,8192] [--rows 1,2,...] [--reps 3]
        [--dtype float32] [--parts crossover,tiles,numerics]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import time
from typing import Any, Callable

import numpy as np

from attnpass.ir import DType, TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.passes import DSAGather, MLAAbsorb, PassManager, default_pipeline, mla_crossover

R, DN, DV, ROPE = 512, 128, 128, 64
SCALE = (DN + ROPE) ** -0.5
ROWS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 256, 384, 512)
TILES = (2 << 20, 8 << 20, 32 << 20, 128 << 20, 0)


def graph(h: int, rows: int, t: int, dtype: DType, top_k: int | None = None, r: int = R, dn: int = DN):
    """The traced expanded call (a DSA selection of ``top_k`` cells when given)."""
    shapes = ((1, h, rows, dn), (1, 1, t, r), (h, r, dn), (h, DV, r), (1, h, rows, t))
    specs = [TensorSpec(s, dtype) for s in shapes]
    lowest = float(dtype.finfo.min)

    def mla(q, latent, w_uk, w_uv, mask, *idx):
        if idx:
            base = ops.constant(np.zeros((1, 1, rows, t), bool))
            sel = ops.put_along_axis(base, idx[0], ops.constant(True), axis=-1)
            mask = ops.where(sel, mask, ops.constant(lowest, dtype))
        k = ops.matmul(latent, w_uk)
        v = ops.matmul(latent, ops.transpose(w_uv, (0, 2, 1)))
        return ops.sdpa(q, k, v, mask=mask, scale=SCALE)

    if top_k:
        specs.append(TensorSpec((1, 1, rows, top_k), "int32"))
        return trace(lambda q, latent, w_uk, w_uv, mask, idx: mla(q, latent, w_uk, w_uv, mask, idx), *specs)
    return trace(lambda q, latent, w_uk, w_uv, mask: mla(q, latent, w_uk, w_uv, mask), *specs)


def pipeline(replace: dict[type, dict[str, Any]]) -> list:
    """The cpu wrapper pipeline with the given passes' options replaced (by pass class)."""
    passes = default_pipeline("cpu", keep_signature=True, target="mlx")
    return [dataclasses.replace(p, **replace[type(p)]) if type(p) in replace else p for p in passes]


def inputs(g, top_k: int | None) -> list[Any]:
    import mlx.core as mx

    rng = np.random.default_rng(0)
    arrays = []
    for name, t in zip(g.inputs, g.input_types()):
        if name == "idx":
            rows, cells = t.shape[2], t.shape[3]
            t_len = g.input_types()[1].shape[2]
            a = np.stack([rng.permutation(t_len)[:cells] for _ in range(rows)]).reshape(t.shape).astype(np.int32)
            arrays.append(mx.array(a))
        else:
            a = rng.standard_normal(t.shape).astype(np.float32) * (0.1 if name.startswith("w_") else 1.0)
            arrays.append(mx.array(a).astype(getattr(mx, t.dtype.value)))
    mx.eval(*arrays)
    return arrays


def timed(fns: dict[str, Callable], xs: list[Any], reps: int) -> dict[str, float]:
    """Median seconds per variant over ``reps`` interleaved calls (after one untimed warm-up call each)."""
    import mlx.core as mx

    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        mx.eval(fn(*xs))
    for rep in range(reps):
        for name in fns if rep % 2 == 0 else list(fns)[::-1]:
            start = time.perf_counter()
            mx.eval(fns[name](*xs))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def crossover(h: int, t: int, rows: tuple[int, ...], dtype: DType, reps: int) -> None:
    expanded = pipeline({MLAAbsorb: {"enabled": False}})
    absorbed = pipeline({MLAAbsorb: {"enabled": True, "crossover_factor": 1e9}})
    model = mla_crossover(t, t, R, DN, DV)
    print(f"\nT={t}, H={h}, {dtype.value}: FLOP-model crossover {model:.1f} rows")
    print(f"{'rows':>5} {'expanded s':>11} {'absorbed s':>11} {'exp/abs':>8}", flush=True)
    points = []
    for n in rows:
        g = graph(h, n, t, dtype)
        fns = {name: lower(PassManager(p).run(g).graph, "mlx").fn for name, p in (("exp", expanded), ("abs", absorbed))}
        s = timed(fns, inputs(g, None), reps)
        points.append((n, s["exp"] / s["abs"]))
        print(f"{n:>5} {s['exp']:>11.4f} {s['abs']:>11.4f} {s['exp'] / s['abs']:>8.2f}", flush=True)
    measured = next(
        (math.exp(math.log(a) + (math.log(b) - math.log(a)) * math.log(ra) / (math.log(ra) - math.log(rb)))
         for (a, ra), (b, rb) in itertools.pairwise(points) if ra >= 1 > rb),
        None,
    )  # fmt: skip
    if measured is None:
        print("measured crossover: not within the rows measured")
    else:
        print(f"measured crossover {measured:.1f} rows; / FLOP model = mla_crossover_factor {measured / model:.2f}")


def tiles(h: int, rows: int, dtype: DType, reps: int, t: int = 8192, top_k: int = 2048) -> None:
    g = graph(h, rows, t, dtype, top_k)
    promised = {"selection_input": "idx", "rows_have_keys": True}
    absorb = {MLAAbsorb: {"enabled": True, "crossover_factor": 1e9, **promised}}
    fns = {"masked": lower(PassManager(pipeline({**absorb, DSAGather: {"enabled": False}})).run(g).graph, "mlx").fn}
    for size in TILES:
        p = pipeline({**absorb, DSAGather: {"tile_bytes": size, **promised}})
        fns[f"{size >> 20} MiB" if size else "one tile"] = lower(PassManager(p).run(g).graph, "mlx").fn
    s = timed(fns, inputs(g, top_k), reps)
    print(f"\nDSA T={t}, K={top_k}, {rows} rows, H={h}, {dtype.value}, absorbed: seconds (masked / variant)")
    for name, secs in s.items():
        print(f"{name:>9} {secs:>9.4f} {s['masked'] / secs:>7.2f}", flush=True)


def numerics(cases: int = 24) -> None:
    from attnpass.backends import run

    rng = np.random.default_rng(0)
    print("\nmax |diff| / max |reference| against the numpy reference of the traced call")
    print(f"{'dtype':>8} {'target':>6} {'traced':>9} {'absorbed':>9} {'gathered':>9}", flush=True)
    for dtype in (DType.float32, DType.bfloat16):
        worst: dict[tuple[str, str], float] = {}
        for _case in range(cases):
            h, rows, t = int(rng.choice([1, 2, 4, 8])), int(rng.integers(2, 17)), int(rng.choice([64, 200, 512]))
            r, dn, top_k = int(rng.choice([16, 128, 512])), int(rng.choice([16, 128])), int(rng.choice([8, 64]))
            g = graph(h, rows, t, dtype, top_k, r, dn)
            promised = {"selection_input": "idx", "rows_have_keys": True}
            absorbed = [MLAAbsorb(crossover_factor=1e9, **promised), DSAGather(enabled=False)]
            gathered = [MLAAbsorb(crossover_factor=1e9, **promised), DSAGather(**promised)]
            variants = {"traced": g, "absorbed": PassManager(absorbed).run(g).graph,
                        "gathered": PassManager(gathered).run(g).graph}  # fmt: skip
            xs = _model_inputs(g, rng, dtype, r, dn, rows, t, top_k)
            reference = np.asarray(run(lower(g, "numpy"), **xs), np.float64)
            for target in ("mlx", "jax"):
                for name, variant in variants.items():
                    out = np.asarray(run(lower(variant, target), **xs), np.float64)
                    err = float(np.max(np.abs(out - reference)) / np.max(np.abs(reference)))
                    worst[target, name] = max(worst.get((target, name), 0.0), err)
        for target in ("mlx", "jax"):
            cells = " ".join(f"{worst[target, n]:>9.2e}" for n in ("traced", "absorbed", "gathered"))
            print(f"{dtype.value:>8} {target:>6} {cells}", flush=True)


def _model_inputs(g, rng, dtype: DType, r: int, dn: int, rows: int, t: int, top_k: int) -> dict:
    """An RMS-normed latent, MultiLinear's uniform weights, rope scores under a causal mask, distinct top-k
    indices with one visible cell first (what the router's promises say)."""
    import ml_dtypes

    h = g.input_types()[0].shape[1]
    latent = rng.standard_normal((1, 1, t, r))
    latent /= np.sqrt(np.mean(latent**2, axis=-1, keepdims=True))
    visible = np.arange(t)[None, :] <= t - rows + np.arange(rows)[:, None]
    arrays = {
        "q": rng.standard_normal((1, h, rows, dn)), "latent": latent,
        "w_uk": rng.uniform(-1, 1, (h, r, dn)) / math.sqrt(dn), "w_uv": rng.uniform(-1, 1, (h, DV, r)) / math.sqrt(r),
        "mask": np.where(visible, rng.standard_normal((1, h, rows, t)) * 0.5, float(dtype.finfo.min)),
    }  # fmt: skip
    native = ml_dtypes.bfloat16 if dtype is DType.bfloat16 else np.float32
    arrays = {n: a.astype(native) for n, a in arrays.items()}
    idx = [np.concatenate([[i + t - rows], rng.permutation(np.setdiff1d(np.arange(t), [i + t - rows]))[: top_k - 1]])
           for i in range(rows)]  # fmt: skip
    arrays["idx"] = np.asarray(idx, np.int32).reshape(1, 1, rows, top_k)
    return arrays


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="T = 1024, rows up to 64, 2 heads: a smoke run")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--t", default="4096,8192", help="comma-separated cache lengths")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated query rows")
    parser.add_argument("--dsa-rows", type=int, default=256, help="query rows of the tiles part")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--parts", default="crossover,tiles")
    args = parser.parse_args(argv)
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    dtype, parts = DType.parse(args.dtype), args.parts.split(",")
    h, ts, rows = args.heads, [int(x) for x in args.t.split(",")], tuple(int(x) for x in args.rows.split(","))
    if args.quick:
        h, ts, rows, args.dsa_rows = 2, [1024], tuple(n for n in rows if n <= 64), 16
    if "crossover" in parts:
        for t in ts:
            crossover(h, t, rows, dtype, args.reps)
    if "tiles" in parts:
        tiles(h, args.dsa_rows, dtype, args.reps, *((1024, 256) if args.quick else ()))
    if "numerics" in parts:
        numerics(4 if args.quick else 24)


if __name__ == "__main__":
    main()
