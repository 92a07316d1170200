"""Start here: trace a Qwen3.8-Flash-Next verify step, rewrite it, lower it to MLX and JAX, check, count.

Qwen3.8-Flash-Next attention is GQA with 24 query heads over 2 KV heads,
head dim 256, bf16, softmax scale 1/16. A speculative-verify step attends with
a handful of query rows (here 4) over the KV cache. With 4 rows and GQA 12,
``q_len * gqa = 48 > 32``: MLX's fused vector kernel would refuse the call, so
``HeadChunkSDPA`` splits it into 4 subcalls of 8+4 heads per KV group.

The traced step is the library's ``attnpass.models.qwen38.verify_step`` (also
``attnpass example qwen38-verify``). Run: ``make demo`` (or
``.venv/bin/python examples/qwen38_attention.py``).
"""

from __future__ import annotations

import numpy as np

from attnpass.backends import count_primitives, run
from attnpass.backends.mlx import sdpa_routes
from attnpass.ir import Graph, TensorSpec
from attnpass.lowering import lower
from attnpass.models import verify_specs, verify_step
from attnpass.passes import HeadChunkSDPA, PassManager


def example_inputs(q_len: int, kv_len: int, seed: int = 0) -> list[np.ndarray]:
    """Random q/K/V and a causal verify mask (the last q_len cache cells are the new tokens)."""
    rng = np.random.default_rng(seed)
    bf16 = TensorSpec((1,), "bfloat16").type.dtype.numpy
    q, k, v = (rng.standard_normal(s.shape).astype(bf16) for s in verify_specs(q_len, kv_len)[:3])
    rows = np.arange(q_len)[:, None] + (kv_len - q_len)
    mask = (np.arange(kv_len)[None, :] <= rows)[None, None]
    return [q, k, v, mask]


def check_and_count(graph: Graph, args: list[np.ndarray], show_source: bool) -> None:
    """Run ``graph`` on MLX and JAX against the float64 reference; print errors, counts and routes."""
    reference = run(lower(graph, "numpy"), *args).astype(np.float64)
    for target in ("mlx", "jax"):
        program = lower(graph, target)
        if show_source:
            print(f"\n-- generated {target} source --\n{program.source}")
        err = np.max(np.abs(run(program, *args).astype(np.float64) - reference))
        counts = count_primitives(program, *args)
        print(f"{target}: max |out - float64 reference| = {err:.3g} (bf16 ulp near 1: 0.0078)")
        print(f"{target} primitives: {dict(sorted(counts.items()))}")
        if target == "mlx":
            for name, route in sdpa_routes(program, device="metal"):
                print(f"  predicted Metal route of {name}: {route.kernel} ({route.reason})")


def main(q_len: int = 4, kv_len: int = 2048) -> None:
    graph = verify_step(q_len, kv_len)
    args = example_inputs(q_len, kv_len)
    print("== traced IR ==")
    print(graph)
    print(f"streamed input bytes per call: {graph.input_nbytes():,} (resident: {graph.input_nbytes('resident'):,})")
    check_and_count(graph, args, show_source=True)

    result = PassManager([HeadChunkSDPA(enabled=True)]).run(graph)
    print("\n== after HeadChunkSDPA ==")
    print(result.graph)
    print("remarks:")
    for remark in result.remarks:
        print(f"  {remark}")
    check_and_count(result.graph, args, show_source=False)


if __name__ == "__main__":
    main()
