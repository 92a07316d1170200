"""head_chunk_plan (docs/semantics.md §2.2): the pinned 24q/2kv table, an exhaustive grid checked against a
brute-force reading of the rules, and hypothesis properties (never raises, subcalls ineligible)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnpass.passes import head_chunk_plan
from attnpass.passes.rewrites.head_chunk import head_chunks

# docs/semantics.md §2.2: 24 q / 2 kv, budget 32.
TABLE_24_2 = [
    (-1, None), (0, None), (1, None), (2, None), (3, (10, 4)), (4, (8, 4)), (5, (6, 4)), (6, (5, 6)),
    (7, (4, 6)), (8, (4, 6)), (9, (3, 8)), (16, (2, 12)), (31, (1, 24)), (32, (1, 24)), (33, None),
    (40, None), (4097, None),
]  # fmt: skip


@pytest.mark.parametrize("q_len, expected", TABLE_24_2, ids=[f"q_len{q}" for q, _ in TABLE_24_2])
def test_spec_table_24q_2kv(q_len, expected):
    assert head_chunk_plan(q_len, 24, 2) == expected


def test_spec_remainders_24q_2kv():
    """3 -> 10+2, 4 -> 8+4, 6 -> 5+5+2 per group; never spanning a group."""
    for q_len, expected in ((3, [10, 2]), (4, [8, 4]), (6, [5, 5, 2])):
        layout = head_chunks(24, 2, head_chunk_plan(q_len, 24, 2)[0])
        assert [h1 - h0 for j, h0, h1 in layout if j == 0] == [h1 - h0 for j, h0, h1 in layout if j == 1] == expected


def brute_force(q_len: int, n_q: int, n_kv: int, budget: int) -> tuple[int, int] | None:
    """The rules of docs/semantics.md §2.2 read literally: search the largest chunk that fits, then lay the chunks out."""
    if n_kv <= 0 or n_q % n_kv != 0 or n_q // n_kv <= 0:
        return None
    gqa = n_q // n_kv
    if not (q_len * gqa > budget and q_len <= budget):
        return None
    hpc = max([h for h in range(1, gqa + 1) if q_len * h <= budget], default=1)
    layout = []
    for _group in range(n_kv):
        left = gqa
        while left > 0:
            layout.append(min(hpc, left))
            left -= hpc
    return hpc, len(layout)


HEADS = [(24, 2), (16, 2), (8, 1), (6, 6), (32, 4), (12, 3), (14, 2), (64, 8), (24, 5), (24, 0), (0, 2), (-24, 2)]
GRID = [(q, hq, hkv) for hq, hkv in HEADS for q in range(-1, 41)]


@pytest.mark.parametrize("q_len, n_q, n_kv", GRID, ids=[f"q{q}-{hq}x{hkv}" for q, hq, hkv in GRID])
def test_grid_matches_brute_force(q_len, n_q, n_kv):
    plan = head_chunk_plan(q_len, n_q, n_kv)
    assert plan == brute_force(q_len, n_q, n_kv, 32)
    if plan is not None:
        hpc, chunks = plan
        layout = head_chunks(n_q, n_kv, hpc)
        assert len(layout) == chunks
        # every subcall fits the budget, so a second run of the pass leaves it alone
        assert all(head_chunk_plan(q_len, h1 - h0, 1) is None for _, h0, h1 in layout)


ints = st.integers(min_value=-(2**70), max_value=2**70)


@given(ints, ints, ints, ints)
def test_never_raises_for_any_integers(q_len, n_q, n_kv, budget):
    plan = head_chunk_plan(q_len, n_q, n_kv, budget)
    assert plan is None or (isinstance(plan, tuple) and all(isinstance(x, int) and x >= 1 for x in plan))


small = st.integers(min_value=-4, max_value=200)


@given(small, st.integers(1, 128), st.integers(1, 16), st.integers(-4, 256))
def test_eligible_plans_fit_the_budget_and_cover_all_heads(q_len, gqa, n_kv, budget):
    n_q = gqa * n_kv
    plan = head_chunk_plan(q_len, n_q, n_kv, budget)
    assert (plan is not None) == (q_len * gqa > budget and q_len <= budget)
    if plan is None:
        return
    hpc, chunks = plan
    assert 1 <= hpc <= gqa and q_len * hpc <= budget
    assert hpc == gqa or q_len * (hpc + 1) > budget  # the largest chunk that fits
    assert chunks == n_kv * math.ceil(gqa / hpc)
    assert head_chunk_plan(q_len, hpc, 1, budget) is None  # subcalls are ineligible: idempotence


@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 64))
def test_layout_partitions_heads_in_order_without_spanning_groups(gqa, n_kv, hpc):
    n_q = gqa * n_kv
    layout = head_chunks(n_q, n_kv, hpc)
    assert [h for _, h0, h1 in layout for h in range(h0, h1)] == list(range(n_q))
    for j, h0, h1 in layout:
        assert j * gqa <= h0 < h1 <= (j + 1) * gqa and h1 - h0 <= hpc
    for j in range(n_kv):  # full chunks first, the remainder last
        sizes = [h1 - h0 for g, h0, h1 in layout if g == j]
        assert sizes[:-1] == [min(hpc, gqa)] * (len(sizes) - 1) and 0 < sizes[-1] <= hpc


@given(st.integers(1, 32), st.integers(1, 32), st.integers(1, 64), st.integers(1, 8))
def test_heads_per_chunk_shrinks_as_rows_grow(q_len, extra, gqa, n_kv):
    a = head_chunk_plan(q_len, gqa * n_kv, n_kv)
    b = head_chunk_plan(q_len + extra, gqa * n_kv, n_kv)
    if a is not None and b is not None:
        assert b[0] <= a[0] and b[1] >= a[1]


@given(st.integers(1, 100), st.integers(1, 100))
def test_indivisible_heads_have_no_plan(n_q, n_kv):
    if n_q % n_kv:
        assert head_chunk_plan(4, n_q, n_kv) is None
