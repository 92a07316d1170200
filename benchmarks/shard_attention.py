"""Benchmark: the 48-layer model sharded over 8 simulated devices: per-device K/V bytes and compiled collectives.

    .venv/bin/python benchmarks/shard_attention.py                 # 48 layers, n_kv 131072
    .venv/bin/python benchmarks/shard_attention.py --layers 12 --n-kv 8192

The model is the ``qwen38-model`` example (``build_model``: QSA layers at
``l % 4 == 3``, dense bottom-right causal sdpa elsewhere, q_len 4) after its
pipeline, then ``shard-attention`` with each configuration below on a
``data`` x ``model`` mesh of 8 CPU devices (XLA's host-platform device count:
this script sets ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for
its own process when it is unset, before JAX starts). Nothing is run or
allocated: each program is compiled on placeholders; the K/V bytes per device
come from each input's ``NamedSharding`` shard shape (what
``addressable_shards`` would hold, as ``tests/backends/test_sharded_mesh.py`` checks on
real arrays), the collectives from the partitioned HLO. Times on simulated
devices sharing two cores say nothing about real meshes and are not reported.

Configurations: 24 q / 2 kv heads (the model) with the keys over 8 devices
(``seq``), with the 2 KV heads over ``data`` and the keys over ``model`` on
2 x 4, and with a heads axis of 8 (declined: 8 does not divide 2, K/V stay
replicated); and a variant with 8 KV heads (32 q) whose heads split 8 ways.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

from attnpass.backends.spmd import collectives, compiled_hlo, input_bytes_per_device  # noqa: E402
from attnpass.lowering import get_target, lower  # noqa: E402
from attnpass.models import EXAMPLES, QSAConfig, build_model  # noqa: E402
from attnpass.passes import PassManager, parse_pipeline  # noqa: E402

CONFIGS = [
    # (label, kv heads, q heads, mesh axes, shard-attention options)
    ("24/2, keys over 8", 2, 24, {"data": 1, "model": 8}, "seq=model"),
    ("24/2, heads 2 x keys 4", 2, 24, {"data": 2, "model": 4}, "heads=data,seq=model"),
    ("24/2, heads over 8", 2, 24, {"data": 1, "model": 8}, "heads=model"),
    ("32/8, heads over 8", 8, 32, {"data": 1, "model": 8}, "heads=model"),
]


def measure(layers: int, n_kv: int, kv_heads: int, q_heads: int, axes: dict[str, int], options: str) -> dict:
    cfg = QSAConfig(dtype="bfloat16", n_q_heads=q_heads, n_kv_heads=kv_heads)
    graph = build_model(layers, q_len=4, n_kv=n_kv, cfg=cfg)
    graph.set_mesh(axes)
    pipeline = f"{EXAMPLES['qwen38-model'].pipeline},shard-attention{{{options}}}"
    result = PassManager(parse_pipeline(pipeline)).run(graph)
    kinds = [r.kind for r in result.remarks if r.pass_name == "shard-attention"]
    program = lower(result.graph, "jax", mesh=get_target("jax").spmd.make_mesh(axes))
    kv = [n for n in program.input_names if n.startswith(("k_cache", "v_cache"))]
    per_device = input_bytes_per_device(program)
    total = sum(t.nbytes for n, t in zip(program.input_names, program.input_types) if n in kv)
    found = collectives(compiled_hlo(program))
    return {
        "applied": kinds.count("applied"),
        "declined": kinds.count("declined"),
        "kv_total": total,
        "kv_device": sum(per_device[n] for n in kv),
        "counts": {op: len(sizes) for op, sizes in found.items()},
        "reduced": sum(sum(sizes) for sizes in found.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--n-kv", type=int, default=131072)
    args = parser.parse_args()
    print(f"{args.layers} layers, n_kv {args.n_kv}, q_len 4, bf16, 8 simulated devices")
    header = (
        f"{'configuration':<24} {'applied':>7} {'declined':>8} {'K/V total':>15} {'K/V per device':>15} {'share':>6}"
    )
    header += f" {'all-reduce':>10} {'others':>6} {'reduced bytes':>13}"
    print(header)
    for label, kv_heads, q_heads, axes, options in CONFIGS:
        r = measure(args.layers, args.n_kv, kv_heads, q_heads, axes, options)
        others = sum(n for op, n in r["counts"].items() if op != "all-reduce")
        print(
            f"{label:<24} {r['applied']:>7} {r['declined']:>8} {r['kv_total']:>15,} {r['kv_device']:>15,} "
            f"{r['kv_device'] / r['kv_total']:>6.3f} {r['counts']['all-reduce']:>10} {others:>6} {r['reduced']:>13,}"
        )


if __name__ == "__main__":
    main()
