"""The scores of an attention, from the q·kᵀ matmul to the softmax, as algebra sdpa can or cannot express.

``sdpa`` computes ``softmax(q·kᵀ·scale + mask)``: one scale, then one mask. A source may interleave layout ops,
float casts, scalar scales, additive and bool masks and a soft-cap in any order. :func:`score_steps` reads them
off; :func:`score_algebra` decides what moves where, exactly: a scale before a mask is sdpa's scale; one after an
additive mask moves onto it only for a power of two; a bool mask's fill must stay a mask after the scales that
follow; several bool masks combine with ``logical_and``, a bool and an additive one with ``where``; two additive
masks, and anything else inexact, are declined.

A finite fill is exactly a mask under one stated assumption (docs/semantics.md §1.2): every row's highest
unmasked score is at least ``-SCORE_BOUND`` (2^24), so a fill at most ``-(SCORE_BOUND + 1024)`` weighs exactly
nothing. In full: docs/passes.md, "Score algebra".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from attnpass.ir import DType, Graph, Node
from attnpass.ir.dialects.evaluate import rounded

from ..infra.rewrite import Decline
from .chains import is_transparent, scalar_constant, scale_operand

SCORE_BOUND = 2.0**24  # assumed: every row's highest unmasked score (softmax input) is >= -SCORE_BOUND
UNDERFLOW = 1024.0  # exp(-1024) is 0 in float64 (below 2^-1075, half its smallest subnormal) and narrower formats

NOT_SDPA = {  # ops on the scores path that sdpa cannot express, with what families use them for
    "tanh": "logit soft-capping (tanh(s / cap) * cap, as gemma2)",
    "concat": "extra score columns (attention sinks, as gpt_oss and MLX's sinks=)",
}


@dataclass(frozen=True)
class Step:
    """One op between q·kᵀ and the softmax: ``kind`` is layout, cast, scale, softcap, add or where.

    A ``softcap`` step is ``tanh(scores / c) · c``, the outer mul its ``node``, ``factor`` the cap ``c``.
    ``scores`` is the operand carrying the scores; ``mask`` the other operand of an add (additive
    mask, ``factor`` -1 for a ``sub``) or the condition of a where (``fill`` its constant fill).
    """

    node: Node
    kind: str
    scores: str
    factor: float = 1.0
    mask: str | None = None
    fill: float | None = None


@dataclass(frozen=True)
class MaskUse:
    """A mask as sdpa takes it: the step that applies it and the factor the source scales it by later;
    for a bool mask, ``fill`` is the value its masked entries reach the softmax with (rounded as the source does)."""

    step: Step
    factor: float
    fill: float | None = None


@dataclass(frozen=True)
class ScoreAlgebra:
    scale: float
    additive: MaskUse | None
    bools: tuple[MaskUse, ...]
    softcap: float | None = None


class _ScorePath:
    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.memo: dict[str, bool] = {}

    def reaches_matmul(self, value: str, depth: int = 0) -> bool:
        """Does ``value`` come from a matmul through the ops a scores path may hold?"""
        if value in self.memo:
            return self.memo[value]
        node = self.g.node(value)
        while is_transparent(self.g, node) or node.op == "tanh" or scale_operand(self.g, node) is not None:
            scaled = scale_operand(self.g, node)
            node = self.g.node(node.inputs[0] if scaled is None else scaled[0])
        if node.op == "matmul":
            found = True
        elif depth > 8 or node.op not in ("add", "sub", "where"):
            found = False
        else:
            sides = (node.x, node.y)  # add, sub, where: where's condition is not a side
            found = any(self.reaches_matmul(i, depth + 1) for i in sides)
        self.memo[value] = found
        return found

    def step(self, node: Node) -> Step | Decline:
        g = self.g
        if is_transparent(g, node):
            return Step(node, "cast" if node.op == "cast" else "layout", node.inputs[0])
        capped = _softcap(g, node)
        if capped is not None:
            return capped
        scaled = scale_operand(g, node)
        if scaled is not None:
            return Step(node, "scale", scaled[0], factor=scaled[1])
        if node.op in ("add", "sub"):
            sides = [i for i in (0, 1) if self.reaches_matmul(node.inputs[i])]
            if node.op == "sub" and sides == [1]:
                return Decline(
                    "mask_form",
                    f"sub {node.name} subtracts the scores from {node.inputs[0]}; sdpa adds a mask to them",
                    node.name,
                )
            if sides:
                i = (
                    next((i for i in sides if g.node(node.inputs[i]).type == node.type), sides[0])
                    if node.op == "add"
                    else 0
                )
                return Step(
                    node, "add", node.inputs[i], factor=-1.0 if node.op == "sub" else 1.0, mask=node.inputs[1 - i]
                )
        if node.op == "where":
            if not self.reaches_matmul(node.x):
                if self.reaches_matmul(node.y):
                    return Decline(
                        "mask_form",
                        f"where {node.name} keeps the scores where {node.cond} is False; "
                        "sdpa's bool mask keeps them where it is True",
                        node.name,
                    )
            else:
                fill = scalar_constant(g, node.y)
                if fill is None:
                    return Decline(
                        "mask_form",
                        f"where {node.name} fills masked scores with {node.y}, not a constant",
                        node.name,
                    )
                return Step(node, "where", node.x, mask=node.cond, fill=fill)
        if node.op in ("add", "sub", "where"):
            return Decline(
                "not_attention",
                f"the softmax input does not come from a q·kᵀ matmul (it reaches {node.op} {node.name})",
                node.name,
            )
        what = NOT_SDPA.get(node.op, "a step sdpa does not have")
        return Decline(
            "not_attention",
            f"the scores pass through {node.op} {node.name} before the softmax: {what}; "
            "sdpa computes softmax(q·kᵀ·scale + mask)",
            node.name,
        )


def _softcap(graph: Graph, node: Node) -> Step | None:
    """``tanh(s / c) · c`` (or ``tanh(s · (1/c)) · c``) ending at ``node``: a softcap step with cap ``c``."""
    outer = scale_operand(graph, node)
    if outer is None or graph.node(outer[0]).op != "tanh" or outer[1] <= 0:
        return None
    inner = scale_operand(graph, graph.node(graph.node(outer[0]).inputs[0]))
    if inner is None or not math.isclose(inner[1] * outer[1], 1.0, rel_tol=1e-12):
        return None
    return Step(node, "softcap", inner[0], factor=outer[1])


def score_steps(graph: Graph, value: str) -> tuple[list[Step], Node] | Decline:
    """The steps from the q·kᵀ matmul (first) to ``value`` (the softmax input), and the matmul."""
    path = _ScorePath(graph)
    steps: list[Step] = []
    node = graph.node(value)
    while node.op != "matmul":
        step = path.step(node)
        if isinstance(step, Decline):
            return step
        steps.append(step)
        node = graph.node(step.scores)
    return steps[::-1], node


def _power_of_two(c: float) -> bool:
    return c != 0 and math.isfinite(c) and math.frexp(abs(c))[0] == 0.5


def fill_limit(dtype: DType) -> float:
    """How far below zero a finite fill must reach the softmax to be exactly a mask (module docstring)."""
    return min(SCORE_BOUND + UNDERFLOW, 0.5 * float(dtype.finfo.max))


def _limit_reason(dtype: DType) -> str:
    if fill_limit(dtype) < SCORE_BOUND + UNDERFLOW:
        return f"half the {dtype.value} max: unmasked scores are assumed above {fill_limit(dtype) - UNDERFLOW:g}"
    return (
        f"exp(fill - row max) is then exactly 0 if every row's highest unmasked score is >= -{SCORE_BOUND:.3g}, "
        "the bound raise-attention assumes"
    )


def _fill_at_softmax(graph: Graph, fill: float, dtype: DType, later: list[Step]) -> tuple[float, DType]:
    """The fill as the source carries it to the softmax (each later scale and cast rounded in its dtype), and
    the dtype on the way with the smallest :func:`fill_limit` (float16 scores cast up stay float16 values)."""
    value, narrowest = fill, dtype
    for step in later:
        dtype = step.node.type.dtype
        if step.kind == "scale":
            node = step.node
            divisor = scalar_constant(graph, node.inputs[1]) if node.op == "div" else None
            value = value / divisor if divisor is not None else value * step.factor
        if step.kind in ("scale", "cast"):
            with np.errstate(over="ignore"):  # past the dtype's max: -inf, as the source computes it
                value = float(rounded(value, dtype))
            narrowest = min(narrowest, dtype, key=fill_limit) if dtype.is_float else narrowest
    return value, narrowest


def score_algebra(graph: Graph, steps: list[Step]) -> ScoreAlgebra | Decline:
    """sdpa's scale and masks for ``steps`` (matmul side first), or the step that cannot move."""
    caps = [i for i, s in enumerate(steps) if s.kind == "softcap"]
    for i in caps:
        step = steps[i]
        if len(caps) > 1:
            return Decline(
                "softcap_form",
                f"two soft-caps reach the scores ({steps[caps[1]].node.name}); sdpa has one",
                step.node.name,
            )
        after = next((s for s in steps[i + 1 :] if s.kind == "scale"), None)
        if after is not None:
            return Decline(
                "softcap_form",
                f"the soft-capped scores ({step.node.name}, cap {step.factor:g}) are scaled by {after.factor:g} "
                f"after the cap ({after.node.name}); sdpa caps the scaled scores last",
                after.node.name,
            )
        before = next((s for s in steps[:i] if s.kind in ("add", "where")), None)
        if before is not None:
            return Decline(
                "softcap_form",
                f"mask step {before.node.name} comes before the soft-cap {step.node.name}; sdpa caps, then masks",
                before.node.name,
            )
    later = [1.0] * (len(steps) + 1)  # later[i]: product of the scales after step i
    for i in range(len(steps) - 1, -1, -1):
        later[i] = later[i + 1] * (steps[i].factor if steps[i].kind == "scale" else 1.0)
    adds = [MaskUse(s, s.factor * later[i + 1]) for i, s in enumerate(steps) if s.kind == "add"]
    wheres = [(i, MaskUse(s, later[i + 1])) for i, s in enumerate(steps) if s.kind == "where"]
    if len(adds) > 1:
        names = ", ".join(u.step.mask for u in adds)
        return Decline(
            "inexact",
            f"additive masks {names} all reach the scores; sdpa takes one, and their sum would round",
            adds[1].step.node.name,
        )
    for use in adds:
        if use.factor not in (1.0, -1.0) and not _power_of_two(use.factor):
            return Decline(
                "inexact",
                f"mask {use.step.mask} is added before the scores are scaled by {use.factor:g} "
                f"(softmax((q·kᵀ + m)·{use.factor:g})); sdpa adds its mask after scaling, and m·{use.factor:g} "
                "is not exact (not a power of two)", use.step.node.name,
            )  # fmt: skip
    masks = []
    for i, use in wheres:
        node, fill, factor = use.step.node, use.step.fill, use.factor
        if factor < 0:
            return Decline(
                "inexact",
                f"the scores masked by where {node.name} are scaled by {factor:g} after it: "
                f"the fill {fill:g} no longer masks",
                node.name,
            )
        reached, dtype = _fill_at_softmax(graph, fill, node.type.dtype, steps[i + 1 :])
        limit = fill_limit(dtype)
        if math.isnan(reached) or reached > -limit:
            return Decline(
                "inexact",
                f"where {node.name} fills masked scores with {fill:g}"
                + (f", which reaches the softmax as {reached:g}" if reached != fill and not math.isnan(fill) else "")
                + f"; a fill is exactly a mask only if it is -inf or <= {-limit:.3g} ({_limit_reason(dtype)})",
                node.name,
            )  # fmt: skip
        if math.isfinite(reached) and any(u.step.node.name in {s.node.name for s in steps[i + 1 :]} for u in adds):
            return Decline(
                "inexact",
                f"where {node.name} fills with the finite {fill:g} and a mask is added after it: "
                "the sum is no longer a fill",
                node.name,
            )
        if math.isfinite(reached) and adds:
            return Decline(
                "inexact",
                f"where {node.name} fills with the finite {fill:g} over scores with the additive mask "
                f"{adds[0].step.mask}: a row the bool mask leaves without a key is the mean of V in the source, "
                "but NaN under sdpa's one mask (where(bool, additive, -inf))",
                node.name,
            )
        masks.append(MaskUse(use.step, factor, reached))
    if len({repr(u.fill) for u in masks}) > 1:
        first, other = masks[0], next(u for u in masks if repr(u.fill) != repr(masks[0].fill))
        return Decline(
            "inexact",
            f"where {first.step.node.name} and where {other.step.node.name} fill with {first.fill:g} and "
            f"{other.fill:g} (at the softmax): a row both leave without a key weighs only the keys of the larger "
            "fill, where sdpa gives such a row the mean of V (or NaN)",
            other.step.node.name,
        )
    softcap = steps[caps[0]].factor if caps else None
    return ScoreAlgebra(later[0], adds[0] if adds else None, tuple(masks), softcap)


__all__ = [
    "NOT_SDPA", "SCORE_BOUND", "UNDERFLOW", "MaskUse", "ScoreAlgebra", "Step", "fill_limit", "score_algebra",
    "score_steps",
]  # fmt: skip
