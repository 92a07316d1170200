"""``optimize(model, check=True)``: every routed call computed both ways, the first difference beyond its numerics
raised.

A routed call's stated numerics are its program's (:data:`~.programs.PROGRAMS`' ``numerics``): bit for bit with
the client's function under the CPU default pipeline, or within a per-dtype absolute bound (MLA and DSA's latent
form, QSA's gather; docs/numerics.md). A pipeline the caller gave, or a device other than the CPU, states at most
:data:`REWRITTEN` (what ``decompose-sdpa`` off MLX's CPU fallback states). :func:`difference` compares the two
outputs on raw bits; :func:`where` names the module that made the call.
"""

from __future__ import annotations

import sys
from typing import Any

from attnpass.ir import AttnpassError

Numerics = dict[str, float]  # dtype name -> the largest absolute difference stated; no entry: bit for bit
CHECK_ENV = "ATTNPASS_OPTIMIZE_CHECK"  # optimize(check=None) reads it: on runs every routed call both ways
EXACT: Numerics = {}
REWRITTEN: Numerics = {"float32": 1e-5, "bfloat16": 4e-2, "float16": 4e-2}  # docs/numerics.md: decompose-sdpa


class CheckError(AttnpassError):
    """``optimize(check=True)``: a routed call's output differs from the client's beyond its stated numerics."""


def loosest(a: Numerics, b: Numerics) -> Numerics:
    """The looser of two statements, per dtype."""
    return {d: max(a.get(d, 0.0), b.get(d, 0.0)) for d in a.keys() | b.keys()}


def stated(numerics: Numerics, dtype: str) -> str:
    """The statement for ``dtype`` in words."""
    bound = numerics.get(dtype, 0.0)
    return f"bit for bit in {dtype}" if bound == 0.0 else f"within {bound:g} in {dtype}"


def difference(out: Any, expected: Any, numerics: Numerics) -> str | None:
    """Why ``out`` is not ``expected`` as ``numerics`` states (shape, dtype, bits or the bound), or None."""
    import mlx.core as mx

    if out.shape != expected.shape or out.dtype != expected.dtype:
        return f"{out.dtype}{list(out.shape)} where the client returns {expected.dtype}{list(expected.shape)}"
    dtype = str(expected.dtype).removeprefix("mlx.core.")
    bound = numerics.get(dtype, 0.0)
    wide_out, wide_expected = out.astype(mx.float32), expected.astype(mx.float32)
    if bound == 0.0:
        bits = mx.uint16 if expected.dtype.size == 2 else mx.uint32
        differ = mx.not_equal(out.view(bits), expected.view(bits))
    else:
        differ = mx.logical_not(mx.abs(wide_out - wide_expected) <= bound)  # NaN differs
    count = int(mx.sum(differ).item())
    if not count:
        return None
    worst = float(mx.max(mx.where(differ, mx.abs(wide_out - wide_expected), 0.0)).item())
    return (
        f"{count} of {expected.size} element(s) differ, by up to {worst:.3g} (absolute), beyond the stated "
        f"{stated(numerics, dtype)}"
    )


def where(model: Any, names: dict[int, str]) -> str:
    """The innermost module of ``model`` on the calling stack (the layer whose attention this is), by its path
    in ``model`` (``names``: module id -> path, filled on first use)."""
    if not names:
        names.update((id(m), n or type(model).__name__) for n, m in model.named_modules())
    frame = sys._getframe(1)
    while frame is not None:
        found = names.get(id(frame.f_locals.get("self")))
        if found is not None:
            return found
        frame = frame.f_back
    return "(no module of the model on the stack)"


__all__ = ["CHECK_ENV", "EXACT", "REWRITTEN", "CheckError", "Numerics", "difference", "loosest", "stated", "where"]
