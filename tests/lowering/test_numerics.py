"""Numerics of every core op, and of sdpa in depth, on the numpy, MLX and JAX targets.

Each op case is traced from a small function and lowered to all three targets.
The numpy target (float64 arithmetic, one rounding per node) is itself checked
against an oracle written here with plain numpy; the MLX and JAX programs are
compared with the numpy target. Arithmetic is compared within the per-dtype
tolerances documented in ``tests/util.py``; layout and selection ops (reshape,
transpose, slice, concat, take, where, max, cast, constant) must be bit-exact.

sdpa is checked against an independent per-query-row loop (``attention_oracle``)
that spells out GQA head mapping, masks and both causal alignments, so a mistake
shared by ``reference.py`` and a backend is still caught.

Speed: XLA:CPU needs ~0.1 s to compile even a one-primitive program on two
cores, and eager JAX compiles every primitive of every new shape. So the JAX
programs of one group (all op cases of a dtype, all casts, ...) run together
under a single ``jax.jit`` (:func:`jax_result`); a group that fails to trace or
compile falls back to one ``jax.jit`` per program, so a failure stays attributed
to its own test. Eager JAX == ``jax.jit`` is checked in ``tests/lowering/test_codegen.py``.
"""

from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np
import pytest

from attnpass.backends import run, to_numpy
from attnpass.ir import DType, Graph, TensorSpec, ops, trace
from attnpass.ir.dialects.evaluate import rounded
from attnpass.lowering import lower
from tests.util import (
    FLOAT_DTYPES,
    assert_bits_equal,
    assert_close,
    bits,
    lazy_import,
    random_array,
    requires,
    target_params,
)

mx = lazy_import("mlx.core")
jax = lazy_import("jax")
jnp = lazy_import("jax.numpy")

TARGETS = target_params("numpy", "mlx", "jax")
BACKENDS = target_params("mlx", "jax")
F32, F16, BF16, I32, BOOL = DType.float32, DType.float16, DType.bfloat16, DType.int32, DType.bool
NUMERIC = FLOAT_DTYPES + (I32,)
ALL = NUMERIC + (BOOL,)
# float64 values near a tie of each float dtype: just above a tie, its negative, just below the overflow tie, just
# above a subnormal tie. For bf16 and f16, rounding through float32 lands on the tie and rounds to even instead
# (1.0, -1.0, inf, 2 * the smallest subnormal): the once-rounded value differs.
NEAR_TIES = {
    BF16: (1 + 2**-8 + 2**-30, -(1 + 2**-8 + 2**-30), 2.0**128 - 2**119 - 2**80, (2.5 + 2**-30) * 2.0**-133),
    F16: (1 + 2**-11 + 2**-30, -(1 + 2**-11 + 2**-30), 65520 - 2**-20, (2.5 + 2**-30) * 2.0**-24),
    F32: (1 + 2**-24 + 2**-50, -(1 + 2**-24 + 2**-50), 2.0**128 - 2**103 - 2**76, (2.5 + 2**-40) * 2.0**-149),
}


def wide(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.int64) if x.dtype.kind in "iu" else (x if x.dtype == np.bool_ else x.astype(np.float64))


def specs(arrays) -> list[TensorSpec]:
    return [TensorSpec(a.shape, DType.from_numpy(a.dtype)) for a in arrays]


def check(actual: np.ndarray, expected: np.ndarray, case: "OpCase") -> None:
    if case.exact:
        assert_bits_equal(actual, expected)
    else:
        assert_close(actual, expected, elementwise=case.elementwise)


_JAX_GROUPS: dict[Hashable, list | None] = {}


def _numpy_tree(out: Any) -> Any:
    return tuple(to_numpy(o) for o in out) if isinstance(out, (tuple, list)) else to_numpy(out)


def jax_result(group: Hashable, members: Callable[[], list[tuple[Graph, list]]], index: int) -> Any:
    """The JAX result of ``members()[index]``, computed with every member of ``group`` under one jax.jit."""
    if group not in _JAX_GROUPS:
        programs = [(lower(g, "jax"), xs) for g, xs in members()]

        def run_all(bound):
            return [p.fn(*b) for (p, _), b in zip(programs, bound)]

        try:
            outs = jax.jit(run_all)([p.bind(*xs) for p, xs in programs])
            _JAX_GROUPS[group] = [_numpy_tree(o) for o in outs]
        except Exception:  # noqa: BLE001  isolate the failing member: each test then runs its own program
            _JAX_GROUPS[group] = None
    results = _JAX_GROUPS[group]
    if results is None:
        graph, xs = members()[index]
        program = lower(graph, "jax")
        return _numpy_tree(jax.jit(program.fn)(*program.bind(*xs)))
    return results[index]


def execute(target: str, graph: Graph, xs: list, group: Hashable, members: Callable[[], list], index: int) -> Any:
    """numpy and MLX: call the lowered program (eager). JAX: see :func:`jax_result`."""
    if target == "jax":
        return jax_result(group, members, index)
    return run(lower(graph, target), *xs)


# ============================================================================ op cases


@dataclass(frozen=True)
class OpCase:
    """A traced function, its inputs for a dtype, and an independent float64 oracle."""

    fn: Callable
    inputs: Callable[[np.random.Generator, DType], list[np.ndarray]]
    oracle: Callable[..., np.ndarray]  # (dtype, *inputs) -> expected, rounded to the result dtype
    dtypes: tuple[DType, ...]
    exact: bool = False  # layout/selection: no arithmetic, so results must be bit-identical
    elementwise: bool = False  # tolerance per element (else relative to the result's magnitude)


def _arith(fn, oracle, shapes=((2, 3, 4), (3, 1)), low=-2.0, high=2.0, dtypes=NUMERIC):
    def inputs(rng, dt):
        lo, hi = (-50, 50) if dt is I32 else (low, high)
        return [random_array(rng, s, dt, low=lo, high=hi) for s in shapes]

    return OpCase(fn, inputs, lambda dt, *xs: oracle(*map(wide, xs)).astype(dt.numpy), dtypes, elementwise=True)


def _div_inputs(rng, dt):
    x = random_array(rng, (2, 3, 4), dt)
    y = (rng.uniform(0.5, 2.0, (3, 1)) * rng.choice([-1.0, 1.0], (3, 1))).astype(dt.numpy)
    return [x, y]


def _layout(fn, oracle, shapes=((2, 3, 4),), dtypes=ALL):
    def inputs(rng, dt):
        return [random_array(rng, s, dt) for s in shapes]

    return OpCase(fn, inputs, lambda dt, *xs: oracle(*xs), dtypes, exact=True)


def _where_inputs(rng, dt):
    return [random_array(rng, (2, 1, 4), BOOL), random_array(rng, (2, 3, 4), dt), random_array(rng, (3, 4), dt)]


def _take_inputs(rng, dt):
    return [random_array(rng, (4, 5, 6), dt), np.array([[4, 0, 2], [2, 2, 1]], dtype=np.int32)]


def _take_rows_inputs(rng, dt):
    return [random_array(rng, (4, 5, 6), dt), np.array([3, 0, 2, 2, 1], dtype=np.int32)]  # valid on every axis


def _sum_inputs(rng, dt):
    return [random_array(rng, (3, 4, 16), dt, low=-50 if dt is I32 else -2, high=50 if dt is I32 else 2)]


def _matmul_inputs(rng, dt):
    lo, hi = (-8, 8) if dt is I32 else (-1.0, 1.0)
    return [random_array(rng, (2, 3, 5, 64), dt, low=lo, high=hi), random_array(rng, (3, 64, 7), dt, low=lo, high=hi)]


def _softmax_oracle(axis):
    def oracle(dt, x):
        x = wide(x)
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        return (e / e.sum(axis=axis, keepdims=True)).astype(dt.numpy)

    return oracle


OP_CASES: dict[str, OpCase] = {
    "add": _arith(lambda x, y: x + y, np.add),
    "sub": _arith(lambda x, y: ops.sub(x, y), np.subtract),
    "mul": _arith(lambda x, y: x * y, np.multiply),
    "div": OpCase(
        lambda x, y: x / y,
        _div_inputs,
        lambda dt, x, y: (wide(x) / wide(y)).astype(dt.numpy),
        FLOAT_DTYPES,
        elementwise=True,
    ),
    "maximum": _arith(ops.maximum, np.maximum),
    "neg": _arith(lambda x: -x, np.negative, shapes=((2, 3, 4),)),
    "exp": _arith(ops.exp, np.exp, shapes=((2, 3, 4),), low=-4.0, high=4.0, dtypes=FLOAT_DTYPES),
    "relu": _arith(ops.relu, lambda x: np.where(x > 0, x, 0), shapes=((2, 3, 4),)),
    "where": OpCase(ops.where, _where_inputs, lambda dt, c, x, y: np.where(c, x, y), ALL, exact=True),
    "reshape": _layout(lambda x: x.reshape(4, 6), lambda x: x.reshape(4, 6)),
    "reshape_infer": _layout(lambda x: ops.reshape(x, (2, -1)), lambda x: x.reshape(2, 12)),
    "transpose": _layout(lambda x: ops.transpose(x, (2, 0, 1)), lambda x: x.transpose(2, 0, 1)),
    "transpose_default": _layout(lambda x: x.transpose(), lambda x: x.T),
    "slice": _layout(
        lambda x: ops.slice(x, (1, 0, 2), (5, 6, 7), (2, 1, 3)), lambda x: x[1:5:2, 0:6, 2:7:3], shapes=((5, 6, 7),)
    ),
    "slice_basic_index": _layout(lambda x: x[1:, ::2, 3], lambda x: x[1:, ::2, 3], shapes=((5, 6, 7),)),
    "slice_newaxis_ellipsis": _layout(lambda x: x[None, ..., 1:4], lambda x: x[None, ..., 1:4]),
    "concat": _layout(
        lambda a, b, c: ops.concat([a, b, c], axis=1),
        lambda a, b, c: np.concatenate([a, b, c], axis=1),
        shapes=((2, 1, 4), (2, 3, 4), (2, 2, 4)),
    ),
    "concat_neg_axis": _layout(
        lambda a, b: ops.concat([a, b], axis=-1), lambda a, b: np.concatenate([a, b], -1), shapes=((2, 3), (2, 5))
    ),
    "take": OpCase(
        lambda x, i: ops.take(x, i, axis=1), _take_inputs, lambda dt, x, i: np.take(x, i, axis=1), ALL, exact=True
    ),
    "take_last_axis": OpCase(
        lambda x, i: ops.take(x, i, axis=-1), _take_inputs, lambda dt, x, i: np.take(x, i, axis=-1), ALL, exact=True
    ),
    # 1-D indices on an inner axis: MLX lowers these through take_along_axis (row-major result)
    "take_rows_inner": OpCase(
        lambda x, i: ops.take(x, i, axis=1), _take_rows_inputs, lambda dt, x, i: np.take(x, i, axis=1), ALL, exact=True
    ),
    "take_rows_last": OpCase(
        lambda x, i: ops.take(x, i, axis=2), _take_rows_inputs, lambda dt, x, i: np.take(x, i, axis=2), ALL, exact=True
    ),
    "take_rows_first": OpCase(
        lambda x, i: ops.take(x, i, axis=0), _take_rows_inputs, lambda dt, x, i: np.take(x, i, axis=0), ALL, exact=True
    ),
    "sum": OpCase(
        lambda x: ops.sum(x, axis=(0, 2)), _sum_inputs, lambda dt, x: wide(x).sum(axis=(0, 2)).astype(dt.numpy), NUMERIC
    ),
    "sum_keepdims": OpCase(
        lambda x: ops.sum(x, axis=-1, keepdims=True),
        _sum_inputs,
        lambda dt, x: wide(x).sum(axis=-1, keepdims=True).astype(dt.numpy),
        NUMERIC,
    ),
    "sum_all": OpCase(ops.sum, _sum_inputs, lambda dt, x: np.asarray(wide(x).sum()).astype(dt.numpy), NUMERIC),
    "max": OpCase(
        lambda x: ops.max(x, axis=1, keepdims=True),
        _sum_inputs,
        lambda dt, x: x.max(axis=1, keepdims=True),
        NUMERIC,
        exact=True,
    ),
    "max_all": OpCase(ops.max, _sum_inputs, lambda dt, x: np.asarray(x.max()), NUMERIC, exact=True),
    "matmul": OpCase(
        ops.matmul, _matmul_inputs, lambda dt, a, b: np.matmul(wide(a), wide(b)).astype(dt.numpy), NUMERIC
    ),
    "softmax": OpCase(
        lambda x: ops.softmax(x),
        lambda rng, dt: [random_array(rng, (2, 3, 16), dt, low=-6, high=6)],
        _softmax_oracle(-1),
        FLOAT_DTYPES,
    ),
    "softmax_precise": OpCase(
        lambda x: ops.softmax(x, axis=1, precise=True),
        lambda rng, dt: [random_array(rng, (2, 16, 3), dt, low=-6, high=6)],
        _softmax_oracle(1),
        FLOAT_DTYPES,
    ),
}


def _op_params():
    for name, case in OP_CASES.items():
        for dt in case.dtypes:
            yield pytest.param(name, dt, id=f"{name}-{dt.short}")


_OP_CACHE: dict = {}


def _op(name: str, dt: DType):
    """(graph, inputs, oracle answer, numpy-target answer) for an op case, computed once."""
    key = (name, dt)
    if key not in _OP_CACHE:
        case = OP_CASES[name]
        xs = case.inputs(np.random.default_rng(zlib.crc32(f"{name}-{dt.value}".encode())), dt)
        graph = trace(case.fn, *specs(xs), name=name)
        _OP_CACHE[key] = (graph, xs, case.oracle(dt, *xs), run(lower(graph, "numpy"), *xs))
    return _OP_CACHE[key]


def _op_names(dt: DType) -> list[str]:
    return [name for name, case in OP_CASES.items() if dt in case.dtypes]


@pytest.mark.parametrize("name, dtype", list(_op_params()))
def test_numpy_target_matches_independent_oracle(name, dtype):
    graph, xs, expected, ref = _op(name, dtype)
    check(ref, expected, OP_CASES[name])


@pytest.mark.parametrize("target", BACKENDS)
@pytest.mark.parametrize("name, dtype", list(_op_params()))
def test_backend_matches_reference(name, dtype, target):
    graph, xs, expected, ref = _op(name, dtype)
    names = _op_names(dtype)
    members = lambda: [_op(n, dtype)[:2] for n in names]  # noqa: E731
    out = execute(target, graph, xs, ("ops", dtype), members, names.index(name))
    check(out, ref, OP_CASES[name])


# ============================================================================ cast


def _cast_inputs(src: DType, dst: DType) -> np.ndarray:
    """Values exercising truncation, rounding, overflow and signed zeros where ``src -> dst`` defines them."""
    if src is BOOL:
        return np.array([[True, False, True], [False, False, True]])
    if src is I32:
        values = [0, 1, -1, 7, -3000, 2049, 65519, 65521, 16777217, -16777219]
        return np.array(values if dst is not BOOL else values[:4], dtype=np.int32)
    values = [0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 1.1, -7.9, 999.3, -1000.7, 0.3333333]
    if dst.is_float:
        values += [65519.0, 65536.0, 70000.0, 1e-6, -3e-7, 1e-9, 3.0e38, float("inf"), float("-inf")]
    return np.array(values, dtype=np.float64).astype(src.numpy)


def _cast_oracle(x: np.ndarray, dst: DType) -> np.ndarray:
    if dst is BOOL:
        return x != 0
    if dst is I32:
        return np.trunc(x.astype(np.float64)).astype(np.int32)
    return wide(x).astype(np.float64).astype(dst.numpy)


CAST_PAIRS = [(src, dst) for src in ALL for dst in ALL]


@functools.cache
def _cast_members() -> list[tuple[Graph, list]]:
    members = []
    for src, dst in CAST_PAIRS:
        x = _cast_inputs(src, dst)
        members.append((trace(lambda x, dst=dst: ops.cast(x, dst), *specs([x]), name="cast"), [x]))
    return members


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("src, dst", CAST_PAIRS, ids=[f"{s.short}-{d.short}" for s, d in CAST_PAIRS])
def test_cast_is_bit_exact(src, dst, target):
    index = CAST_PAIRS.index((src, dst))
    graph, xs = _cast_members()[index]
    out = execute(target, graph, xs, "cast", _cast_members, index)
    assert_bits_equal(out, _cast_oracle(_cast_inputs(src, dst), dst))


# ============================================================================ constants


def _nonnegative_grid(dtype: DType) -> np.ndarray:
    """Every non-negative finite value of a 16-bit float dtype as float64, ascending, from its bit patterns
    (the value at index i has bit pattern i), then the next value past the largest (where RNE's overflow goes)."""
    patterns = np.arange(0x7C00 if dtype is F16 else 0x7F80, dtype=np.uint32)
    if dtype is F16:
        grid = patterns.astype(np.uint16).view(np.float16).astype(np.float64)
    else:
        grid = (patterns << 16).view(np.float32).astype(np.float64)
    return np.append(grid, 2 * grid[-1] - grid[-2])


def once_rounded(x, dtype: DType) -> np.ndarray:
    """float64 ``x`` rounded once to nearest even in a 16-bit float ``dtype`` (f32: numpy's IEEE conversion)."""
    x = np.asarray(x, np.float64)
    if dtype is F32:
        return x.astype(np.float32)
    grid = _nonnegative_grid(dtype)
    a = np.abs(x)
    lo = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, len(grid) - 2)
    mid = (grid[lo] + grid[lo + 1]) / 2
    up = (a > mid) | ((a == mid) & (lo % 2 == 1))
    pattern = np.where(a >= grid[-1], len(grid) - 1, lo + up).astype(np.uint16)  # len - 1: the inf pattern
    return (pattern | np.signbit(x).astype(np.uint16) << np.uint16(15)).astype(np.uint16).view(dtype.numpy)


def _constant_graphs(dt: DType):
    """(name, fn, inputs, expected) for constant nodes: splats, -inf, non-splat arrays, scalars."""
    rng = np.random.default_rng(7)
    x = random_array(rng, (3, 4), dt, low=-5, high=5)
    cond = np.array([[True, False, True, True]] * 3)
    if dt is BOOL:
        table = np.array([[True, False, False, True]] * 3)
        return [
            ("array", lambda x: ops.constant(table, dt), [x], table),
            ("splat", lambda x: ops.constant(np.ones((2, 2), bool), dt), [x], np.ones((2, 2), bool)),
        ]
    table = (np.arange(12).reshape(3, 4) * (0.37 if dt.is_float else 3) - 2).astype(dt.numpy)
    graphs = [
        ("array", lambda x: ops.constant(table, dt), [x], table),
        ("array_plus_x", lambda x: x + ops.constant(table, dt), [x], (wide(x) + wide(table)).astype(dt.numpy)),
        ("scalar", lambda x: ops.constant(5, dt), [x], np.asarray(5, dt.numpy)),
        ("splat", lambda x: ops.constant(np.full((2, 5), 3), dt), [x], np.full((2, 5), 3, dt.numpy)),
        ("no_inputs", lambda: ops.constant(table, dt), [], table),
    ]
    if dt.is_float:
        ninf = np.full((3, 4), -np.inf, dt.numpy)
        once = np.array(NEAR_TIES[dt])
        graphs += [
            ("neg_inf_splat", lambda x: ops.constant(ninf, dt), [x], ninf),
            (
                "where_neg_inf",
                lambda x: ops.where(ops.constant(cond, BOOL), x, float("-inf")),
                [x],
                np.where(cond, x, ninf),
            ),
            ("max_with_neg_inf", lambda x: ops.maximum(x, ops.constant(ninf, dt)), [x], x),
            # values whose once-rounded value differs from the one through float32 (docs/semantics.md §1.1),
            # in every form the backends spell a constant: an array literal, a splat and a scalar
            ("once_rounded", lambda x: ops.constant(once, dt), [x], once_rounded(once, dt)),
            (
                "once_rounded_splat",
                lambda x: ops.constant(np.full((2, 3), once[0]), dt),
                [x],
                once_rounded(np.full((2, 3), once[0]), dt),
            ),
            ("once_rounded_scalar", lambda x: ops.constant(once[1], dt), [x], once_rounded(once[1], dt)),
        ]
    return graphs


CONSTANT_CASES = [(dt, name) for dt in ALL for name, *_ in _constant_graphs(dt)]


def _constant_case(dt: DType, name: str):
    ((fn, xs, expected),) = [g[1:] for g in _constant_graphs(dt) if g[0] == name]
    return trace(fn, *specs(xs), name=name), xs, expected


@functools.cache
def _constant_members():
    return [_constant_case(dt, name)[:2] for dt, name in CONSTANT_CASES]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype, name", CONSTANT_CASES, ids=[f"{n}-{d.short}" for d, n in CONSTANT_CASES])
def test_constant_is_bit_exact(dtype, name, target):
    graph, xs, expected = _constant_case(dtype, name)
    assert any(n.op == "constant" for n in graph.nodes())
    out = execute(target, graph, xs, "constant", _constant_members, CONSTANT_CASES.index((dtype, name)))
    if name == "array_plus_x" and dtype.is_float:
        assert_close(out, expected, elementwise=True)
    else:
        assert_bits_equal(out, expected)


@pytest.mark.parametrize("target", TARGETS)
def test_constant_bf16_once_rounded_value_is_pinned(target):
    """The reference rounds float64 -> bf16 once, whichever ml_dtypes is installed (0.7 rounds once, older ones
    through float32, which gives 1.0), and the target's constant has those bits."""
    value = 1 + 2**-8 + 2**-30
    assert rounded(value, BF16) == 1.0078125
    graph = trace(lambda: ops.constant(value, BF16), name="pinned")
    assert_bits_equal(run(lower(graph, target)), np.asarray(1.0078125, BF16.numpy))


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=lambda d: d.short)
def test_reference_rounds_float64_once_to_nearest_even(dtype):
    """``rounded`` against a nearest-even search over every finite value of the dtype, built from bit patterns
    alone (no float64 -> 16-bit conversion of numpy or ml_dtypes): grid values, every midpoint, a float64 ulp
    either side of it, midpoints moved by less than a float32 ulp, random float64s, overflow, subnormals, signs.
    float32 (too many values to list): random neighbours' midpoints and a float64 ulp either side, each decided
    by its distances to the two neighbours, ties to the even bit pattern."""
    if dtype is F32:
        rng = np.random.default_rng(0)
        patterns = rng.integers(0, 0x7F7FFFFF, 200_000, dtype=np.uint32)  # finite, below the largest
        lo, hi = patterns.view(np.float32).astype(np.float64), (patterns + 1).view(np.float32).astype(np.float64)
        mid = (lo + hi) / 2  # exact in float64
        x = np.concatenate([mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf)])
        low, high = np.tile(lo, 3), np.tile(hi, 3)
        even_low = np.tile(patterns % 2 == 0, 3)
        down = (x - low < high - x) | ((x - low == high - x) & even_low)
        expected = np.where(down, low, high).astype(np.float32)  # exact: both are float32 values
        assert_bits_equal(rounded(x, dtype), expected)
        assert_bits_equal(rounded(-x, dtype), -expected)
        return
    full = _nonnegative_grid(dtype)
    grid, mid = full[:-1], (full[:-1] + full[1:]) / 2  # the last midpoint: the overflow tie
    rng = np.random.default_rng(0)
    exponent = rng.integers(1023 - 160, 1023 + 140, 200_000).astype(np.uint64)  # bf16 subnormals to past overflow
    random = ((exponent << np.uint64(52)) | rng.integers(0, 1 << 52, 200_000).astype(np.uint64)).view(np.float64)
    x = np.concatenate([grid, mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf), mid * (1 + 2**-30),
                        mid * (1 - 2**-30), random, [np.inf, 1e300, 2.0**-1074]])  # fmt: skip
    x = np.concatenate([x, -x, NEAR_TIES[dtype]])
    expected = once_rounded(x, dtype)
    with np.errstate(over="ignore"):
        through_float32 = once_rounded(x.astype(np.float32).astype(np.float64), dtype)
    assert (bits(through_float32) != bits(expected)).sum() > 1000  # the inputs tell the two rules apart
    assert (bits(through_float32) != bits(expected))[-4:].all()  # and so do the constants' NEAR_TIES
    assert_bits_equal(rounded(x, dtype), expected)
    assert np.isnan(rounded(np.array([np.nan, -np.nan]), dtype).astype(np.float64)).all()


# ============================================================================ non-finite values


def _specials(dt: DType) -> np.ndarray:
    x = np.array([[0.5, -np.inf, 2.0, 1.0], [-np.inf, -np.inf, 3.0, -1.0], [np.inf, 1.0, -2.0, 0.0]])
    return x.astype(dt.numpy)


def _specials_fn(x, y):
    finite_rows = ops.slice(x, (0, 0), (2, 4), (1, 1))
    return (
        ops.softmax(finite_rows, precise=True),
        ops.softmax(finite_rows),
        ops.exp(x),
        ops.maximum(x, y),
        ops.max(x, axis=-1),
        x + y,
        ops.relu(x),
    )


@functools.cache
def _specials_members():
    members = []
    for dt in FLOAT_DTYPES:
        x, y = _specials(dt), np.array([1.0, 2.0, -np.inf, 0.5]).astype(dt.numpy)
        members.append((trace(_specials_fn, *specs([x, y]), name="specials"), [x, y]))
    return members


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: d.short)
def test_infinities_flow_through_arithmetic(dtype, target):
    index = FLOAT_DTYPES.index(dtype)
    graph, (x, y) = _specials_members()[index]
    outs = execute(target, graph, [x, y], "specials", _specials_members, index)
    xw, yw, rows = wide(x), wide(y), wide(x)[:2]
    e = np.exp(rows - rows.max(-1, keepdims=True))
    soft = e / e.sum(-1, keepdims=True)
    expected = (soft, soft, np.exp(xw), np.maximum(xw, yw), xw.max(-1), xw + yw, np.maximum(xw, 0))
    assert len(outs) == len(expected)
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert_close(out, np.asarray(exp).astype(dtype.numpy), elementwise=i >= 2)  # 0, 1: softmax
    assert outs[0][1, 0] == 0 and outs[0][1, 1] == 0  # masked entries get exactly zero weight


# ============================================================================ sdpa


def attention_oracle(q, k, v, mask=None, *, scale=None, causal="none"):
    """softmax(q k^T * scale + mask) v, one query row at a time, in float64.

    Query head ``h`` reads kv head ``h // (Hq // Hkv)``. A bool mask keeps the keys
    where it is True; a float mask is added to the scores. ``top_left``: query ``i``
    sees keys ``j <= i``; ``bottom_right``: keys ``j <= i + (T - S)``.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b_, hq, s, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    full_mask = None if mask is None else np.broadcast_to(np.asarray(mask), (b_, hq, s, t))
    out = np.zeros((b_, hq, s, v.shape[3]))
    for b in range(b_):
        for h in range(hq):
            kv = h // group
            for i in range(s):
                scores = np.array([q[b, h, i] @ k[b, kv, j] for j in range(t)]) * scale
                keep = np.ones(t, dtype=bool)
                if causal == "top_left":
                    keep &= np.arange(t) <= i
                elif causal == "bottom_right":
                    keep &= np.arange(t) <= i + (t - s)
                if full_mask is not None:
                    row = full_mask[b, h, i]
                    if row.dtype == np.bool_:
                        keep &= row
                    else:
                        scores = scores + row.astype(np.float64)
                scores = np.where(keep, scores, -np.inf)
                weights = np.exp(scores - scores.max())
                out[b, h, i] = (weights / weights.sum()) @ v[b, kv]
    return out


@dataclass(frozen=True)
class Attn:
    """One sdpa configuration: heads, lengths, head dims, mask kind, causal alignment, scale."""

    hq: int
    hkv: int
    s: int = 3
    t: int = 10
    d: int = 64
    dv: int = 64
    b: int = 2
    mask: str | None = None  # bool_2d, bool_full, bool_bcast, add_2d, add_full
    causal: str | None = None  # top_left, bottom_right
    scale: float | None = None

    def __str__(self) -> str:
        parts = [f"{self.hq}q{self.hkv}kv", f"S{self.s}T{self.t}"]
        parts += [f"D{self.d}Dv{self.dv}"] if self.dv != self.d else []
        parts += [x for x in (self.mask, self.causal) if x]
        parts += [f"scale{self.scale}"] if self.scale is not None else []
        return "-".join(parts)

    def mask_shape(self) -> tuple[int, ...]:
        kind = self.mask.split("_", 1)[1]
        shapes = {"2d": (self.s, self.t), "full": (self.b, self.hq, self.s, self.t), "bcast": (self.b, 1, 1, self.t)}
        return shapes[kind]

    def inputs(self, dtype: DType) -> list[np.ndarray]:
        rng = np.random.default_rng(zlib.crc32(f"{self}-{dtype.value}".encode()))
        q = random_array(rng, (self.b, self.hq, self.s, self.d), dtype)
        k = random_array(rng, (self.b, self.hkv, self.t, self.d), dtype)
        v = random_array(rng, (self.b, self.hkv, self.t, self.dv), dtype)
        if self.mask is None:
            return [q, k, v]
        keep = rng.random(self.mask_shape()) < 0.6
        keep[..., 0] = True  # key 0 is visible to every row under both alignments: no row is fully masked
        if self.mask.startswith("bool"):
            return [q, k, v, keep]
        return [q, k, v, np.where(keep, 0.0, -np.inf).astype(dtype.numpy)]

    def fn(self):
        attrs = {"scale": self.scale, "causal": self.causal}
        if self.mask is None:
            return lambda q, k, v: ops.sdpa(q, k, v, **attrs)
        return lambda q, k, v, mask: ops.sdpa(q, k, v, mask=mask, **attrs)


def _attn_cases():
    # Shapes repeat on purpose: JAX compiles each new (shape, dtype) eagerly (~1-2 s on 2 cores), so the
    # dtype sweep and most variants share the 8q/2kv S3/T10 layout; other layouts run in one or two dtypes.
    for dt in FLOAT_DTYPES:
        yield Attn(8, 2), dt  # GQA 4
        yield Attn(8, 2, scale=0.3), dt
        yield Attn(8, 2, mask="bool_2d"), dt  # some keys of most rows masked
        yield Attn(8, 2, mask="add_full"), dt
        yield Attn(8, 2, causal="top_left"), dt
        yield Attn(8, 2, causal="bottom_right"), dt
    yield Attn(24, 2), BF16  # GQA 12, the Qwen layout
    yield Attn(24, 2), F32
    yield Attn(8, 1), F32  # MQA
    yield Attn(4, 4), F32  # ungrouped
    for mask in ("bool_full", "bool_bcast", "add_2d"):
        yield Attn(8, 2, mask=mask), F32
    yield Attn(24, 2, mask="bool_full"), F32  # a per-query-head mask under GQA 12
    yield Attn(24, 2, mask="add_full"), BF16
    for causal in ("top_left", "bottom_right"):
        for mask in ("bool_2d", "add_full"):
            yield Attn(8, 2, mask=mask, causal=causal), F32  # causal combined with a user mask
        yield Attn(8, 2, s=6, t=6, causal=causal), F32  # S == T: both alignments agree
        yield Attn(8, 2, s=6, t=6, mask="bool_2d", causal=causal), F32
    yield Attn(8, 1, mask="bool_full", causal="bottom_right", scale=0.05), F32
    yield Attn(8, 2, dv=32), F32  # value head dim != key head dim: JAX's explicit form
    yield Attn(8, 2, dv=32, mask="add_2d", causal="bottom_right"), BF16
    yield Attn(8, 2, dv=32, mask="bool_full", causal="top_left", scale=0.2), F16
    yield Attn(1, 1, s=1, t=1, b=1, mask="add_full"), BF16  # one cell: XLA:CPU refuses JAX's fused form in bf16


ATTN_CASES = [pytest.param(case, dt, id=f"{case}-{dt.short}") for case, dt in _attn_cases()]
_ATTN_CACHE: dict = {}


def _attn(case: Attn, dtype: DType):
    """(graph, inputs, oracle output rounded to dtype), computed once per case."""
    key = (case, dtype)
    if key not in _ATTN_CACHE:
        xs = case.inputs(dtype)
        graph = trace(case.fn(), *specs(xs), name="attention")
        mask = xs[3] if len(xs) == 4 else None
        expected = attention_oracle(*xs[:3], mask, scale=case.scale, causal=case.causal or "none")
        _ATTN_CACHE[key] = graph, xs, expected.astype(dtype.numpy)
    return _ATTN_CACHE[key]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case, dtype", ATTN_CASES)
def test_sdpa_matches_independent_oracle(case, dtype, target):
    graph, xs, expected = _attn(case, dtype)
    same_dtype = [c for c, dt in _attn_cases() if dt is dtype]
    members = lambda: [_attn(c, dtype)[:2] for c in same_dtype]  # noqa: E731
    out = execute(target, graph, xs, ("sdpa", dtype), members, same_dtype.index(case))
    assert out.shape == (case.b, case.hq, case.s, case.dv)
    assert_close(out, expected)


# ---------------------------------------------------------------------------- the oracle's own semantics


def test_attention_oracle_causal_alignments_by_hand():
    """Pin the oracle's alignments on cases whose answer is known without computing a softmax."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 1, 5, 4)), rng.standard_normal((1, 1, 5, 4))
    top = attention_oracle(q, k, v, causal="top_left")
    bottom = attention_oracle(q, k, v, causal="bottom_right")
    none = attention_oracle(q, k, v)
    np.testing.assert_allclose(top[0, :, 0], np.broadcast_to(v[0, 0, 0], (2, 4)))  # row 0 sees key 0 only
    np.testing.assert_allclose(bottom[0, :, 2], none[0, :, 2])  # the last row sees every key (T - S = 2)
    # bottom_right row 0 sees keys 0..2: the same as no causal mask over the first three keys
    np.testing.assert_allclose(bottom[:, :, :1], attention_oracle(q[:, :, :1], k[:, :, :3], v[:, :, :3]))
    assert not np.allclose(top, bottom)
    square = (q, k[:, :, :3], v[:, :, :3])
    np.testing.assert_allclose(
        attention_oracle(*square, causal="top_left"), attention_oracle(*square, causal="bottom_right")
    )


@requires("mlx.core", "jax")
def test_attention_oracle_agrees_with_backend_conventions():
    """JAX ``is_causal`` is top-left and MLX ``mask="causal"`` is bottom-right (docs/semantics.md §4), per the oracle."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 4, 3, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 2, 9, 64)).astype(np.float32) for _ in range(2))
    swap = lambda x: jnp.swapaxes(jnp.asarray(x), 1, 2)  # noqa: E731  [B, H, S, D] <-> [B, S, H, D]
    causal = jax.jit(lambda q, k, v: swap(jax.nn.dot_product_attention(swap(q), swap(k), swap(v), is_causal=True)))
    jax_causal = np.asarray(causal(q, k, v))
    mlx_causal = np.array(
        mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.125, mask="causal")
    )
    assert_close(jax_causal, attention_oracle(q, k, v, causal="top_left").astype(np.float32))
    assert_close(mlx_causal, attention_oracle(q, k, v, causal="bottom_right").astype(np.float32))


# ---------------------------------------------------------------------------- MLX causal lowering


@requires("mlx.core")
@pytest.mark.parametrize("s, t", [(3, 10), (6, 6), (1, 7)])
def test_mlx_bottom_right_is_mlx_causal(s, t):
    """Plain bottom_right lowers to mx's own ``mask="causal"``: bit-identical to calling it directly."""
    q = random_array(np.random.default_rng(s), (2, 8, s, 64), BF16)
    k, v = (random_array(np.random.default_rng(t + i), (2, 2, t, 64), BF16) for i in range(2))
    program = lower(trace(lambda q, k, v: ops.sdpa(q, k, v, causal="bottom_right"), *specs([q, k, v])), "mlx")
    assert 'mask="causal"' in program.source
    direct = mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.125, mask="causal")
    assert_bits_equal(run(program, q, k, v), run_mlx(direct))


@requires("mlx.core")
@pytest.mark.parametrize("mask_dtype", [BOOL, F32])
@pytest.mark.parametrize("s, t", [(3, 10), (6, 6)])
def test_mlx_explicit_bottom_right_mask_matches_mlx_causal(s, t, mask_dtype):
    """With a user mask the causal part is spelled out; with an all-attend mask it must equal mx's "causal"."""
    rng = np.random.default_rng(3)
    q, k, v = (random_array(rng, shape, F32) for shape in ((1, 8, s, 64), (1, 2, t, 64), (1, 2, t, 64)))
    mask = np.ones((s, t), bool) if mask_dtype is BOOL else np.zeros((s, t), np.float32)
    graph = trace(lambda q, k, v, m: ops.sdpa(q, k, v, mask=m, causal="bottom_right"), *specs([q, k, v, mask]))
    program = lower(graph, "mlx")
    assert 'mask="causal"' not in program.source
    direct = mx.fast.scaled_dot_product_attention(mx.array(q), mx.array(k), mx.array(v), scale=0.125, mask="causal")
    assert_close(run(program, q, k, v, mask), run_mlx(direct))


def run_mlx(x) -> np.ndarray:
    from attnpass.backends import to_numpy

    return to_numpy(x)
