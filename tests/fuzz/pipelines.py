"""Random pipelines over the pass registry: every registered attnpass pass and entry point, with random options.

Passes defined elsewhere in a test process (docs/guide.md's ``broken`` pass, say)
are left out: a pass joins when its class lives in an ``attnpass`` module or
comes from an entry point, and it can be built with its defaults or with
:data:`REQUIRED` (``shard-attention`` names at least one mesh axis; every
generated graph declares the mesh ``families.MESH``). Options are drawn by their type from small pools
(ints around head-chunk's budgets and qsa-gather's widths, floats around
depth factors, ``None`` where optional; :data:`OPTION_POOLS` for options whose
values are names); a combination the pass rejects falls back to its defaults.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from attnpass.passes import Pass, available_passes, get_pass
from attnpass.passes.infra.pipeline_text import PassOption, pass_options
from attnpass.passes.infra.registry import ENTRY_POINT_GROUP

from .choices import Choices
from .families import MESH

POOLS: dict[type, tuple[Any, ...]] = {
    bool: (True, False),
    int: (1, 2, 3, 4, 8, 16, 32, 64, 0),
    float: (2.0, 1.0, 0.0, 0.5, 3.0, 1.5),
    str: (),
}
# Options that take names, by (pass, option): shard-attention's mesh axes (those of families.MESH); the token
# selection the mla family promises (families.mla_family: its input ``idx`` is distinct, every row keeps a key).
OPTION_POOLS: dict[tuple[str, str], tuple[Any, ...]] = {
    **{("shard-attention", axis): (*MESH, None) for axis in ("heads", "batch", "seq")},
    **{(name, "selection_input"): ("idx", None) for name in ("mla-absorb", "dsa-gather")},
}
# What a pass needs to be built at all, used as its defaults (it has none that construct).
REQUIRED: dict[str, dict[str, Any]] = {"shard-attention": {"heads": next(iter(MESH))}}


def _with_defaults(name: str) -> bool:
    try:
        get_pass(name)(**REQUIRED.get(name, {}))
    except (TypeError, ValueError):
        return False
    return True


@functools.cache
def fuzzed_passes() -> tuple[str, ...]:
    """The registered pass names the fuzzer draws from (sorted): ours and entry points, constructible by default."""
    entry_points = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    ours = [n for n in available_passes() if n in entry_points or get_pass(n).__module__.startswith("attnpass.")]
    return tuple(n for n in ours if _with_defaults(n))


def _value(c: Choices, name: str, option: PassOption) -> Any:
    if (name, option.name) in OPTION_POOLS:
        return c.pick(OPTION_POOLS[name, option.name])
    pool = [v for kind in option.kinds if kind is not type(None) for v in POOLS[kind]]
    if type(None) in option.kinds:
        pool.append(None)
    return c.pick(pool) if pool else option.default


@functools.cache
def _options(cls: type[Pass]) -> list[PassOption]:
    return pass_options(cls)


def random_pass(c: Choices, name: str) -> Pass:
    cls = get_pass(name)
    options = {o.name: _value(c, name, o) for o in _options(cls) if o.kinds and c.flag(0.5)}
    try:
        return cls(**{**REQUIRED.get(name, {}), **options})
    except (TypeError, ValueError):
        return cls(**REQUIRED.get(name, {}))


SLOTS = 5


def random_pipeline(c: Choices, favourites: tuple[str, ...] = ()) -> list[Pass]:
    """One to :data:`SLOTS` passes drawn with repetition from :func:`fuzzed_passes`, ``favourites`` 4x as often.

    Every slot draws a pass and then whether it is used, so shrinking drops a
    pass by zeroing one draw without moving the later ones; no slot used means the last.
    """
    names = fuzzed_passes()
    weights = [4 if n in favourites else 1 for n in names]
    slots = [(random_pass(c, c.pick(names, weights)), c.flag(0.5)) for _ in range(SLOTS)]
    return [p for p, used in slots if used] or [slots[-1][0]]
