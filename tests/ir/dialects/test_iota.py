"""The iota op: int32 positions along one axis, the same on every target."""

from __future__ import annotations

import numpy as np
import pytest

from attnpass.backends import run
from attnpass.ir import Graph, ShapeError
from attnpass.lowering import lower
from tests.util import target_params

TARGETS = target_params("numpy", "mlx", "jax")


def iota_graph(shape: tuple[int, ...], axis: int) -> Graph:
    graph = Graph("positions")
    graph.set_outputs([graph.add_node("iota", [], {"shape": shape, "axis": axis})])
    return graph


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(("shape", "axis"), [((5,), 0), ((2, 3, 4), 1), ((2, 3, 4), -1), ((4, 1, 6), 0)])
def test_every_target_writes_the_positions_along_the_axis(target, shape, axis):
    expected = np.broadcast_to(np.indices(shape)[axis % len(shape)], shape).astype(np.int32)
    out = run(lower(iota_graph(shape, axis), target))
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, expected)


def test_the_shape_rule_checks_shape_and_axis():
    assert str(iota_graph((2, 3), 1).node("iota").type) == "i32[2,3]"
    with pytest.raises(ShapeError, match="iota: shape \\[2, -1\\] has negative dims"):
        iota_graph((2, -1), 0)
    with pytest.raises(ShapeError, match="iota"):
        iota_graph((2, 3), 2)
