"""The pass contract: named, frozen, parameterised rewrites that explain every decision.

A pass is a frozen dataclass with a class-level ``name`` and its options as
fields. ``run(graph, remarks)`` receives a private copy of a *valid* graph,
may rewrite it in place, must leave it valid, records one :class:`Remark` per
decision (applied or declined, with a reason code from :data:`REASONS` and the words) and
returns ``True`` exactly when it changed the graph. The :class:`~attnpass.passes.PassManager` enforces
all of this: it verifies after every pass, discards the copy when a pass
raises, and rejects a pass whose ``changed`` flag is wrong.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Mapping, Union

from attnpass.ir import AttnpassError, Graph, SourceLoc
from attnpass.ir.core.arguments import require_int  # noqa: F401 (re-exported: the passes' option check)

RemarkKind = Literal["applied", "declined", "analysis"]
Figure = Union[int, float, str, bool, None, tuple["Figure", ...]]
Figures = Mapping[str, Figure]  # a remark's figures by name: what its message interpolates


class PassError(AttnpassError):
    """A pass raised, produced an invalid graph, or misreported ``changed``."""


# Every reason code the built-in passes give, with its meaning: the one table of why a pass did or did not
# rewrite (tests/passes/infra/test_remark_reasons.py checks that the passes give no other code and use every one).
# A remark's message adds the numbers and names in words, its ``data`` the same figures by name; its ``reason``
# and ``data`` are what tools and tests compare.
REASONS: dict[str, str] = {
    # outcomes every pass can have
    "applied": "the rewrite was made; the message says what it did and why that is valid",
    "analysis": "a finding that is neither a rewrite nor a refusal",
    "rule_hits": "analysis: apply_rules' hits per rule and the number of declined candidates",
    "not_converged": "analysis: the pass manager's fixed point was not reached within max_iterations",
    "sharding_propagated": "analysis: values that inherited the sharding of what they read",
    "no_candidates": "nothing in the graph for the pass to look at (no anchor op, no dead value)",
    "disabled": "the pass is switched off (enabled=False or its environment variable)",
    "already_done": "the node is already in the form the pass produces",
    # what a rewrite does not carry or would not pay for
    "unsupported_variant": "sdpa has a variant (causal, window, sinks, soft-cap) the rewritten form does not carry",
    "fused_kernel_serves": "the target's fused attention kernel already serves this call",
    "too_many_rows": "more query rows than the pass's bound (prefill-shaped)",
    "too_few_rows": "too few query rows for the rewrite to split them",
    "little_gain": "the rewrite would save too little (FLOP ratio, cache depth)",
    "no_structured_mask": "no causal kind says which keys are hidden",
    "rows_without_keys": "a row that attends no key would compute a different value after the rewrite",
    "not_divisible": "a size is not divisible by the number of shards, devices or the block ratio",
    "shape_mismatch": "operand shapes or sizes disagree with what the rewrite needs",
    "quantized_operands": "the pass does not carry quantized K/V (packed words, scales and biases)",
    # masks
    "mask_layout": "the mask does not broadcast onto the scores as sdpa's [..., S, T] mask",
    "mask_form": "the mask is not written as sdpa masks (inverted, or its fill is not a constant)",
    "mask_not_static": "the mask's values are not known from positions alone",
    "mask_not_structured": "the mask is not exactly a causal kind and window (bool, or additive 0 and -inf)",
    "mask_not_selection": "the mask is not a selection: qsa_mask, put_along_axis of token indices, or where(either, "
    "values, fill)",
    # quantized sparse attention, gathers and sharding
    "qsa_form": "the QSA selection, pooling or positions are not in the form the rewrite reads",
    "other_readers": "a value the rewrite replaces is also read elsewhere",
    "not_row_wise": "an op between the raw and the block keys is not row-wise",
    "gather_form": "K or V are not gathered by qsa_gather of the same cells",
    "indices_not_distinct": "a token selection's indices are neither proven nor promised distinct per row",
    "ties_unbounded": "a value-cutoff selection keeps every tie at the cutoff: more than K cells per row",
    "missing_tie_term": "a value-cutoff selection has no term for the ties at the cutoff: not top_k's K cells",
    "scan_axis": "a rank (cumulative sum) runs along another axis than the keys",
    "k_mismatch": "the K of top_k, of the rank bound and of the room left for ties differ",
    "cutoff_form": "the cutoff is not the K-th top_k value of the compared scores, or the terms are not its ranks",
    "mask_not_implied": "the mask is not proven false wherever the selection is (cell by cell along the keys)",
    # multi-head latent attention
    "not_latent": "K and V are not per-head up-projections (matmul) of one shared latent",
    "sharding_conflict": "the values are already sharded otherwise, or two mesh axes claim one dimension",
    "sharding_blocked": "an op on K's or V's path cannot carry the sharding back to the bytes",
    "mesh_axis_missing": "the named mesh axis is not declared on the graph",
    "not_head_chunked": "the concatenated sdpa calls are not one head-chunked attention",
    # proving attention and softmax
    "not_attention": "the softmax input is not q·kᵀ through steps sdpa has",
    "not_softmax": "exp / sum is not the softmax of one value along one axis",
    "probabilities_changed": "an op changes the probabilities between the softmax and P·V",
    "not_float": "a root of q, k or v is not a float tensor",
    "uneven_reshape": "a reshape mixes axes unevenly, so coordinates cannot be followed",
    "axes_mismatch": "the contractions, head pairing or softmax axis are not sdpa's",
    "inexact": "the rewrite would round differently or change which scores are masked",
    "softcap_form": "the soft-cap is not the last step before the mask, once",
    "bad_scale": "the scale is zero or not finite",
    "sinks_form": "the sink column is not one logit per query head",
    "normalizer_mismatch": "P·V of exp(s - m) is divided or weighed by something other than the sum of the same exps "
    "over the keys (deferred normalisation), or partial attentions by other than their log-sum-exp weights",
    "combine_mismatch": "the partial attentions of a log-sum-exp combine differ in queries, scale, soft-cap, dtype, "
    "heads or mask fills, or one does not subtract its row max",
    "keys_overlap": "two partial attentions of a combine read keys that are not provably disjoint",
    # constant folding
    "no_evaluator": "the op has no reference evaluator, or evaluating it fails",
    "target_defined": "the targets compute the op their own way, so folding would change the last bits",
    "too_large": "folding would store too many values",
    # narrowing inputs
    "interface": "the input is a graph output or state: its type is part of the interface",
    "unused": "the input is never read",
    "read_whole": "the input is read whole somewhere",
    "slices_differ": "the input's slices differ in bounds",
}
_CODE = re.compile(r"[a-z][a-z0-9_]*\Z")


@dataclass(frozen=True)
class Remark:
    """One pass decision, MLIR-style: which pass and rule, applied or declined, on which node, the reason code
    (a key of :data:`REASONS` for the built-in passes), the message with the numbers and names, and ``data``,
    the figures the message states (rows, heads, bytes, bounds, ...) by snake_case name: JSON scalars or
    tuples of them, so tools read the numbers without parsing the words."""

    pass_name: str
    kind: RemarkKind
    node: str | None
    reason: str
    message: str
    loc: SourceLoc | None = None
    rule: str | None = None  # the rewrite rule that decided (apply_rules), when the pass has rules
    data: Figures = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not _CODE.match(self.reason):
            raise ValueError(f"Remark of {self.pass_name}: reason must be a snake_case code, got {self.reason!r}")
        object.__setattr__(self, "data", {k: _figure(self, k, v) for k, v in self.data.items()})

    def __str__(self) -> str:
        """``[pass] kind node (rule, reason): message (loc)``; the rule when it is not the pass, the reason
        when it is not the kind."""
        tags = [t for t in (self.rule, self.reason) if t not in (None, self.pass_name, self.kind)]
        where = f" {self.node}" if self.node else ""
        tag = f" ({', '.join(tags)})" if tags else ""
        at = f" ({self.loc})" if self.loc else ""
        return f"[{self.pass_name}] {self.kind}{where}{tag}: {self.message}{at}"


def _figure(remark: Remark, key: str, value: object) -> Figure:
    """``value`` as a figure (lists become tuples); a ValueError for a name or value that is not one."""
    if not _CODE.match(key):
        raise ValueError(f"Remark of {remark.pass_name}: data names must be snake_case, got {key!r}")
    if isinstance(value, (list, tuple)):
        return tuple(_figure(remark, key, v) for v in value)
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    raise ValueError(f"Remark of {remark.pass_name}: data {key!r} is {type(value).__name__}, not a JSON scalar")


@dataclass
class Remarks:
    """The remark sink a pass writes to; bound to the pass's name."""

    pass_name: str
    items: list[Remark] = field(default_factory=list)

    def applied(
        self, node: str | None, message: str, loc: SourceLoc | None = None, rule: str | None = None,
        *, reason: str = "applied", data: Figures | None = None,
    ) -> None:  # fmt: skip
        """Record a rewrite this pass made at ``node``, and why it was valid (``data``: its figures)."""
        self.items.append(Remark(self.pass_name, "applied", node, reason, message, loc, rule, dict(data or {})))

    def declined(
        self, node: str | None, message: str, loc: SourceLoc | None = None, rule: str | None = None,
        *, reason: str, data: Figures | None = None,
    ) -> None:  # fmt: skip
        """Record a rewrite this pass did not make at ``node``: the failed precondition's code, words and figures."""
        self.items.append(Remark(self.pass_name, "declined", node, reason, message, loc, rule, dict(data or {})))

    def analysis(
        self, node: str | None, message: str, loc: SourceLoc | None = None, rule: str | None = None,
        *, reason: str = "analysis", data: Figures | None = None,
    ) -> None:  # fmt: skip
        """Record a finding that is neither a rewrite nor a refusal (counts, statistics)."""
        self.items.append(Remark(self.pass_name, "analysis", node, reason, message, loc, rule, dict(data or {})))


@dataclass(frozen=True)
class Pass(abc.ABC):
    """Base class of passes: valid IR in, valid IR out. Subclass as a frozen dataclass."""

    name: ClassVar[str] = "pass"

    @abc.abstractmethod
    def run(self, graph: Graph, remarks: Remarks) -> bool:
        """Rewrite ``graph`` in place; return True exactly when it changed."""

    def __call__(self, graph: Graph) -> "PassResult":
        """Run this pass alone through a PassManager (the input graph is not mutated)."""
        from .manager import PassManager

        return PassManager([self]).run(graph)


@dataclass(frozen=True)
class PassResult:
    """What a pipeline produced: the new graph, whether anything changed, and every remark."""

    graph: Graph
    changed: bool
    remarks: tuple[Remark, ...]

    def applied(self) -> list[Remark]:
        return [r for r in self.remarks if r.kind == "applied"]

    def declined(self) -> list[Remark]:
        return [r for r in self.remarks if r.kind == "declined"]
