"""Head-chunked SDPA (docs/semantics.md §2.3): split the query heads of each KV group into small subcalls.

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

from attnpass.ir import Graph, Node, require_int

from ..analysis.devices import METAL_VECTOR_BUDGET
from ..analysis.quantized_attention import NOT_CARRIED, decline_quantized
from ..infra.base import Remarks
from ..infra.policy import SwitchedPass
from ..infra.registry import register_pass
from ..infra.rewrite import Decline, Rewriter, Rule, apply_rules

ENV_VAR = "ATTNPASS_SDPA_HEAD_CHUNK"
DEFAULT_BUDGET = METAL_VECTOR_BUDGET

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


@dataclass(frozen=True)
class _Plan:
    heads_per_chunk: int
    chunks: int
    slice_mask: bool  # the mask carries one row per query head: slice it per chunk
    message: str
    figures: dict


def _match(budget: int):
    """The rule's ``match`` for a ``budget``: the plan and its remark, or why the call stays whole."""

    def match(graph: Graph, node: Node) -> _Plan | Decline:
        hq, s = graph.node(node.q).type.shape[1:3]
        hkv = graph.node(node.k).type.shape[1]
        gqa = hq // hkv
        plan = head_chunk_plan(s, hq, hkv, budget)
        if plan is None:
            if s > budget:
                figures = {"q_len": s, "budget": budget}
                return Decline("too_many_rows", f"q_len {s} > {budget}: wide rows stay unchanged", data=figures)
            return Decline(
                "fused_kernel_serves",
                f"q_len*gqa = {s * gqa} <= {budget} (q_len {s}, gqa {gqa}): fits the fused budget",
                data={"q_len": s, "gqa": gqa, "budget": budget},
            )
        hpc, chunks = plan
        mask = graph.node(node.mask).type.shape if node.mask is not None else None
        slice_mask = mask is not None and len(mask) >= 3 and mask[-3] == hq
        mask_kind = "none" if mask is None else "per_head" if slice_mask else "broadcast"
        if mask is None:
            masked = "no mask"
        elif slice_mask:
            masked = (
                "per-head mask sliced per chunk along its head axis (a mathematically equal extension; "
                "the oracle passes masks unchanged)"
            )
        else:
            masked = "the mask broadcasts over heads and passes unchanged to every subcall"
        group = [h1 - h0 for j, h0, h1 in head_chunks(hq, hkv, hpc) if j == 0]  # query heads per subcall
        sizes = "+".join(str(h) for h in group)
        message = (
            f"q_len*gqa = {s * gqa} > {budget} (q_len {s}, gqa {gqa}): {chunks} subcalls with "
            f"heads_per_chunk {hpc} ({sizes} per KV group, {hkv} KV group(s)), one-head K/V slices, "
            f"concat in head order; {masked}"
            + ("; sinks [Hq] sliced per chunk (one logit per query head)" if node.sinks is not None else "")
        )
        figures = {
            "q_len": s, "gqa": gqa, "budget": budget, "calls": chunks, "heads_per_chunk": hpc, "sizes": group,
            "kv_heads": hkv, "mask": mask_kind, "sinks": node.sinks is not None,
        }  # fmt: skip
        return _Plan(hpc, chunks, slice_mask, message, figures)

    return match


def _rewrite(rw: Rewriter, plan: _Plan) -> None:
    """One sdpa per chunk over its KV group's one-head K/V slices, concatenated in head order."""
    node = rw.anchor
    q, k, v, mask, sinks = node.q, node.k, node.v, node.mask, node.sinks
    hq, s = rw.type(q).shape[1:3]
    hkv = rw.type(k).shape[1]
    name, outs = node.name, []
    for i, (j, h0, h1) in enumerate(head_chunks(hq, hkv, plan.heads_per_chunk)):
        if h0 == j * (hq // hkv):  # first chunk of KV group j: slice its K/V head once (a no-op when Hkv == 1)
            kj = rw.slice_axis(k, 1, j, j + 1, hint=f"{name}_k{j}")
            vj = rw.slice_axis(v, 1, j, j + 1, hint=f"{name}_v{j}")
        operands = {"q": rw.slice_axis(q, 1, h0, h1, hint=f"{name}_q{i}"), "k": kj, "v": vj, "mask": mask}
        if mask is not None and plan.slice_mask:
            operands["mask"] = rw.slice_axis(mask, rw.type(mask).rank - 3, h0, h1, hint=f"{name}_m{i}")
        if sinks is not None:
            operands["sinks"] = rw.slice_axis(sinks, 0, h0, h1, hint=f"{name}_sinks{i}")
        outs.append(rw.op("sdpa", operands, node.attrs, f"{name}_c{i}"))
    rw.replace_matched(rw.concat(outs, 1, f"{name}_heads"))
    if _FIRST_ENGAGEMENT.acquire(blocking=False):
        log.info(
            "head-chunked SDPA engaged: q_len=%d heads_per_chunk=%d chunks=%d n_kv_heads=%d",
            s, plan.heads_per_chunk, plan.chunks, hkv,
        )  # fmt: skip


@register_pass
@dataclass(frozen=True)
class HeadChunkSDPA(SwitchedPass):
    """Rewrite every eligible ``sdpa`` into head-chunked subcalls (docs/semantics.md §2.3).

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
    environment is never modified. One rule on the shared layer
    (:mod:`attnpass.passes.infra.rewrite`): one sweep, one remark per ``sdpa``. The
    first rewrite in a process is logged once (INFO, this module's logger).
    """

    name: ClassVar[str] = "head-chunk"
    env_var: ClassVar[str] = ENV_VAR
    budget: int = DEFAULT_BUDGET

    def __post_init__(self) -> None:
        super().__post_init__()
        require_int("HeadChunkSDPA", "budget", self.budget, meaning="q_len * heads per subcall")

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        rule = Rule("head-chunk", "sdpa", _match(self.budget), _rewrite, lambda plan: (plan.message, plan.figures))
        decline_quantized(graph, remarks, NOT_CARRIED.format(self.name))
        return bool(apply_rules(graph, [rule], remarks, decline_all=self.disabled()))


__all__ = ["ENV_VAR", "HeadChunkSDPA", "head_chunk_plan", "head_chunks"]
