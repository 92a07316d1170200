"""Block selections (backends/mlx/selections.py): a learned indexer's bool block mask proven on its values, and the
``selected_attention`` program that dsa-gather turns into a gather of each row's cells.

The program is checked against MLX's fused call under the whole mask, for each way selection heads relate to KV
heads (more selection heads than KV heads, fewer, as many, and MiniMax-M3's own 16 query heads over 1 KV head with
4 selection heads); the proof on values declines every way a mask can break what the gather assumes.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.util import lazy_import, requires

pytestmark = requires("mlx.core")

mx = lazy_import("mlx.core")


def block_mask(rng, b, heads, rows, n, block, top_k, group):
    """A MiniMax-style mask: per selection head and row, ``top_k`` random blocks (the row's own block among them),
    their causal cells, repeated over ``group`` query heads."""
    blocks = -(-n // block)
    keep = np.zeros((b, heads, rows, n), bool)
    for i in np.ndindex(b, heads, rows):
        position = n - rows + i[2]
        own = position // block
        chosen = [own, *rng.choice([x for x in range(blocks) if x != own], top_k - 1, replace=False)]
        for x in chosen:
            keep[(*i, slice(x * block, min((x + 1) * block, position + 1)))] = True
    return np.repeat(keep, group, axis=1)


def program():
    from attnpass.backends.mlx.programs import PROGRAMS, compile_program

    options = dict(strict=True, max_signatures=8, min_keys=0, bounds={})
    return compile_program(PROGRAMS["selected_attention"], None, **options)


@pytest.mark.parametrize(
    "hq, hkv, heads",
    [(8, 2, 4), (8, 4, 2), (4, 4, 4), (16, 1, 4)],
    ids=["selection-heads-over-kv-heads", "kv-heads-over-selection-heads", "one-each", "minimax-m3-geometry"],
)
def test_the_gathered_program_attends_what_the_whole_mask_attends(hq, hkv, heads):
    from attnpass.backends.mlx.selections import BlockSelection, block_selection

    rng = np.random.default_rng(hq + hkv + heads)
    b, rows, n, d, block, top_k = 2, 3, 61, 16, 8, 3
    mask = mx.array(block_mask(rng, b, heads, rows, n, block, top_k, hq // heads))
    per_head, cells = block_selection(mask, BlockSelection(heads, block, top_k), blocks=8)
    q = mx.array(rng.standard_normal((b, hq, rows, d)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((b, hkv, 64, d)).astype(np.float32)) for _ in range(2))
    compiled = program()
    got = compiled(q, k, v, mx.pad(per_head, [(0, 0)] * 3 + [(0, 3)]), cells, 0.25)
    want = mx.fast.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=0.25, mask=mask)
    assert np.abs(np.array(got) - np.array(want)).max() < 1e-5
    (found,) = compiled.specializations
    assert found.ops["qsa_gather"] == 2  # gathered: K and V read at each row's cells only
    assert [r.kind for r in found.remarks if r.pass_name == "dsa-gather"] == ["applied"]


@pytest.mark.parametrize("broken", ["one block too many", "heads of a group differ", "a row without keys"])
def test_a_mask_that_breaks_the_selection_on_its_values_is_not_one(broken):
    from attnpass.backends.mlx.selections import BlockSelection, block_selection

    rng = np.random.default_rng(0)
    found = BlockSelection(heads=2, block=4, top_k=2)
    mask = block_mask(rng, 1, 2, 3, 20, 4, 2, group=2)
    assert block_selection(mx.array(mask), found, blocks=5) is not None  # the control
    if broken == "one block too many":
        mask[0, 0:2, 1] = True  # row 1 of selection head 0: all five blocks
    elif broken == "heads of a group differ":
        mask[0, 1, 2, 0] = not mask[0, 1, 2, 0]  # query head 1, not head 0 of its group
    else:
        mask[0, 2:4, 0] = False
    assert block_selection(mx.array(mask), found, blocks=5) is None


def test_each_rows_cells_cover_its_occupied_blocks_and_are_distinct():
    from attnpass.backends.mlx.selections import BlockSelection, block_selection

    rng = np.random.default_rng(1)
    mask = block_mask(rng, 2, 2, 5, 37, 4, 3, group=1)
    mask[0, 0, 0] = False
    mask[0, 0, 0, 0] = True  # a row of one occupied block: two more are gathered, hidden by the mask
    _per_head, cells = block_selection(mx.array(mask), BlockSelection(2, 4, 3), blocks=10)
    cells = np.array(cells)
    assert cells.shape == (2, 2, 5, 12) and cells.max() < 40
    for i in np.ndindex(2, 2, 5):
        assert len(set(cells[i])) == 12 and set(np.flatnonzero(mask[i])) <= set(cells[i])
