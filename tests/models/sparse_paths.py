"""The learned-sparse families' selections in the sweeps' own cached steps (both sweeps' sparse-path tests)."""

from __future__ import annotations

from typing import Any

from tests.util import load_example

zoo = load_example("model_zoo")


def sparse_selections(family: str, step: str, library: Any, package: str, sparse: dict) -> list:
    """What each sparse call of ``family``'s ``step`` (the sweep's own: its float32 model, the prompt's cache, the
    step's tokens) kept of what it could see (``sparse[family]``'s measure, one entry per call)."""
    import importlib
    import inspect

    import mlx.core as mx

    module, owner, name, measure = sparse[family]
    holder = importlib.import_module(f"{package}.models.{module}")
    holder = getattr(holder, owner) if owner else holder
    original = getattr(holder, name)
    signature = inspect.signature(original)
    seen = []

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        seen.append(measure(bound.arguments, out))
        return out

    model = library.model(family)
    cache = zoo.prefilled(family, step, "f32", library.configure, library.build)
    tokens = mx.array(zoo.TOKENS[None, zoo.PROMPT : zoo.PROMPT + zoo.STEPS[step]])
    setattr(holder, name, spy)
    try:
        mx.eval(model(tokens, cache=cache))
    finally:
        setattr(holder, name, original)
    return seen
