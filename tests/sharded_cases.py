"""Sharded programs on 8 simulated CPU devices, measured in a process of their own.

``python -m tests.sharded_cases [CASE ...]`` must run with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the tests add
``--xla_allow_excess_precision=false``: see ``test_sharded_mesh.XLA_FLAGS``) (set before JAX is
imported, which is why :mod:`tests.backends.test_sharded_mesh` starts it as a
subprocess: the rest of the suite keeps its one CPU device). Each case builds
a graph, declares the mesh, runs its pipeline, lowers it with and without the
mesh, runs both on the same inputs and prints one JSON line of measurements:
the shard-attention remarks, how the outputs compare, the collectives in the
compiled HLO and the K/V bytes each device holds (from ``addressable_shards``).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from attnpass.backends import run
from attnpass.ir import Graph, TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.models import EXAMPLES, QSAConfig, build_layer, build_model, gather_pipeline, make_inputs, narrowed_inputs
from attnpass.models.qwen38 import attention
from attnpass.passes import PassManager, parse_pipeline

MESH_1X8 = {"data": 1, "model": 8}
MESH_2X4 = {"data": 2, "model": 4}
N_KV = 8192
QWEN = QSAConfig()  # 24 q / 2 kv heads, head dim 256
QWEN_BF16 = QSAConfig(dtype="bfloat16")
WIDE_KV = QSAConfig(n_q_heads=32, n_kv_heads=8)  # 8 KV heads: a heads axis of 8 divides them


def verify_graph(cfg: QSAConfig = QWEN, batch: int = 1, q_len: int = 4, kv_len: int = 4096) -> Graph:
    """The verify step's attention (bf16, head dim 256) with ``cfg``'s head counts and ``batch`` streams."""
    q = TensorSpec((batch, cfg.n_q_heads, q_len, cfg.head_dim), "bfloat16")
    kv = TensorSpec((batch, cfg.n_kv_heads, kv_len, cfg.head_dim), "bfloat16", role="resident")
    return trace(attention, q, kv, kv, TensorSpec((batch, 1, q_len, kv_len), "bool"))


def verify_inputs(graph: Graph) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {n: rng.standard_normal(t.shape).astype(t.dtype.numpy) for n, t in zip(graph.inputs, graph.input_types())}
    arrays["mask"] = rng.random(graph.node("mask").type.shape) < 0.7
    arrays["mask"][..., 0] = True
    return arrays


def model_inputs(graph: Graph, cfg: QSAConfig) -> dict[str, np.ndarray]:
    """Random hidden state and caches; the QSA layers' indexer inputs from :func:`make_inputs` (rows at the end)."""
    rng = np.random.default_rng(0)
    q_len = graph.node("hidden").type.shape[2]
    qsa = make_inputs(cfg, N_KV, np.arange(N_KV - q_len, N_KV, dtype=np.int32)[None])
    arrays = {}
    for name, t in zip(graph.inputs, graph.input_types()):
        stem = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[-1].isdigit() else name
        shared = stem in qsa and not stem.startswith(("k_cache", "v_cache")) and name != "hidden"
        arrays[name] = qsa[stem] if shared else rng.standard_normal(t.shape).astype(t.dtype.numpy)
    return arrays


Case = tuple[Graph, Graph, dict[str, np.ndarray], str]  # the original graph, the graph sharded, inputs, pipeline


def verify_case(cfg: QSAConfig = QWEN, batch: int = 1) -> Case:
    graph = verify_graph(cfg, batch)
    return graph, graph.copy(), verify_inputs(graph), "head-chunk"


def qsa_case(cfg: QSAConfig = QWEN) -> Case:
    original = build_layer(cfg, N_KV)
    graph = gather_pipeline().run(original).graph
    return original, graph, make_inputs(cfg, N_KV, np.array([[5000]]), hidden_fraction=0.1), ""


def model_case(cfg: QSAConfig = QWEN_BF16) -> Case:
    graph = build_model(4, q_len=4, n_kv=N_KV, cfg=cfg)
    return graph, graph.copy(), model_inputs(graph, cfg), EXAMPLES["qwen38-model"].pipeline


Build = Callable[[], Case]
CASES: dict[str, tuple[Build, dict[str, int], str]] = {
    # name: (graph, inputs and the pipeline before sharding; mesh; shard-attention options)
    "verify-1x8-seq": (verify_case, MESH_1X8, "seq=model"),
    "verify-2x4-heads-seq": (verify_case, MESH_2X4, "heads=data,seq=model"),
    "verify-1x8-heads-declined": (verify_case, MESH_1X8, "heads=model"),
    "verify-1x8-heads-8kv": (lambda: verify_case(WIDE_KV), MESH_1X8, "heads=model"),
    "verify-2x4-batch-heads-8kv": (lambda: verify_case(WIDE_KV, batch=2), MESH_2X4, "batch=data,heads=model"),
    "qsa-1x8-seq": (qsa_case, MESH_1X8, "seq=model"),
    "qsa-2x4-heads-seq": (qsa_case, MESH_2X4, "heads=data,seq=model"),
    "qsa-1x8-heads-declined": (qsa_case, MESH_1X8, "heads=model"),
    "qsa-1x8-heads-8kv": (lambda: qsa_case(WIDE_KV), MESH_1X8, "heads=model"),
    "model-1x8-seq": (model_case, MESH_1X8, "seq=model"),
    "model-2x4-heads-seq": (model_case, MESH_2X4, "heads=data,seq=model"),
    "model-1x8-heads-declined": (model_case, MESH_1X8, "heads=model"),
}


# Layouts: heads-first [B, H, T, D], rows-first [B, T, H, D] (jax.nn.dot_product_attention's, flax's), rows-first
# with K/V repeated up to the query heads before the sdpa (repeat_kv), jax.nn.dot_product_attention itself, and a
# decode step whose state caches the step writes into (dynamic_update_slice). Every option over one axis of 4
# devices: 4 streams, 4 KV heads, 512 keys.
LAYOUT_MESH = {"m": 4}
B, HQ, HKV, S, T, D = 4, 16, 4, 4, 512, 32


def swap_th(x):
    """``[B, T, H, D] <-> [B, H, T, D]``."""
    return ops.transpose(x, (0, 2, 1, 3))


def heads_first(q, k, v):
    return ops.sdpa(q, k, v, causal="bottom_right")


def rows_first(q, k, v):
    return swap_th(ops.sdpa(swap_th(q), swap_th(k), swap_th(v), causal="bottom_right"))


def rows_first_repeated(q, k, v):
    def repeat(x):  # [B, T, Hkv, D] -> [B, Hq, T, D], each KV head repeated for its query heads
        x = ops.reshape(swap_th(x), (B, HKV, 1, T, D))
        return ops.reshape(ops.broadcast_to(x, (B, HKV, HQ // HKV, T, D)), (B, HQ, T, D))

    return swap_th(ops.sdpa(swap_th(q), repeat(k), repeat(v)))


def decode_state(q, k_new, v_new, k_cache, v_cache, at):
    k, v = ops.dynamic_update_slice(k_cache, k_new, at), ops.dynamic_update_slice(v_cache, v_new, at)
    return ops.sdpa(q, k, v), k, v


def layout_case(layout: str) -> tuple[Graph, list[np.ndarray], list[np.ndarray], str]:
    """The graph (K and V its 2nd and 3rd input, or its caches), its inputs, the original's outputs (numpy
    reference, or JAX's own function) and the pipeline before shard-attention."""
    rows = layout not in ("heads-first", "decode-state")
    q_shape, kv_shape = ((B, S, HQ, D), (B, T, HKV, D)) if rows else ((B, HQ, S, D), (B, HKV, T, D))
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in (q_shape, kv_shape, kv_shape))
    if layout == "jax-rows-first":
        import jax

        from attnpass.ir.frontends.import_jax import from_jax

        graph = from_jax(jax.nn.dot_product_attention, q, k, v).graph
        return graph, [q, k, v], [np.asarray(jax.nn.dot_product_attention(q, k, v))], "raise-attention"
    if layout == "decode-state":
        rows = [rng.standard_normal((B, HKV, 1, D)).astype(np.float32) for _ in range(2)]
        inputs = [rng.standard_normal((B, HQ, 1, D)).astype(np.float32), *rows, k, v, np.array([0, 0, 300, 0], "int32")]
        specs = [TensorSpec(x.shape, str(x.dtype), role="resident" if x is k or x is v else "streamed") for x in inputs]
        graph = trace(decode_state, *specs)
        graph.pair_state("k_cache", 1)
        graph.pair_state("v_cache", 2)
    else:
        fn = {"heads-first": heads_first, "rows-first": rows_first, "rows-first-repeated": rows_first_repeated}[layout]
        inputs = [q, k, v]
        graph = trace(fn, *(TensorSpec(x.shape) for x in inputs))
    reference = run(lower(graph, "numpy"), *inputs)
    return graph, inputs, list(reference) if isinstance(reference, tuple) else [reference], ""


LAYOUTS = ("heads-first", "rows-first", "rows-first-repeated", "jax-rows-first", "decode-state")
LAYOUT_CASES = [f"layout-{layout}-{option}" for layout in LAYOUTS for option in ("heads", "batch", "seq")]


def held_per_input(program: Any, bound: list[Any], compiled: Any) -> dict[str, dict[str, Any]]:
    """Per program input: the bytes each device holds of the placed argument (``addressable_shards``), on how
    many devices, its total, and whether the compiled program takes it with that sharding."""
    expected = compiled.input_shardings[0]
    return {
        n: {
            "per_device": sorted({shard.data.nbytes for shard in a.addressable_shards}),
            "devices": len(a.addressable_shards),
            "total": a.nbytes,
            "compiled_sharding_matches": a.sharding.is_equivalent_to(expected[i], a.ndim),
        }
        for i, (n, a) in enumerate(zip(program.input_names, bound))
    }


def measure_layout(name: str) -> dict[str, Any]:
    """One layout under one option over 4 devices: the remarks, and per input the bytes each device holds
    (``addressable_shards`` of the arguments placed by the program) and whether the compiled program takes
    them with that sharding."""
    import jax

    from attnpass.backends.spmd import collectives
    from attnpass.lowering.targets.jax.sharding import make_mesh

    layout, option = name.removeprefix("layout-").rsplit("-", 1)
    graph, inputs, reference, before = layout_case(layout)
    graph.set_mesh(LAYOUT_MESH)
    pipeline = ",".join(filter(None, [before, f"shard-attention{{{option}=m}}"]))
    result = PassManager(parse_pipeline(pipeline)).run(graph)
    program = lower(result.graph, "jax", mesh=make_mesh(LAYOUT_MESH))
    bound = program.bind(*inputs)
    compiled = program.fn.lower(*bound).compile()
    out = program.fn(*bound)
    outs = [np.asarray(o) for o in (out if isinstance(out, tuple) else (out,))]
    state = dict(graph.state_pairs())
    return {
        "case": name,
        "remarks": [str(r) for r in result.remarks if r.pass_name == "shard-attention"],
        "inputs": held_per_input(program, bound, compiled),
        "kv_inputs": list(state) or list(graph.inputs[1:3]),
        "collectives": collectives(compiled.as_text()),
        "mesh_devices": int(np.prod(list(LAYOUT_MESH.values()))),
        "reference_error": max(relative_error(o, e) for o, e in zip(outs, reference, strict=True)),
        "dtype": str(outs[0].dtype),
        "jax_devices": len(jax.devices()),
    }


def host_mesh(axes: dict[str, int]) -> Any:
    """The 2 hosts x 4 devices layout on simulated devices: host ``h`` owns devices ``4h .. 4h+3``, one mesh row.

    On two real hosts, ``jax.make_mesh((2, 4), ("data", "model"), ...)`` after
    ``jax.distributed.initialize()`` lays the process boundary along ``data`` the same way.
    """
    import jax
    from jax.sharding import AxisType, Mesh

    hosts = np.array(jax.devices()).reshape(2, 4)
    return Mesh(hosts, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def measure(name: str) -> dict[str, Any]:
    """Run one case; everything the tests assert on, as JSON-able values."""
    import jax

    from attnpass.backends.spmd import collectives, input_bytes_per_device
    from attnpass.lowering.targets.jax.sharding import make_mesh

    multihost = name == "qsa-2hosts-x-4"
    build, axes, options = CASES["qsa-2x4-heads-seq" if multihost else name]
    original, graph, inputs, before = build()
    graph.set_mesh(axes)
    pipeline = ",".join(filter(None, [before, f"shard-attention{{{options}}}"]))
    result = PassManager(parse_pipeline(pipeline)).run(graph)
    sharded_graph = result.graph
    args = narrowed_inputs(sharded_graph, inputs)
    single = lower(sharded_graph, "jax")
    expected = np.asarray(jax.jit(single.fn)(*single.bind(**args)))
    reference = run(lower(original, "numpy"), **narrowed_inputs(original, inputs))  # before any pass
    program = lower(sharded_graph, "jax", mesh=host_mesh(axes) if multihost else make_mesh(axes))
    bound = program.bind(**args)
    out = program.fn(*bound)
    compiled = program.fn.lower(*bound).compile()
    hlo = compiled.as_text()
    kv = [n for n in program.input_names if n.startswith(("k_cache", "v_cache"))]
    held = {d.id: 0 for d in jax.devices()}
    for n in kv:
        for shard in bound[program.input_names.index(n)].addressable_shards:
            held[shard.device.id] += shard.data.nbytes
    b, hq, s, _ = sharded_graph.node(sharded_graph.outputs[0]).type.shape
    dv = sharded_graph.node(sharded_graph.outputs[0]).type.shape[3]
    actual = np.asarray(out)
    return {
        "case": name,
        "remarks": [str(r) for r in result.remarks if r.pass_name == "shard-attention"],
        "bitwise_equal": bool(np.array_equal(actual.view(np.uint8), expected.view(np.uint8))),
        "max_abs_diff": float(np.max(np.abs(actual.astype(np.float64) - expected.astype(np.float64)))),
        "max_abs": float(np.max(np.abs(expected.astype(np.float64)))),
        "reference_error": relative_error(actual, reference),
        "inputs": held_per_input(program, bound, compiled),
        "mesh_size": int(np.prod(list(axes.values()))),
        "dtype": str(expected.dtype),
        "collectives": collectives(hlo),
        "combine_bytes": b * hq * s * (dv + 1) * 4,  # one attention's float32 partial sums and weights
        "splits": sum(n.op == "sdpa_lse" for n in sharded_graph.nodes()),
        "kv_bytes_per_device": sorted(set(held.values())),
        "kv_bytes_per_device_from_sharding": sum(input_bytes_per_device(program)[n] for n in kv),
        "kv_bytes_total": sum(bound[program.input_names.index(n)].nbytes for n in kv),
        "devices": len(held),
        "out_spec": str(out.sharding.spec),
        "out_annotation": list(sharded_graph.node(sharded_graph.outputs[0]).sharding or ()),
        "mesh_devices": np.vectorize(lambda d: d.id)(program.mesh.devices).tolist(),
        "source_on_abstract_mesh": program.source == lower(sharded_graph, "jax", mesh=_abstract(axes)).source,
    }


CLAIM = re.compile(r"(\w+) \((?:graph input|state) \S+, placed \(.*?\)\): ([\d,]+) of ([\d,]+) bytes per device")


def claimed_bytes(remark: str) -> dict[str, tuple[int, int]]:
    """``{input: (bytes per device, total bytes)}`` as a shard-attention remark states them."""
    return {m[1]: (int(m[2].replace(",", "")), int(m[3].replace(",", ""))) for m in CLAIM.finditer(remark)}


def relative_error(actual: np.ndarray, reference: np.ndarray) -> float:
    """``max |actual - reference| / (|reference| + max |reference|)``, elementwise in float64: the measure
    ``tests.util.assert_close`` bounds by its per-dtype ``RTOL``."""
    a, e = actual.astype(np.float64), reference.astype(np.float64)
    return float(np.max(np.abs(a - e) / (np.abs(e) + np.max(np.abs(e)))))


def _abstract(axes: dict[str, int]) -> Any:
    from jax.sharding import AbstractMesh, AxisType

    return AbstractMesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def compiled_at_128k() -> dict[str, Any]:
    """The 4-layer model at n_kv 131072 on 2 x 4 (heads and keys), compiled on placeholders, never run.

    At this length XLA once resharded a causal mask built by concatenating constants with all-to-alls;
    the iota-built mask it has now partitions without any.
    """
    from attnpass.backends.spmd import collectives, compiled_hlo, input_bytes_per_device
    from attnpass.lowering.targets.jax.sharding import make_mesh

    graph = build_model(4, q_len=4, n_kv=131072, cfg=QWEN_BF16)
    graph.set_mesh(MESH_2X4)
    pipeline = f"{EXAMPLES['qwen38-model'].pipeline},shard-attention{{heads=data,seq=model}}"
    program = lower(PassManager(parse_pipeline(pipeline)).run(graph).graph, "jax", mesh=make_mesh(MESH_2X4))
    kv = [n for n in program.input_names if n.startswith(("k_cache", "v_cache"))]
    return {
        "case": "model-2x4-heads-seq-128k-compiled",
        "collectives": collectives(compiled_hlo(program)),
        "kv_bytes_per_device_from_sharding": sum(input_bytes_per_device(program)[n] for n in kv),
        "kv_bytes_total": sum(t.nbytes for n, t in zip(program.input_names, program.input_types) if n in kv),
    }


def sharding_page_block() -> dict[str, Any]:
    """Run the first ``py`` block of docs/sharding.md (the one that needs 8 devices)."""
    import contextlib
    import io
    from pathlib import Path

    section = (Path(__file__).resolve().parent.parent / "docs" / "sharding.md").read_text()
    body = re.search(r"^```py\n(.*?)^```$", section, flags=re.DOTALL | re.MULTILINE).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(body, "docs/sharding.md", "exec"), {"__name__": "sharding_page"})
    return {"case": "sharding-page", "stdout": out.getvalue()}


def main(names: list[str]) -> None:
    special = {"sharding-page": sharding_page_block, "model-2x4-heads-seq-128k-compiled": compiled_at_128k}
    for name in names or [*CASES, "qsa-2hosts-x-4", *special, *LAYOUT_CASES]:
        case = special[name]() if name in special else measure_layout(name) if name in LAYOUT_CASES else measure(name)
        print(json.dumps(case), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
