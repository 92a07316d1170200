"""Runtime checks of the MLX/JAX QSA runtimes (issue 14, item 6): out-of-contract values raise, naming the op.

``lower(graph, target, checks=True)`` or ``ATTNPASS_RUNTIME_CHECKS`` (read at each call, never written)
turn them on; the messages are the numpy reference's, which always checks.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import RuntimeCheckError, lower
from attnpass.lowering.checks import ENV_VAR
from tests.util import requires

R, T = 4, 83  # ceil(83 / 4) = 21 blocks
BACKENDS = [pytest.param(t, marks=requires(m)) for t, m in (("mlx", "mlx.core"), ("jax", "jax"))]
TARGETS = [pytest.param("numpy"), *BACKENDS]


def _graph(op: str):
    def f(selection, positions):
        if op == "qsa_mask":
            return ops.qsa_mask(selection, positions, ratio=R, kv_len=T)
        gather = ops.qsa_cells if op == "qsa_cells" else ops.qsa_cell_valid
        return gather(selection, positions, ratio=R, width=2 * R + R - 1, kv_len=T)

    return trace(f, TensorSpec((1, 2, 2), "int32"), TensorSpec((1, 2), "int32"), name=op)


GOOD_SEL, GOOD_POS = np.array([[[3, -1], [0, 20]]], np.int32), np.array([[80, 82]], np.int32)
BAD = [  # (selection, positions, message)
    (np.array([[[3, 21], [0, 1]]], np.int32), GOOD_POS, r"block id 21 is out of range \[-1, 21\) for kv_len=83"),
    (np.array([[[-2, 1], [0, 1]]], np.int32), GOOD_POS, r"block id -2 is out of range \[-1, 21\)"),
    (GOOD_SEL, np.array([[80, 92]], np.int32), r"position 92 is outside the cache \[0, 83\)"),
    (GOOD_SEL, np.array([[-1, 5]], np.int32), r"position -1 is outside the cache \[0, 83\)"),
]
OPS = ("qsa_mask", "qsa_cells", "qsa_cell_valid")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("target", TARGETS)
def test_checked_programs_raise_naming_the_op(target, op):
    program = lower(_graph(op), target, checks=True)
    for selection, positions, message in BAD:
        with pytest.raises(RuntimeCheckError, match=rf"^{op}: {message}"):
            run(program, selection, positions)
    reference = run(lower(_graph(op), "numpy"), GOOD_SEL, GOOD_POS)
    np.testing.assert_array_equal(run(program, GOOD_SEL, GOOD_POS), reference)


@pytest.mark.parametrize("target", TARGETS)
def test_the_error_is_a_value_error_as_the_reference_always_raised(target):
    with pytest.raises(ValueError):
        run(lower(_graph("qsa_mask"), target, checks=True), *BAD[0][:2])


@pytest.mark.parametrize("target", BACKENDS)
def test_unchecked_backends_drop_out_of_range_values(target, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    program = lower(_graph("qsa_mask"), target)
    assert "qsa_checked" not in program.source
    got = run(program, *BAD[0][:2])
    assert set(np.flatnonzero(got[0, 0, 0])) == set(range(12, 16)) | {80}  # block 3 and the tail; id 21 dropped


@pytest.mark.parametrize("value", ["1", "true", " ON ", "Yes"])
@pytest.mark.parametrize("target", BACKENDS)
def test_environment_switch_is_read_at_each_call(target, value, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    program = lower(_graph("qsa_cells"), target, jit=False)  # eager, without checks: the switch decides per call
    run(program, *BAD[2][:2])
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(RuntimeCheckError, match=r"^qsa_cells: position 92"):
        run(program, *BAD[2][:2])
    assert os.environ[ENV_VAR] == value  # read, never written
    monkeypatch.setenv(ENV_VAR, "off")
    run(program, *BAD[2][:2])


@requires("jax")
def test_a_jitted_program_reads_the_switch_when_traced(monkeypatch):
    """A JAX program is jitted by default: the switch is read at its first call (the trace), not after."""
    import jax

    monkeypatch.setenv(ENV_VAR, "1")
    traced_on = lower(_graph("qsa_cells"), "jax")
    assert "jax.jit(" in traced_on.source
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"qsa_cells: position 92"):
        run(traced_on, *BAD[2][:2])
    monkeypatch.setenv(ENV_VAR, "0")
    traced_off = lower(_graph("qsa_cells"), "jax")
    run(traced_off, *BAD[2][:2])
    monkeypatch.setenv(ENV_VAR, "1")
    run(traced_off, *BAD[2][:2])  # traced with the switch off: no check compiled in


@requires("jax")
def test_a_checked_jax_program_is_eager():
    program = lower(_graph("qsa_mask"), "jax", checks=True)
    assert "jax.jit(" not in program.source


@requires("jax")
def test_under_jax_jit_the_error_carries_the_message():
    import jax

    program = lower(_graph("qsa_mask"), "jax", checks=True)
    jitted = jax.jit(program.fn)
    np.testing.assert_array_equal(
        jitted(GOOD_SEL, GOOD_POS), run(lower(_graph("qsa_mask"), "numpy"), GOOD_SEL, GOOD_POS)
    )
    with pytest.raises(Exception, match=r"qsa_mask: block id 21 is out of range") as info:
        np.asarray(jitted(*BAD[0][:2]))
    assert isinstance(info.value, (RuntimeCheckError, jax.errors.JaxRuntimeError))


@pytest.mark.parametrize("target", BACKENDS)
def test_checked_source_names_the_checked_helper(target):
    source = lower(_graph("qsa_mask"), target, checks=True).source
    assert "import qsa_checked as qsa" in source and "qsa.mask(" in source
