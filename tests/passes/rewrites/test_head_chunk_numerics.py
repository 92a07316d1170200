"""HeadChunkSDPA numerics and primitive counts on the real backends (MLX CPU, JAX CPU, numpy reference).

Per case: the chunked MLX program is bit-identical (raw bits) to a hand-written
per-chunk loop of ``mx.fast.scaled_dot_product_attention`` (docs/semantics.md §2.4),
and equal within rounding to the unchunked program on MLX, the numpy reference
and (for a representative subset, since every JAX case costs a compilation) JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ml_dtypes
import numpy as np
import pytest

from attnpass.backends import assert_primitive_counts, run, to_numpy
from attnpass.ir import DType, Graph, TensorSpec, ops, trace
from attnpass.lowering import lower
from attnpass.lowering.targets.mlx import primitives
from attnpass.passes import HeadChunkSDPA, head_chunk_plan
from attnpass.passes.rewrites.head_chunk import ENV_VAR
from tests.util import lazy_import, requires, target_params

mx = lazy_import("mlx.core")
jax = lazy_import("jax")

NUMPY_MAX_T = 4097  # every context in the case list is checked against the float64 reference
MASK_KINDS = ("none", "bool_b1", "add_11", "bool_2d", "add_row", "add_full", "bool_full", "bool_h3")


@dataclass(frozen=True)
class Case:
    hq: int
    hkv: int
    s: int
    t: int
    d: int = 64
    dtype: str = "bfloat16"
    batch: int = 1
    mask: str = "none"  # one of MASK_KINDS
    causal: str = "none"  # "bottom_right" (MLX's "causal") or "top_left" with s == t
    layout: str = "plain"  # plain | sliced | transposed | fused
    policy: str = "on"  # on | env_off | explicit_off | env_on
    scale: float | None = -1.0  # -1: 1/sqrt(d) written explicitly; None: the op's default
    jax: bool = False

    @property
    def id(self) -> str:
        parts = [f"{self.hq}x{self.hkv}", f"s{self.s}", f"t{self.t}", f"d{self.d}", DType.parse(self.dtype).short]
        parts += [f"b{self.batch}"] if self.batch != 1 else []
        parts += [f"m-{self.mask}"] if self.mask != "none" else []
        parts += [f"c-{self.causal}"] if self.causal != "none" else []
        parts += [self.layout] if self.layout != "plain" else []
        parts += [self.policy] if self.policy != "on" else []
        parts += ["scale-none"] if self.scale is None else []
        parts += ["jax"] if self.jax else []
        return "-".join(parts)

    @property
    def chunked(self) -> bool:
        return self.policy in ("on", "env_on") and head_chunk_plan(self.s, self.hq, self.hkv) is not None


def with_mask(c: Case, mask: str) -> Case:
    """A mask kind, or "causal" for the bottom-right causal attribute."""
    return replace(c, causal="bottom_right") if mask == "causal" else replace(c, mask=mask)


def cases() -> list[Case]:
    out = []
    # the verify shape (24/2/256 bf16) over row counts: small, eligible, wide
    for s in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 31, 32, 33, 40):
        out.append(Case(24, 2, s, 128, 256, jax=s in (4, 6, 33)))
    # every mask kind and causal, verify shape
    for m in MASK_KINDS[1:] + ("causal",):
        for s in (3, 4, 6, 8):
            c = with_mask(Case(24, 2, s, 96, 256), m)
            out.append(replace(c, jax=s == 6 and m in ("bool_b1", "add_full", "causal")))
    # other groupings: GQA 8, MQA, GQA 4, ungrouped, GQA 7 (remainders 6+1), GQA 12 with 4 groups
    groupings = [(16, 2), (8, 1), (12, 3), (32, 4), (14, 2), (6, 6), (32, 32), (20, 4), (48, 4), (10, 1)]
    for hq, hkv in groupings:
        for s in (2, 3, 5, 8, 12):
            out.append(Case(hq, hkv, s, 64, jax=(hq, hkv, s) in ((8, 1, 5), (14, 2, 5))))
        out.append(Case(hq, hkv, 4, 40, mask="bool_b1"))
    # dtypes
    for dtype in ("float16", "float32"):
        for s in (3, 4, 6):
            for m in ("none", "bool_b1", "add_full", "causal"):
                out.append(with_mask(Case(24, 2, s, 64, dtype=dtype, jax=(s, m) == (4, "add_full")), m))
        for s in (3, 8):
            for m in ("none", "bool_full"):
                out.append(Case(24, 2, s, 80, 256, dtype=dtype, mask=m))
    # batch two
    for m in ("none", "bool_b1", "add_11", "bool_2d", "add_full", "causal"):
        for s in (4, 7):
            out.append(with_mask(Case(24, 2, s, 48, batch=2, jax=(m, s) == ("bool_b1", 7)), m))
    out += [Case(24, 2, s, 48, dtype="float32", batch=2, mask="bool_h3") for s in (3, 5, 8)]
    # Q/K/V produced by slices, transposes, and a fused projection inside the graph
    for layout in ("sliced", "transposed", "fused"):
        for s in (3, 4, 5, 8):
            for m in ("none", "bool_b1"):
                out.append(Case(24, 2, s, 56, layout=layout, mask=m, jax=(s, m) == (5, "none")))
    # policy: environment off / explicit off / environment set to another value
    for policy in ("env_off", "explicit_off"):
        for s in (4, 6, 8):
            out.append(Case(24, 2, s, 128, 256, policy=policy))
    out += [Case(24, 2, s, 128, 256, policy="env_on") for s in (3, 5)]
    # contexts: long (two-pass territory on Metal), odd lengths, short KV (T < q_len without causal)
    out += [Case(24, 2, s, 4097, 256) for s in (3, 4, 8)]
    out += [Case(24, 2, 5, 4097, 256, mask="bool_b1"), Case(24, 2, 6, 2048, 256, mask="add_11")]
    out += [Case(24, 2, s, t, 256) for s, t in ((4, 1), (4, 4), (8, 8), (6, 2))]
    out += [Case(24, 2, s, t) for s in (3, 5, 7, 8) for t in (17, 33)]
    # causal top_left with S == T, the op's default scale, head dim 256 on other groupings
    out += [Case(24, 2, s, s, causal="top_left") for s in (4, 8)]
    out += [Case(24, 2, s, 16, causal="bottom_right", dtype="float32") for s in (5, 16)]
    out += [Case(24, 2, s, 64, scale=None) for s in (4, 6)]
    out += [Case(16, 2, 3, 64, 256), Case(16, 2, 8, 64, 256), Case(8, 1, 5, 64, 256, jax=True)]
    # rows 9-32 (chunks of 3, 2, 1 heads) with per-head masks; MQA with causal
    out += [Case(24, 2, s, 64, mask="bool_full") for s in (9, 11, 20)] + [Case(8, 1, 6, 32, causal="bottom_right")]
    return out


CASES = cases()

# ----------------------------------------------------------------------------- models and inputs


def input_shapes(c: Case) -> dict[str, tuple[int, ...]]:
    b, hq, hkv, s, t, d = c.batch, c.hq, c.hkv, c.s, c.t, c.d
    return {
        "plain": {"q": (b, hq, s, d), "k": (b, hkv, t, d), "v": (b, hkv, t, d)},
        "sliced": {"q": (b, hq, s + 2, d), "k": (b, hkv, t + 5, d), "v": (b, hkv, 2 * t, d)},
        "transposed": {"q": (b, s, hq, d), "k": (b, t, hkv, d), "v": (b, t, hkv, d)},
        "fused": {"q": (b, s, hq * d), "k": (b, t, 2 * hkv * d), "v": (b, t, d)},  # v: a residual input, unused
    }[c.layout]


def mask_shape(c: Case) -> tuple[int, ...] | None:
    b, hq, s, t = c.batch, c.hq, c.s, c.t
    shapes = {
        "bool_b1": (b, 1, s, t), "add_11": (1, 1, s, t), "bool_2d": (s, t), "add_row": (t,),
        "add_full": (b, hq, s, t), "bool_full": (b, hq, s, t), "bool_h3": (hq, s, t),
    }  # fmt: skip
    return shapes.get(c.mask)


def prepare(c: Case, q, k, v):
    """The layout ops before attention, written once for traced Tensors and MLX arrays alike."""
    if c.layout == "sliced":
        return q[:, :, 1 : c.s + 1], k[:, :, 3 : 3 + c.t], v[:, :, 0 : 2 * c.t : 2]
    if c.layout == "transposed":
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if c.layout == "fused":
        qh = q.reshape(c.batch, c.s, c.hq, c.d).transpose(0, 2, 1, 3)
        kv = k.reshape(c.batch, c.t, 2 * c.hkv, c.d)
        return qh, kv[:, :, : c.hkv].transpose(0, 2, 1, 3), kv[:, :, c.hkv :].transpose(0, 2, 1, 3)
    return q, k, v


def scale_of(c: Case) -> float | None:
    return c.d**-0.5 if c.scale == -1.0 else c.scale


def build(c: Case) -> Graph:
    dtype = DType.parse(c.dtype)
    specs = [TensorSpec(shape, dtype) for shape in input_shapes(c).values()]
    causal = None if c.causal == "none" else c.causal

    def attention(q, k, v):
        qh, kh, vh = prepare(c, q, k, v)
        return ops.sdpa(qh, kh, vh, scale=scale_of(c), causal=causal)

    def masked_attention(q, k, v, mask):
        qh, kh, vh = prepare(c, q, k, v)
        return ops.sdpa(qh, kh, vh, scale=scale_of(c), mask=mask, causal=causal)

    if c.mask == "none":
        return trace(attention, *specs)
    mask_dtype = "bool" if c.mask.startswith("bool") else dtype
    return trace(masked_attention, *specs, TensorSpec(mask_shape(c), mask_dtype))


def make_inputs(c: Case, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    np_dtype = DType.parse(c.dtype).numpy
    arrays = [rng.standard_normal(shape).astype(np_dtype) for shape in input_shapes(c).values()]
    shape = mask_shape(c)
    if shape is not None:
        keep = rng.random(shape) < 0.7
        keep[..., 0] = True  # no fully masked row (its softmax is NaN)
        if c.mask.startswith("bool"):
            arrays.append(keep)
        else:
            arrays.append(np.where(keep, rng.uniform(-3.0, 0.0, shape), -np.inf).astype(np_dtype))
    return arrays


def mlx_oracle(c: Case, arrays: list[np.ndarray]) -> np.ndarray:
    """docs/semantics.md §2.3 by hand: per KV group the one-head K/V slice, per chunk one fused call, concatenated."""
    q, k, v, *mask = [mx.array(a) for a in arrays]
    q, k, v = prepare(c, q, k, v)
    scale = scale_of(c) if c.scale is not None else c.d**-0.5
    mask = mask[0] if mask else ("causal" if c.causal != "none" else None)
    plan = head_chunk_plan(c.s, c.hq, c.hkv) if c.chunked else None
    if plan is None:
        return to_numpy(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask))
    gqa, per_head = c.hq // c.hkv, mask_shape(c) is not None and len(mask_shape(c)) >= 3 and mask_shape(c)[-3] == c.hq
    outs = []
    for j in range(c.hkv):
        kj, vj = k[:, j : j + 1], v[:, j : j + 1]
        for first in range(0, gqa, plan[0]):
            h0, h1 = j * gqa + first, j * gqa + min(first + plan[0], gqa)
            chunk_mask = mask[..., h0:h1, :, :] if per_head else mask  # the pass's per-head extension
            outs.append(mx.fast.scaled_dot_product_attention(q[:, h0:h1], kj, vj, scale=scale, mask=chunk_mask))
    return to_numpy(mx.concatenate(outs, axis=1))


def bits(x: np.ndarray) -> np.ndarray:
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_rounding_close(actual: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    """Equal up to a few units of rounding of ``dtype`` (values are convex mixes of V, |v| ~ 1)."""
    eps = float(ml_dtypes.finfo(DType.parse(dtype).numpy).eps)
    tol = {"float32": 16 * eps}.get(dtype, 2 * eps)
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=tol, atol=tol)


def chunk_pass(c: Case, monkeypatch) -> HeadChunkSDPA:
    monkeypatch.delenv(ENV_VAR, raising=False)
    if c.policy == "env_off":
        monkeypatch.setenv(ENV_VAR, " Off ")
    if c.policy == "env_on":
        monkeypatch.setenv(ENV_VAR, "yes")
    return HeadChunkSDPA(enabled=False if c.policy == "explicit_off" else None)


@requires("mlx.core", "jax")
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_chunked_attention_numerics(case: Case, monkeypatch):
    graph = build(case)
    result = chunk_pass(case, monkeypatch)(graph)
    assert result.changed == case.chunked
    if not case.chunked:
        assert result.graph == graph
    arrays = make_inputs(case, seed=len(CASES) + CASES.index(case))

    chunked_mlx = run(lower(result.graph, "mlx"), *arrays)
    assert np.array_equal(bits(chunked_mlx), bits(mlx_oracle(case, arrays)))
    assert_rounding_close(chunked_mlx, run(lower(graph, "mlx"), *arrays), case.dtype)
    if case.t <= NUMPY_MAX_T:
        reference = [run(lower(g, "numpy"), *arrays) for g in (result.graph, graph)]
        assert_rounding_close(*reference, case.dtype)
    if case.jax:
        outs = [to_numpy(jax.jit(p.fn)(*p.bind(*arrays))) for p in (lower(result.graph, "jax"), lower(graph, "jax"))]
        assert_rounding_close(*outs, case.dtype)


def test_case_matrix_covers_the_issue():
    assert 200 <= len(CASES) <= 230 and len({c.id for c in CASES}) == len(CASES)
    assert sum(c.chunked for c in CASES) >= 150
    assert {c.mask for c in CASES} == set(MASK_KINDS)
    assert {c.layout for c in CASES} == {"plain", "sliced", "transposed", "fused"}
    assert max(c.t for c in CASES) == 4097 and {c.dtype for c in CASES} == {"bfloat16", "float16", "float32"}
    assert sum(c.jax for c in CASES) >= 12


# ----------------------------------------------------------------------------- primitive counts

VERIFY = Case(24, 2, 4, 64, 256)


def verify_programs(target: str, monkeypatch) -> tuple:
    graph = build(VERIFY)
    monkeypatch.delenv(ENV_VAR, raising=False)
    return lower(HeadChunkSDPA()(graph).graph, target), lower(graph, target), make_inputs(VERIFY, seed=0)


def heads_carried(shape: tuple[int, ...]) -> int:
    """Query heads in one of the fallback's rank-5 ``[B, Hkv, G, rows, cols]`` operands: Hkv * G."""
    return shape[1] * shape[2]


@requires("mlx.core")
def test_mlx_counts_and_no_kv_expansion_24q_2kv_q_len_4(monkeypatch):
    """On CPU every call takes MLX's unfused fallback, which views q as [B, Hkv, G, S, D] and
    Broadcasts each KV head's K^T / V to its G query heads inside the matmul. Unchunked, that is
    all 24 heads (2 x 12); chunked, K/V enter each subcall as one-head slices [B, 1, T, D] and are
    broadcast to at most the chunk's 8 heads: no primitive carries K/V for more than one chunk."""
    chunked, unchunked, arrays = verify_programs("mlx", monkeypatch)
    counts = assert_primitive_counts(chunked, {"Softmax": 4, "Matmul": 8, "Concatenate": 1}, *arrays)
    assert "ScaledDotProductAttention" not in counts  # CPU: decomposed
    prims = primitives(chunked, *arrays)
    kv_slices = [p for p in prims if p.name == "Slice" and p.inputs[0][0] == (1, 2, 64, 256)]
    assert sorted(p.outputs[0][0] for p in kv_slices) == [(1, 1, 64, 256)] * 4  # K and V, per KV group
    broadcasts = [p.outputs[0][0] for p in prims if p.name == "Broadcast" and len(p.outputs[0][0]) == 5]
    assert broadcasts and all(s[1] == 1 and heads_carried(s) <= 8 for s in broadcasts)
    assert sorted({heads_carried(s) for s in broadcasts}) == [4, 8]  # the 8-head chunk and the remainder
    assert max(heads_carried(s) for p in prims for s, _ in p.outputs if len(s) == 5) <= 8

    assert_primitive_counts(unchunked, {"Softmax": 1, "Matmul": 2, "Concatenate": 0}, *arrays)
    full = [s for p in primitives(unchunked, *arrays) if p.name == "Broadcast" for s, _ in p.outputs if len(s) == 5]
    assert max(heads_carried(s) for s in full) == 24  # what the rewrite removes


@requires("jax")
def test_jax_counts_24q_2kv_q_len_4(monkeypatch):
    chunked, unchunked, arrays = verify_programs("jax", monkeypatch)
    assert_primitive_counts(chunked, {"dot_general": 8, "exp": 4, "concatenate": 1}, *arrays)
    assert_primitive_counts(unchunked, {"dot_general": 2, "exp": 1, "concatenate": 0}, *arrays)


@pytest.mark.parametrize("target", target_params("mlx", "jax"))
def test_policy_off_keeps_the_graph_and_single_call_counts(target, monkeypatch):
    graph = build(VERIFY)
    monkeypatch.setenv(ENV_VAR, "off")
    result = HeadChunkSDPA()(graph)
    assert not result.changed and result.graph == graph
    program = lower(result.graph, target)
    assert program.identity == lower(graph, target).identity
    expected = {
        "mlx": {"Softmax": 1, "Matmul": 2, "Concatenate": 0},
        "jax": {"dot_general": 2, "exp": 1, "concatenate": 0},
    }
    assert_primitive_counts(program, expected[target], *make_inputs(VERIFY, seed=0))
