"""Raise decomposed attention (as MLX, JAX and hand-written code spell it) to ``softmax`` and ``sdpa``.

Rules on the shared layer (:mod:`attnpass.passes.infra.rewrite`; :data:`RULES` composes with ``+``), run after
the ``canonicalize`` rules in the same sweeps (``raise-attention{canonicalize=false}``: the raising rules alone):
``softmax`` (proven on coordinates, :mod:`.softmax_match`), ``attention`` (``softmax(q·kᵀ·scale + mask)·v ->
sdpa`` with GQA and any q/k/v layout, :mod:`.attention_match`, scores read as algebra by :mod:`.score_path`),
``quantized-attention`` (mlx-lm's quantized-cache attention -> ``quantized_sdpa``) and ``structured-mask`` (a bool
mask built from positions alone -> sdpa's ``causal`` and ``window``, proven on every pair), ``deferred-attention``
(``(exp(s - m)·v) / sum(exp(s - m))``, the division after P·V) and ``lse-combine`` (partial attentions over
disjoint keys combined by their log-sum-exps -> one sdpa over the concatenated keys), both read as algebra over
partial attentions (:mod:`.partial_attention`).

Contract: the raised ``sdpa`` computes the same real function as the source; where the two round differently the
applied remark says so (scales moved into sdpa's scale, float casts, finite fills that are exactly masks).
Sinks, soft-caps after a mask and what sdpa cannot express are declined with a remark naming it. One remark per
candidate and one ``analysis`` remark of per-rule hits. In full: docs/passes.md, "raise-attention".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from attnpass.ir import DType, Graph, Node

from ..analysis import layout_algebra as la
from ..analysis.attention_match import Attention, MaskPlan, Operand, lifted, match_attention
from ..analysis.chains import exact_cast
from ..analysis.mask_structure import match_structure, rewrite_structure
from ..analysis.partial_attention import (
    PartialAttention,
    feeds_combine,
    match_combine,
    match_deferred,
    unnormalized_product,
)
from ..analysis.quantized_attention import match_quantized_attention, rewrite_quantized_attention
from ..analysis.softmax_match import Softmax, match_softmax
from ..infra.base import Pass, Remarks
from ..infra.registry import register_pass
from ..infra.rewrite import ANY, Decline, Rewriter, Rule, apply_rules
from .canonicalize import canonicalize_rules

MAX_SWEEPS = 8


def _softmax_rewrite(rw: Rewriter, m: Softmax) -> None:
    out = rw.op("softmax", [m.x], {"axis": m.axis, "precise": m.precise}, f"{m.div.name}_softmax")
    rw.replace_matched(rw.cast(out, m.div.type.dtype, f"{m.div.name}_softmax"), prune=True)


def _attention_match(graph: Graph, node: Node) -> Attention | Decline | None:
    """A matmul with a softmax (through layout ops and casts, or a few ops that change it) on a side, proven an sdpa;
    P·V of exps with no softmax is declined here when no deferred normalisation or combine raises it."""
    found = match_attention(graph, node)
    if found is None:
        return unnormalized_product(graph, node)
    return None if isinstance(found, Attention) and feeds_combine(graph, node) else found  # the combine's part


def _operand(rw: Rewriter, x: Operand, dtype: DType, hint: str) -> str:
    value = rw.transpose(rw.reshape(x.root, x.shape4, hint), x.perm, hint)
    for op, arg in x.steps:
        value = (
            rw.cast(value, arg, hint)
            if op == "cast"
            else rw.op(op, [value, rw.scalar(arg, rw.type(value).dtype, f"{hint}_scale")], hint=hint)
        )
    return rw.cast(value, dtype, hint)


def _broadcastable(rw: Rewriter, root: str, shape4: tuple[int, ...], hint: str) -> str:
    """``root`` as it broadcasts to [B, Hq, S, T] (reshaped only when left-padding with 1s is not enough)."""
    return root if lifted(rw.type(root).shape) == shape4 else rw.reshape(root, shape4, hint)


def _mask(rw: Rewriter, plan: MaskPlan, dtype: DType, hint: str) -> str | None:
    """sdpa's one mask: the bool masks and-ed, the additive one scaled; both: ``where(bool, additive, -inf)``."""
    allowed = None
    for root, shape4 in plan.bools:
        value = _broadcastable(rw, root, shape4, hint)
        allowed = value if allowed is None else rw.op("logical_and", [allowed, value], hint=hint)
    if plan.additive is None:
        if allowed is None or not plan.nan_rows:
            return allowed  # sdpa's bool mask: a row with no key is the mean of V, as with a finite fill
        fills = [rw.scalar(0.0, dtype, f"{hint}_zero"), rw.scalar(-math.inf, dtype, f"{hint}_fill")]
        return rw.op("where", [allowed, *fills], hint=hint)  # a -inf fill keeps such a row NaN, as in the source
    root, shape4, factor = plan.additive
    bias = _broadcastable(rw, root, shape4, hint)
    if factor != 1:
        bias = rw.op("mul", [bias, rw.scalar(factor, rw.type(bias).dtype, f"{hint}_factor")], hint=hint)
    if not exact_cast(rw.type(bias).dtype, dtype):  # a half-float mask with float32 q is promoted by sdpa itself
        bias = rw.cast(bias, dtype, hint)
    if allowed is None:
        return bias
    return rw.op("where", [allowed, bias, rw.scalar(float("-inf"), rw.type(bias).dtype, f"{hint}_fill")], hint=hint)


def _sinks(rw: Rewriter, m: Attention, hq: int, hint: str) -> str | None:
    """sdpa's ``[Hq]`` sinks from the matched sink column (a splat: one value for every head), in a dtype
    sdpa takes (q's, or any float with float32 q)."""
    if m.sinks is None:
        return None
    if isinstance(m.sinks, float):
        return rw.broadcast(rw.scalar(m.sinks, m.dtype, hint), (hq,), hint)
    root, shape4 = m.sinks
    sinks = rw.reshape(root, (shape4[1],), hint)
    if shape4[1] != hq:
        sinks = rw.broadcast(sinks, (hq,), hint)
    if rw.type(sinks).dtype is not m.dtype and m.dtype is not DType.float32:
        sinks = rw.cast(sinks, m.dtype, hint)
    return sinks


def _attention_rewrite(rw: Rewriter, m: Attention) -> None:
    name = m.pv.name
    operands = {role: _operand(rw, x, m.dtype, f"{name}_{role}") for role, x in zip("qkv", (m.q, m.k, m.v))}
    operands["mask"] = _mask(rw, m.mask, m.dtype, f"{name}_mask")
    operands["sinks"] = _sinks(rw, m, rw.type(operands["q"]).shape[1], f"{name}_sinks")
    attrs = {"scale": m.scale, "causal": "none", "logit_softcap": m.softcap}
    out = rw.op("sdpa", operands, attrs, f"{name}_sdpa")
    split, perm = la.view_plan(m.out_layout, rw.type(out).shape)  # [B, H, S, D] laid out as P·V was
    rw.replace_matched(rw.relayout(out, split, perm, m.pv.type.shape, f"{name}_out"), prune=True)


def _partial_rewrite(rw: Rewriter, m: PartialAttention) -> None:
    """One sdpa over the parts' keys (one part: the deferred normalisation), laid out as the root, in its dtype."""
    first, name = m.parts[0], m.root.name
    dtype = first.dtype
    q = _operand(rw, first.q, dtype, f"{name}_q")
    k = rw.concat([_operand(rw, a.k, dtype, f"{name}_k") for a in m.parts], 2, f"{name}_k")
    v = rw.concat([_operand(rw, a.v, dtype, f"{name}_v") for a in m.parts], 2, f"{name}_v")
    mask = _concat_masks(rw, m, dtype, f"{name}_mask") if m.combine else _mask(rw, m.masks[0], dtype, f"{name}_mask")
    attrs = {"scale": first.scale, "causal": "none", "logit_softcap": first.softcap}
    out = rw.op("sdpa", {"q": q, "k": k, "v": v, "mask": mask}, attrs, f"{name}_sdpa")
    split, perm = la.view_plan(m.out_layout, rw.type(out).shape)
    out = rw.cast(rw.relayout(out, split, perm, m.root.type.shape, f"{name}_out"), m.root.type.dtype, f"{name}_out")
    rw.replace_matched(out, prune=True)


def _concat_masks(rw: Rewriter, m: PartialAttention, dtype: DType, hint: str) -> str | None:
    """The parts' bool masks side by side along the keys (a part without one: all True); None when none has one."""
    if not any(plan.bools for plan in m.masks):
        return None
    pieces = []
    for plan, a in zip(m.masks, m.parts):
        piece = _mask(rw, plan, dtype, hint)
        if piece is None:
            piece = rw.broadcast(rw.scalar(True, DType.bool, f"{hint}_all"), (1, 1, 1, a.figures["kv_len"]), hint)
        pieces.append(rw.reshape(piece, lifted(rw.type(piece).shape), hint))
    lead = tuple(max(rw.type(p).shape[i] for p in pieces) for i in range(3))
    pieces = [rw.broadcast(p, (*lead, a.figures["kv_len"]), hint) for p, a in zip(pieces, m.parts)]
    return rw.concat(pieces, 3, hint)


RULES: list[Rule] = [
    Rule("softmax", "div", match_softmax, _softmax_rewrite,
         lambda m: (f"exp({m.x} - max) / sum -> softmax({m.x}, axis={m.axis}{', precise' if m.precise else ''}){m.rounding}",
                    {"x": m.x, "axis": m.axis, "precise": m.precise})),  # exp(x-max)/sum -> softmax
    Rule("attention", "matmul", _attention_match, _attention_rewrite,
         lambda m: (f"softmax(q·kᵀ·scale + mask)·v -> sdpa: {m.summary}", m.figures)),  # softmax(qk^T s + m) v -> sdpa
    Rule("deferred-attention", ANY, match_deferred, _partial_rewrite,
         lambda m: (m.summary, m.figures)),  # (exp(s - m) v) / sum(exp(s - m)) -> sdpa (at the div or mul)
    Rule("lse-combine", ANY, match_combine, _partial_rewrite,
         lambda m: (m.summary, m.figures)),  # sum_i exp(lse_i - lse) o_i -> sdpa over the parts' keys (its last step)
    Rule("quantized-attention", "quantized_matmul", match_quantized_attention, rewrite_quantized_attention,
         lambda m: (f"quantized_matmul·softmax·quantized_matmul -> quantized_sdpa: {m.summary}", m.figures)),
    Rule("structured-mask", "sdpa", match_structure, rewrite_structure,
         lambda m: (f"{m.message} -> sdpa's causal and window", m.figures)),  # sdpa(mask=positions) -> sdpa[causal, window]
]  # fmt: skip


@register_pass
@dataclass(frozen=True)
class RaiseAttention(Pass):
    """Raise decomposed softmax and attention to ``softmax`` and ``sdpa`` (see the module docstring)."""

    name: ClassVar[str] = "raise-attention"
    rules: tuple[Rule, ...] = tuple(RULES)
    canonicalize: bool = True

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        rules = (canonicalize_rules() if self.canonicalize else []) + list(self.rules)
        return bool(apply_rules(graph, rules, remarks, max_sweeps=MAX_SWEEPS))


__all__ = ["RULES", "RaiseAttention", "Rule"]
