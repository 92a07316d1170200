"""Integer options are validated by one helper, with one message form, at every call site."""

from __future__ import annotations

import pytest

from attnpass.passes import DecomposeSDPA, HeadChunkSDPA, PassManager, QSAGather, QSAPoolCache, SplitKV
from attnpass.ir import require_int

HOSTILE = [True, False, 2.0, 0, -1, "3", None, 1.5]


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_require_int_rejects_what_is_not_an_int_at_least_the_minimum(value):
    with pytest.raises(ValueError) as caught:
        require_int("Owner", "width", value)
    assert str(caught.value) == f"Owner: width must be an int >= 1, got {value!r}"


def test_require_int_accepts_ints_from_the_minimum_and_states_a_meaning():
    for value in (1, 2, 10**30):
        require_int("Owner", "width", value)
    require_int("Owner", "width", 2, minimum=2)
    with pytest.raises(ValueError, match=r"^Owner: width must be an int >= 2 \(rows per call\), got 1$"):
        require_int("Owner", "width", 1, minimum=2, meaning="rows per call")


SITES = [
    (lambda v: PassManager([], max_iterations=v), "PassManager: max_iterations must be an int >= 1"),
    (lambda v: SplitKV(shards=v), "SplitKV: shards must be an int >= 2"),
    (lambda v: HeadChunkSDPA(budget=v), "HeadChunkSDPA: budget must be an int >= 1 (q_len * heads per subcall)"),
    (lambda v: QSAGather(max_rows=v), "QSAGather: max_rows must be an int >= 1"),
    (lambda v: QSAGather(pad_multiple=v), "QSAGather: pad_multiple must be an int >= 1"),
    (lambda v: QSAPoolCache(max_rows=v), "QSAPoolCache: max_rows must be an int >= 1"),
    (lambda v: DecomposeSDPA(max_q_len=v), "DecomposeSDPA: max_q_len must be an int >= 1"),
]


@pytest.mark.parametrize("make, message", SITES, ids=lambda s: s if isinstance(s, str) else "")
@pytest.mark.parametrize("value", [True, 0, "3", 2.0], ids=repr)
def test_every_integer_option_uses_the_one_message(make, message, value):
    with pytest.raises(ValueError) as caught:
        make(value)
    assert str(caught.value) == f"{message}, got {value!r}"
