"""The pass contract: named, frozen, parameterised rewrites that explain every decision.

A pass is a frozen dataclass with a class-level ``name`` and its options as
fields. ``run(graph, remarks)`` receives a private copy of a *valid* graph,
may rewrite it in place, must leave it valid, records one :class:`Remark` per
decision (applied or declined, with the reason) and returns ``True`` exactly
when it changed the graph. The :class:`~attnpass.passes.PassManager` enforces
all of this: it verifies after every pass, discards the copy when a pass
raises, and rejects a pass whose ``changed`` flag is wrong.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from attnpass.ir import AttnpassError, Graph, SourceLoc

RemarkKind = Literal["applied", "declined", "analysis"]


class PassError(AttnpassError):
    """A pass raised, produced an invalid graph, or misreported ``changed``."""


@dataclass(frozen=True)
class Remark:
    """One pass decision, MLIR-style: which pass, applied or declined, on which node, and why."""

    pass_name: str
    kind: RemarkKind
    node: str | None
    message: str
    loc: SourceLoc | None = None
    rule: str | None = None  # the rewrite rule that decided (apply_rules), when the pass has rules

    def __str__(self) -> str:
        where = f" {self.node}" if self.node else ""
        at = f" ({self.loc})" if self.loc else ""
        return f"[{self.pass_name}] {self.kind}{where}: {self.message}{at}"


@dataclass
class Remarks:
    """The remark sink a pass writes to; bound to the pass's name."""

    pass_name: str
    items: list[Remark] = field(default_factory=list)

    def applied(self, node: str | None, message: str, loc: SourceLoc | None = None, rule: str | None = None) -> None:
        """Record a rewrite this pass made at ``node``, and why it was valid."""
        self.items.append(Remark(self.pass_name, "applied", node, message, loc, rule))

    def declined(self, node: str | None, message: str, loc: SourceLoc | None = None, rule: str | None = None) -> None:
        """Record a rewrite this pass did not make at ``node``, and the precondition that failed."""
        self.items.append(Remark(self.pass_name, "declined", node, message, loc, rule))

    def analysis(self, node: str | None, message: str, loc: SourceLoc | None = None, rule: str | None = None) -> None:
        """Record a finding that is neither a rewrite nor a refusal (counts, statistics)."""
        self.items.append(Remark(self.pass_name, "analysis", node, message, loc, rule))


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


def require_int(owner: str, option: str, value: object, *, minimum: int = 1, meaning: str = "") -> None:
    """Raise ValueError unless ``value`` is an int (a bool is not) ``>= minimum``, naming ``owner`` and ``option``.

    ``require_int("SplitKV", "shards", 1, minimum=2)``: ``SplitKV: shards must be an int >= 2, got 1``;
    ``meaning`` is added in parentheses after the bound.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        note = f" ({meaning})" if meaning else ""
        raise ValueError(f"{owner}: {option} must be an int >= {minimum}{note}, got {value!r}")


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
