"""Head-chunked SDPA (SPEC §2): split the query heads of each KV group into small subcalls.

MLX's fused vector attention kernel serves only calls with ``q_len * gqa <=
32``; wider GQA calls fall back to an unfused path that materialises a
``[heads, q_len, T]`` score plane. :class:`HeadChunkSDPA` rewrites such calls
into one ``sdpa`` per chunk of at most ``heads_per_chunk`` query heads, each
reading the one-head K/V slice of its KV group, and concatenates the results
in the original head order. :func:`head_chunk_plan` is the pinned plan.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import Graph, Node, SourceLoc

from .base import Pass, Remarks
from .policy import resolve_switch

ENV_VAR = "ATTNPASS_SDPA_HEAD_CHUNK"
DEFAULT_BUDGET = 32

log = logging.getLogger(__name__)
# Acquired (never released) by the first engagement in this process, so it is logged exactly once.
_FIRST_ENGAGEMENT = threading.Lock()


def head_chunk_plan(
    q_len: int, n_q_heads: int, n_kv_heads: int, budget: int = DEFAULT_BUDGET
) -> tuple[int, int] | None:
    """``(heads_per_chunk, chunks)`` for an eligible call, else None; never raises for integers.

    ``gqa = n_q_heads // n_kv_heads``. Eligible when ``q_len * gqa > budget``
    and ``q_len <= budget``. ``heads_per_chunk = max(1, min(gqa, budget //
    max(1, q_len)))`` and ``chunks = n_kv_heads * ceil(gqa / heads_per_chunk)``
    counts the subcalls over all KV groups (24 q / 2 kv at q_len 4: ``(8, 4)``).
    """
    if n_kv_heads <= 0 or n_q_heads % n_kv_heads != 0:
        return None
    gqa = n_q_heads // n_kv_heads
    if gqa <= 0 or not (q_len * gqa > budget and q_len <= budget):
        return None
    heads_per_chunk = max(1, min(gqa, budget // max(1, q_len)))
    return heads_per_chunk, n_kv_heads * -(-gqa // heads_per_chunk)


def head_chunks(n_q_heads: int, n_kv_heads: int, heads_per_chunk: int) -> list[tuple[int, int, int]]:
    """``(kv_head, first_q_head, stop_q_head)`` per subcall: group outer, chunk inner, remainder last."""
    gqa = n_q_heads // n_kv_heads
    return [
        (j, j * gqa + c, j * gqa + min(c + heads_per_chunk, gqa))
        for j in range(n_kv_heads)
        for c in range(0, gqa, heads_per_chunk)
    ]


def resolve_policy(enabled: bool | None) -> tuple[bool, str]:
    """Resolve the policy now: ``(on, why it is off)``; an explicit bool wins over the environment."""
    on, source = resolve_switch(enabled, ENV_VAR)
    return on, "" if on else f"disabled by {'HeadChunkSDPA(enabled=False)' if enabled is False else source}"


@dataclass(frozen=True)
class _Decision:
    node: str
    heads_per_chunk: int
    chunks: int
    slice_mask: bool  # the mask carries one row per query head: slice it per chunk


@dataclass(frozen=True)
class HeadChunkSDPA(Pass):
    """Rewrite every eligible ``sdpa`` into head-chunked subcalls (SPEC §2).

    For ``sdpa(q[B,Hq,S,D], k[B,Hkv,T,D], v[B,Hkv,T,Dv])`` with a plan from
    :func:`head_chunk_plan` (``S`` rows, ``gqa = Hq / Hkv``):

    - KV group ``j`` reads the one-head slices ``k[:, j:j+1]``, ``v[:, j:j+1]``
      (no slice when ``Hkv == 1``); K/V are never repeated to query heads;
    - its query heads are cut into chunks of ``heads_per_chunk``, the last chunk
      keeping the remainder (24/2 at S=6: 5+5+2 per group);
    - one ``sdpa`` per chunk with the original ``scale`` and ``causal`` (every
      chunk has the same S and T, so causal alignment is unchanged);
    - one ``concat`` along the head axis in the original head order replaces the call.

    Masks: a mask without a head axis, or with head axis 1, passes unchanged to
    every subcall (the pinned oracle's behaviour). A per-head mask (head axis
    ``Hq``), which the oracle rejects, is sliced per chunk along its head axis:
    a mathematically equal extension, stated in the remark.

    Each subcall has ``S * heads_per_chunk <= budget``, so running the pass
    again changes nothing. ``enabled=None`` resolves :data:`ENV_VAR` when the
    pass runs (false/off/no/0, any case, stripped, turn it off); the
    environment is never modified. Order: every ``sdpa`` is decided in
    topological order before the graph is touched, then rewritten in that
    order (one sweep, no fixed point needed). Remarks: one per ``sdpa``
    (applied or declined, with the numbers), or one "no sdpa nodes". The
    first rewrite in a process is logged once (INFO, this module's logger).
    """

    name: ClassVar[str] = "head-chunk"
    enabled: bool | None = None
    budget: int = DEFAULT_BUDGET

    def __post_init__(self) -> None:
        if self.enabled is not None and not isinstance(self.enabled, bool):
            raise ValueError(f"HeadChunkSDPA: enabled must be True, False or None, got {self.enabled!r}")
        if isinstance(self.budget, bool) or not isinstance(self.budget, int) or self.budget < 1:
            raise ValueError(f"HeadChunkSDPA: budget must be an int >= 1 (q_len * heads per subcall), got {self.budget!r}")

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        calls = [n for n in graph.nodes() if n.op == "sdpa"]
        if not calls:
            remarks.declined(None, "no sdpa nodes")
            return False
        on, why_off = resolve_policy(self.enabled)
        decisions = []
        for node in calls:
            if not on:
                remarks.declined(node.name, why_off, node.loc)
                continue
            decision = self._check(graph, node, remarks)
            if decision is not None:
                decisions.append(decision)
        for decision in decisions:
            self._rewrite(graph, decision)
        return bool(decisions)

    def _check(self, graph: Graph, node: Node, remarks: Remarks) -> _Decision | None:
        """Decide for one call and record the remark; the graph is not touched."""
        hq, s = graph.node(node.inputs[0]).type.shape[1:3]
        hkv = graph.node(node.inputs[1]).type.shape[1]
        gqa = hq // hkv
        plan = head_chunk_plan(s, hq, hkv, self.budget)
        if plan is None:
            if s > self.budget:
                reason = f"q_len {s} > {self.budget}: wide rows stay unchanged"
            else:
                reason = f"q_len*gqa = {s * gqa} <= {self.budget} (q_len {s}, gqa {gqa}): fits the fused budget"
            remarks.declined(node.name, reason, node.loc)
            return None
        hpc, chunks = plan
        mask = graph.node(node.inputs[3]).type.shape if len(node.inputs) == 4 else None
        slice_mask = mask is not None and len(mask) >= 3 and mask[-3] == hq
        if mask is None:
            masked = "no mask"
        elif slice_mask:
            masked = (
                "per-head mask sliced per chunk along its head axis (a mathematically equal extension; "
                "the oracle passes masks unchanged)"
            )
        else:
            masked = "the mask broadcasts over heads and passes unchanged to every subcall"
        sizes = "+".join(str(h1 - h0) for j, h0, h1 in head_chunks(hq, hkv, hpc) if j == 0)
        remarks.applied(
            node.name,
            f"q_len*gqa = {s * gqa} > {self.budget} (q_len {s}, gqa {gqa}): {chunks} subcalls with "
            f"heads_per_chunk {hpc} ({sizes} per KV group, {hkv} KV group(s)), one-head K/V slices, "
            f"concat in head order; {masked}",
            node.loc,
        )
        return _Decision(node.name, hpc, chunks, slice_mask)

    def _rewrite(self, graph: Graph, decision: _Decision) -> None:
        node = graph.node(decision.node)  # re-read: an earlier rewrite may have renamed its operands
        q, k, v = node.inputs[:3]
        mask = node.inputs[3] if len(node.inputs) == 4 else None
        hq, s = graph.node(q).type.shape[1:3]
        hkv = graph.node(k).type.shape[1]
        name, loc = node.name, node.loc
        outs = []
        for i, (j, h0, h1) in enumerate(head_chunks(hq, hkv, decision.heads_per_chunk)):
            if hkv == 1:
                kj, vj = k, v
            elif h0 == j * (hq // hkv):  # first chunk of KV group j: slice its K/V head once
                kj = _head_slice(graph, k, j, j + 1, 1, f"{name}_k{j}", loc)
                vj = _head_slice(graph, v, j, j + 1, 1, f"{name}_v{j}", loc)
            operands = [_head_slice(graph, q, h0, h1, 1, f"{name}_q{i}", loc), kj, vj]
            if mask is not None and decision.slice_mask:
                axis = graph.node(mask).type.rank - 3
                operands.append(_head_slice(graph, mask, h0, h1, axis, f"{name}_m{i}", loc))
            elif mask is not None:
                operands.append(mask)
            outs.append(graph.add_node("sdpa", operands, node.attrs, name=graph.fresh_name(f"{name}_c{i}"), loc=loc))
        joined = graph.add_node("concat", outs, {"axis": 1}, name=graph.fresh_name(f"{name}_heads"), loc=loc)
        graph.replace_all_uses(name, joined)
        graph.remove_node(name)
        if _FIRST_ENGAGEMENT.acquire(blocking=False):
            log.info(
                "head-chunked SDPA engaged: q_len=%d heads_per_chunk=%d chunks=%d n_kv_heads=%d",
                s, decision.heads_per_chunk, decision.chunks, hkv,
            )  # fmt: skip


def _head_slice(graph: Graph, x: str, h0: int, h1: int, axis: int, hint: str, loc: SourceLoc | None) -> str:
    """Add ``x[..., h0:h1, ...]`` on ``axis`` (every other axis whole); returns the new value's name."""
    shape = graph.node(x).type.shape
    start = tuple(h0 if i == axis else 0 for i in range(len(shape)))
    stop = tuple(h1 if i == axis else d for i, d in enumerate(shape))
    attrs = {"start": start, "stop": stop, "step": (1,) * len(shape)}
    return graph.add_node("slice", [x], attrs, name=graph.fresh_name(hint), loc=loc)


__all__ = ["ENV_VAR", "HeadChunkSDPA", "head_chunk_plan", "head_chunks", "resolve_policy"]
