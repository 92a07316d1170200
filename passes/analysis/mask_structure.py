"""An sdpa mask built from positions (aranges, iotas, offsets, a window) read back as sdpa's causal kind and
``window`` (docs/semantics.md §1.4): a bool mask, or an additive one of 0 and -inf (decomposed attention's
``where(m, s, -inf)`` raised, ``s + where(m, 0, -inf)``).

mlx-lm's ``create_causal_mask(N, offset, window_size)`` and JAX code build the
mask from position comparisons; imported, it is a subgraph of constants,
iotas, comparisons and layout ops that reads no graph input. :func:`match_structure`
evaluates that subgraph with the reference evaluators and proves the structure
on every one of the ``S * T`` pairs: a candidate (causal kind, left, right,
chunk) derived from the rows' key intervals is kept only if
:func:`~attnpass.ir.dialects.attention.key_ranges` reproduces the evaluated
mask (and-ed with the sdpa's own causal kind and window) exactly. A mask that
reads an input, is too large to evaluate, differs across batch or heads, adds
anything but 0 and -inf, leaves a row all -inf (NaN in the source), or is not
exactly such a structure stays dense, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from attnpass.ir import DType, Graph, Node
from attnpass.ir.dialects.attention import Window, key_ranges, window_offset
from attnpass.ir.dialects.evaluate import EVALUATORS, constant, evaluate

from ..infra.rewrite import Decline, Rewriter

EVAL_LIMIT = 1 << 27  # elements of any value evaluated to prove a structure (16K x 8K)


@dataclass(frozen=True)
class Structure:
    mask: str
    causal: str
    window: Window | None
    message: str
    figures: dict  # the message's figures by name (Remark.data)


def _static(graph: Graph, name: str) -> np.ndarray | str:
    """The value of ``name`` if it reads only constants and iotas; else why not."""
    memo: dict[str, np.ndarray] = {}
    needed = graph.ancestors([name])
    order = [n for n in graph.nodes() if n.name in needed]
    for node in order:
        if node.type.size > EVAL_LIMIT:
            return f"{node.name} has {node.type.size} elements (more than {EVAL_LIMIT} to evaluate)"
        if node.op == "input":
            return f"it reads the graph input {node.name} (a run-time mask: its positions are not static)"
        if node.op == "constant":
            memo[node.name] = constant(node.attrs["value"], node.type.shape, node.type.dtype)
        elif node.op == "iota":
            shape, axis = node.type.shape, node.attrs["axis"] % node.type.rank
            along = tuple(n if i == axis else 1 for i, n in enumerate(shape))
            memo[node.name] = np.broadcast_to(np.arange(shape[axis], dtype=np.int32).reshape(along), shape)
        elif node.op == "abs":  # exact in every dtype (llama4's |chunk(key) - chunk(query)|)
            memo[node.name] = np.abs(memo[node.inputs[0]])
        elif node.op in EVALUATORS:
            memo[node.name] = evaluate(node.op, node.attrs, [memo[i] for i in node.inputs], node.type)
        else:
            return f"it reads {node.name} = {node.op}, which has no reference evaluator"
    return memo[name]


def _intervals(lo: np.ndarray, hi: np.ndarray, t: int) -> np.ndarray:
    """bool ``[S, t]``: row ``i`` holds the keys ``[lo[i], hi[i])``."""
    j = np.arange(t)[None, :]
    return (j >= lo[:, None]) & (j < hi[:, None])


def _candidates(s: int, t: int, lo: np.ndarray, hi: np.ndarray):
    """(causal, window) structures whose key intervals (of ``t`` keys) might be ``[lo, hi)``, simplest first."""
    for causal in ("bottom_right", "top_left", "none"):
        p = np.arange(s) + window_offset(causal, s, t)
        live = hi > lo
        reach = p - lo + 1
        left = int(reach[live].max()) if live.any() and (lo[live] > 0).any() else None
        right = None
        if causal == "none":
            ahead = hi - 1 - p
            right = int(ahead[live].max()) if live.any() and (hi[live] < t).any() else None
        starts = p[live & (lo == p) & (p > 0)]
        firsts = np.unique(lo[live & (lo > 0)])  # chunk starts, when the chunk bounds them: multiples of the chunk
        chunks: set[int | None] = {None}
        if starts.size:
            chunks.add(int(starts.min()))
        if firsts.size:
            chunks.add(int(np.gcd.reduce(firsts)))
        options = {Window(a, b, c) for a in {None, left} for b in {None, right} for c in chunks}
        for w in sorted(options, key=lambda w: (sum(x is not None for x in w), [x or 0 for x in w])):
            yield causal, (None if w == Window() else w)


def match_structure(graph: Graph, node: Node) -> Structure | Decline | None:
    """The structure a static mask of sdpa ``node`` is, proven on every pair; None: no mask.

    A bool mask is read as the keys it keeps; an additive one only when every value is 0 (kept) or -inf
    (hidden) and it hides no row's last key: such a row is 0/0 = NaN, where a causal kind gives it the mean of V.
    """
    mask = node.mask
    if mask is None:
        return None
    additive = graph.node(mask).type.dtype is not DType.bool
    what = f"{'additive' if additive else 'bool'} mask {mask} kept dense"
    value = _static(graph, mask)
    if isinstance(value, str):
        return Decline("mask_not_static", f"{what}: {value}")
    if additive:
        other = value[(value != 0) & (value != -np.inf)]
        if other.size:
            return Decline("mask_not_structured", f"{what}: it adds {float(other.flat[0])!r}, not only 0 and -inf")
        value = value == 0
    s, t = graph.node(node.q).type.shape[2], graph.node(node.k).type.shape[2]
    plane = np.broadcast_to(value, value.shape[:-2] + (s, t)).reshape(-1, s, t)
    if not (plane == plane[:1]).all():
        return Decline("mask_not_structured", f"{what}: it differs across batch or heads")
    lo0, hi0 = key_ranges(s, t, node.attrs["causal"], node.attrs["window"])
    before = _intervals(lo0, hi0, t)
    seen = plane[0] & before
    emptied = np.flatnonzero(before.any(axis=1) & ~seen.any(axis=1))
    if additive and emptied.size:
        return Decline(
            "rows_without_keys",
            f"{what}: it adds -inf to every key of row {int(emptied[0])}, which is NaN (0/0); "
            "as a causal kind or window that row would be the mean of V",
        )
    found = plane_structure(seen)
    if isinstance(found, str):
        return Decline("mask_not_structured", f"{what}: {found}")
    causal, window = found
    named = f"causal={causal!r}" + (f", window={tuple(window)}" if window else "")
    figures = {
        "mask": mask,
        "causal": causal,
        "window": window and tuple(window),
        "q_len": s,
        "kv_len": t,
        "pairs": s * t,
    }
    kind = "additive mask (0 and -inf)" if additive else "bool mask"
    return Structure(mask, causal, window, f"{kind} {mask} is exactly {named} (all {s * t} pairs checked)", figures)


def plane_structure(seen: np.ndarray) -> tuple[str, Window | None] | str:
    """The (causal kind, window) whose visibility is exactly the bool ``[S, T]`` plane ``seen`` (every pair
    checked, simplest structure first); else why there is none."""
    s, t = seen.shape
    first = np.where(seen.any(axis=1), seen.argmax(axis=1), 0)
    lo, hi = first, first + seen.sum(axis=1)
    gaps = np.flatnonzero((_intervals(lo, hi, t) != seen).any(axis=1))
    if gaps.size:
        return f"row {int(gaps[0])} sees keys that are not one interval"
    return interval_structure(lo, hi, t)


def interval_structure(lo: np.ndarray, hi: np.ndarray, t: int) -> tuple[str, Window | None] | str:
    """The (causal kind, window) under which row ``i`` of ``S`` sees exactly the keys ``[lo[i], hi[i])`` of ``t``
    (``hi <= lo``: none), checked row by row, simplest first; else why there is none."""
    s = len(lo)
    empty = hi <= lo
    for causal, window in _candidates(s, t, lo, hi):
        lo1, hi1 = key_ranges(s, t, causal, window)
        none = hi1 <= lo1
        if (
            np.array_equal(none, empty)
            and np.array_equal(lo1[~none], lo[~empty])
            and np.array_equal(hi1[~none], hi[~empty])
        ):
            return causal, window
    return "each row sees one interval of keys, but no causal kind, window or chunk gives exactly these"


def rewrite_structure(rw: Rewriter, m: Structure) -> None:
    node = rw.anchor
    operands = {**node.operands, "mask": None}
    attrs = {**node.attrs, "causal": m.causal, "window": m.window}
    rw.replace_matched(rw.op("sdpa", operands, attrs, node.name), prune=True)


__all__ = ["EVAL_LIMIT", "Structure", "interval_structure", "match_structure", "plane_structure", "rewrite_structure"]
