"""backends/mlx/masks.py: a bool mask is proven a structure only when it is that structure on every pair; the
valid rows and the padded masks a program gets are the ones the client would have used."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.ir.dialects.attention import visible
from tests.util import lazy_import, requires

pytestmark = requires("mlx.core", "mlx_lm")

mx = lazy_import("mlx.core")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(0, 20), st.one_of(st.none(), st.integers(1, 16)))
def test_mlx_lms_own_masks_are_proven_the_structure_they_are(rows, offset, window):
    from mlx_lm.models.base import create_causal_mask

    from attnpass.backends.mlx.masks import Masks

    mask = create_causal_mask(rows, offset, window_size=window)[None, None]
    keys = rows + offset
    found = Masks().structure(mask, rows, keys)
    assert found is not None
    first, (causal, left, right, chunk) = found
    window_attr = None if (left, right, chunk) == (None, None, None) else (left, right, chunk)
    seen = visible(rows, keys - first, causal, window_attr)
    seen = np.ones((rows, keys - first), bool) if seen is None else np.broadcast_to(seen, (rows, keys - first))
    expected = np.array(mask).reshape(rows, keys)
    assert not expected[:, :first].any()
    assert np.array_equal(seen, expected[:, first:])


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(2, 12), st.data())
def test_a_mask_that_is_no_structure_is_not_proven_one(rows, keys, data):
    from attnpass.backends.mlx.masks import Masks

    plane = np.tril(np.ones((rows, keys), bool), keys - rows)
    i = data.draw(st.integers(0, rows - 1), "row")
    j = data.draw(st.integers(0, keys - 1), "key")
    plane[i, j] = not plane[i, j]  # one pair flipped: a hole, an extra key, or a row without keys
    found = Masks().structure(mx.array(plane)[None, None], rows, keys)
    if found is not None:  # the flip may make another structure: then it must be exactly that one
        first, (causal, left, right, chunk) = found
        window = None if (left, right, chunk) == (None, None, None) else (left, right, chunk)
        seen = visible(rows, keys - first, causal, window)
        seen = np.ones((rows, keys - first), bool) if seen is None else np.broadcast_to(seen, (rows, keys - first))
        assert not plane[:, :first].any() and np.array_equal(seen, plane[:, first:])


def test_valid_rows_are_the_offset_and_causal_bottom_right():
    from attnpass.backends.mlx.masks import Masks

    masks = Masks()
    plain = np.array(masks.valid(3, 5, 8, causal=False)).reshape(-1, 8)
    assert np.array_equal(plain, np.broadcast_to(np.arange(8) < 5, plain.shape))
    causal = np.array(masks.valid(3, 5, 8, causal=True)).reshape(3, 8)
    assert np.array_equal(causal, np.arange(8)[None] <= (5 - 3 + np.arange(3))[:, None])
    assert masks.valid(3, 5, 8, causal=True) is masks.valid(3, 5, 8, causal=True)  # every layer shares it


def test_a_clients_mask_over_the_buffer_is_padded_with_masked_out_keys():
    from attnpass.backends.mlx.masks import Masks

    masks = Masks()
    additive = mx.zeros((1, 1, 2, 3))
    padded = np.array(masks.over_buffer(additive, 2, 3, 5))
    assert np.array_equal(padded[..., :3], np.zeros((1, 1, 2, 3))) and np.all(padded[..., 3:] == -np.inf)
    flags = np.array(masks.over_buffer(mx.ones((1, 1, 2, 3), dtype=mx.bool_), 2, 3, 5))
    assert flags[..., :3].all() and not flags[..., 3:].any()
    assert masks.over_buffer(additive, 2, 3, 3) is additive
