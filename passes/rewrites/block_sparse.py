"""Block-sparse attention (docs/semantics.md §1.4): a structured-mask ``sdpa`` computed tile by tile over only the
keys each tile of query rows can see.

A causal ``sdpa`` (optionally with a sliding ``window`` or llama4 chunks) masks
most of its ``[S, T]`` score plane; the fused call still computes all of it.
:class:`BlockSparse` cuts the query rows into tiles of ``block_q`` rows (and at
every chunk boundary), gives each tile the keys ``[k0, k1)`` its rows see (every
row sees an interval of keys, :func:`~attnpass.ir.dialects.attention.key_ranges`,
and the intervals only move right, so a tile's union is one interval), and
replaces the call by one ``sdpa`` per tile over ``q[:, :, q0:q1]``,
``k[:, :, k0:k1]``, ``v[:, :, k0:k1]`` (and the explicit mask's matching block),
concatenated along the rows.

Each tile keeps exactly the dense call's visibility: its last key is its last
row's own position, so the tile is bottom-right aligned with the same relative
positions; the window's left bound carries over unchanged (dropped when no row
of the tile reaches it), the chunk bound is dropped (a tile lies inside one
chunk and its keys start at or after the chunk's first key). :func:`tile_plan`
is the pinned plan; ``block_q`` comes from the device's plan unless given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from attnpass.ir import DType, Graph, Node, require_int
from attnpass.ir.dialects.attention import Window, key_ranges, window_offset

from ..analysis.devices import DEVICES
from ..analysis.quantized_attention import NOT_CARRIED, decline_quantized
from ..infra.base import Remarks
from ..infra.policy import SwitchedPass
from ..infra.registry import register_pass
from ..infra.rewrite import Decline, Rewriter, Rule, apply_rules

ENV_VAR = "ATTNPASS_BLOCK_SPARSE"
MIN_FLOP_RATIO = 1.2  # below it the tiles' extra calls and slices outweigh the pairs they skip


class Tile(NamedTuple):
    """Query rows ``[q0, q1)`` attend keys ``[k0, k1)`` with ``window`` (the tile is bottom-right aligned)."""

    q0: int
    q1: int
    k0: int
    k1: int
    window: Window | None


def tile_plan(s: int, t: int, causal: str, window: Window | None, block_q: int) -> list[Tile]:
    """The tiles of a causal ``sdpa`` with ``S <= T`` rows: ``block_q`` rows each, also cut where a chunk starts."""
    if causal == "none" or s > t:
        raise ValueError(f"tile_plan: needs a causal kind and q_len <= k_len, got causal={causal!r}, S={s}, T={t}")
    lo, hi = key_ranges(s, t, causal, window)
    off = window_offset(causal, s, t)
    cuts = set(range(0, s, block_q))
    if window is not None and window.chunk is not None:
        cuts |= {p - off for p in range(-(-off // window.chunk) * window.chunk, off + s, window.chunk)}
    bounds = sorted(cuts) + [s]
    tiles = []
    for q0, q1 in zip(bounds, bounds[1:]):
        k0, k1 = int(lo[q0]), int(hi[q1 - 1])
        left = None if window is None else window.left
        if left is not None and q1 - 1 + off - left + 1 <= k0:  # no row of the tile reaches its window's left end
            left = None
        tiles.append(Tile(q0, q1, k0, k1, None if left is None else Window(left)))
    return tiles


@dataclass(frozen=True)
class _Plan:
    tiles: list[Tile]
    message: str
    figures: dict


def _describe(tiles: list[Tile], s: int, t: int, visited: int) -> str:
    spans = ", ".join(f"{q0}:{q1}->{k0}:{k1}" + (f" w{w.left}" if w else "") for q0, q1, k0, k1, w in tiles)
    return (
        f"{len(tiles)} tiles visit {visited} of {s * t} (q, k) pairs (FLOP ratio {s * t / visited:.2f}); "
        f"rows->keys: {spans}"
    )


def _match(block_q: int, plan_of: str):
    def match(graph: Graph, node: Node) -> _Plan | Decline:
        causal, window = node.attrs["causal"], node.attrs["window"]
        (s, t) = graph.node(node.q).type.shape[2], graph.node(node.k).type.shape[2]
        if causal == "none":
            what = f"window={tuple(window)} without causality" if window else "no structured mask (causal='none')"
            return Decline("no_structured_mask", f"{what}: nothing says which key blocks are hidden")
        if s > t:
            return Decline(
                "rows_without_keys",
                f"q_len {s} > k_len {t}: rows without keys are the mean of all T values, not tile-local",
                data={"q_len": s, "kv_len": t},
            )
        if s <= block_q:
            return Decline(
                "too_few_rows", f"q_len {s} <= block_q {block_q}: one tile", data={"q_len": s, "block_q": block_q}
            )
        tiles = tile_plan(s, t, causal, window, block_q)
        visited = sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1, _ in tiles)
        ratio = s * t / visited
        if ratio < MIN_FLOP_RATIO:
            return Decline(
                "little_gain",
                f"the tiles would skip little: FLOP ratio {ratio:.2f} < {MIN_FLOP_RATIO}",
                data={"flop_ratio": ratio, "min_flop_ratio": MIN_FLOP_RATIO, "pairs": s * t, "visited": visited},
            )
        mask = node.mask
        if mask is not None and graph.node(mask).type.dtype is DType.bool and node.sinks is None:
            return Decline(
                "rows_without_keys",
                f"bool mask {mask}: a row it leaves without keys is the mean of all T values in the dense call, "
                "of only its tile's keys in a tile (an additive mask, or sinks, keep it exact)",
            )
        message = (
            f"block_q {block_q} ({plan_of}); "
            + _describe(tiles, s, t, visited)
            + "; each tile bottom-right aligned with "
            "the dense call's visibility, so a row differs from the dense row only by the backend's summation "
            "order over fewer keys"
        )
        figures = {
            "block_q": block_q, "plan": plan_of, "tiles": len(tiles), "pairs": s * t, "visited": visited,
            "flop_ratio": ratio, "spans": [(q0, q1, k0, k1, w and w.left) for q0, q1, k0, k1, w in tiles],
            "mask_sliced": mask is not None,
        }  # fmt: skip
        return _Plan(tiles, message + ("; the mask's block sliced per tile" if mask is not None else ""), figures)

    return match


def _rewrite(rw: Rewriter, plan: _Plan) -> None:
    node = rw.anchor
    q, k, v, mask = node.q, node.k, node.v, node.mask
    outs = []
    for i, (q0, q1, k0, k1, window) in enumerate(plan.tiles):
        operands = {
            "q": rw.slice_axis(q, 2, q0, q1, hint=f"{node.name}_q{i}"),
            "k": rw.slice_axis(k, 2, k0, k1, hint=f"{node.name}_{k}{i}"),
            "v": rw.slice_axis(v, 2, k0, k1, hint=f"{node.name}_{v}{i}"),
            "sinks": node.sinks,
        }
        if mask is not None:
            rank = rw.type(mask).rank
            m = mask
            if rank >= 2 and rw.type(mask).shape[-2] != 1:
                m = rw.slice_axis(m, rank - 2, q0, q1, hint=f"{node.name}_m{i}")
            if rank >= 1 and rw.type(mask).shape[-1] != 1:
                m = rw.slice_axis(m, rank - 1, k0, k1, hint=f"{node.name}_m{i}")
            operands["mask"] = m
        attrs = {**node.attrs, "causal": "bottom_right", "window": window}
        outs.append(rw.op("sdpa", operands, attrs, f"{node.name}_t{i}"))
    rw.replace_matched(rw.concat(outs, 2, f"{node.name}_rows"))


@register_pass
@dataclass(frozen=True)
class BlockSparse(SwitchedPass):
    """Rewrite each causal ``sdpa`` longer than ``block_q`` rows into per-tile calls over only the keys its rows
    see (:func:`tile_plan`), concatenated along the rows; valid IR in, valid IR out.

    ``device`` picks ``block_q`` from its :data:`~..analysis.devices.DEVICES` row unless ``block_q`` is given. Declined, by name: no causal
    kind, ``q_len > k_len`` (rows before the first key are the mean of all values), a bool mask without sinks (a
    row it empties is the mean of all values), one tile, a FLOP ratio (dense pairs over visited pairs) under
    :data:`MIN_FLOP_RATIO`. Exactness: a hidden key weighs exactly 0 in the dense call, so a tile's rows differ
    from the dense rows only by the order of the backend's sums over fewer keys (docs/semantics.md §1.4).
    ``enabled=None`` reads :data:`ENV_VAR` when the pass runs.
    """

    name: ClassVar[str] = "block-sparse"
    env_var: ClassVar[str] = ENV_VAR
    device: str = "cpu"
    block_q: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device not in DEVICES:
            raise ValueError(f"BlockSparse: device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.block_q is not None:
            require_int("BlockSparse", "block_q", self.block_q, meaning="query rows per tile")

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        block_q = self.block_q if self.block_q is not None else DEVICES[self.device].block_q
        plan_of = "given" if self.block_q is not None else f"the {self.device} plan"
        rule = Rule(
            "block-sparse", "sdpa", _match(block_q, plan_of), _rewrite, lambda plan: (plan.message, plan.figures)
        )
        decline_quantized(graph, remarks, NOT_CARRIED.format(self.name))
        return bool(apply_rules(graph, [rule], remarks, decline_all=self.disabled()))


__all__ = ["BlockSparse", "ENV_VAR", "MIN_FLOP_RATIO", "Tile", "tile_plan"]
