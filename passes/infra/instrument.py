"""Pass instrumentation: hooks the PassManager calls around every pass run.

Hooks observe; they must not mutate the graph they are handed (it is the
manager's private copy, compared afterwards to decide ``changed``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Protocol, TextIO, runtime_checkable

from attnpass.ir import Graph

if TYPE_CHECKING:
    from .base import Pass


@runtime_checkable
class Instrumentation(Protocol):
    """Called by the PassManager before and after each pass. Subclass to inherit no-op defaults."""

    def before_pass(self, pass_: "Pass", graph: Graph) -> None:
        """``graph`` is the graph the pass is about to rewrite."""

    def after_pass(self, pass_: "Pass", graph: Graph, changed: bool, seconds: float) -> None:
        """``graph`` is the verified result; ``seconds`` is the pass's wall time (perf_counter)."""


class PrintAfterChange(Instrumentation):
    """Print ``// after <pass name>`` and the graph text after every pass that changed the graph."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout

    def after_pass(self, pass_: "Pass", graph: Graph, changed: bool, seconds: float) -> None:
        if changed:
            print(f"// after {pass_.name}\n{graph}", file=self.stream)


class PassTimings(Instrumentation):
    """Collect wall time and run counts per pass name; :meth:`table` renders them."""

    def __init__(self) -> None:
        self.runs: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    def after_pass(self, pass_: "Pass", graph: Graph, changed: bool, seconds: float) -> None:
        self.runs[pass_.name] = self.runs.get(pass_.name, 0) + 1
        self.seconds[pass_.name] = self.seconds.get(pass_.name, 0.0) + seconds

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def table(self) -> str:
        """An aligned text table: pass, runs, total ms, % of all pass time; a total row last."""
        total = self.total_seconds
        rows = [("pass", "runs", "total ms", "%")]
        for name, runs in self.runs.items():
            secs = self.seconds[name]
            pct = 100.0 * secs / total if total > 0 else 0.0
            rows.append((name, str(runs), f"{secs * 1e3:.3f}", f"{pct:.1f}"))
        rows.append(("total", str(sum(self.runs.values())), f"{total * 1e3:.3f}", "100.0" if total > 0 else "0.0"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            "  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]).rstrip() for r in rows
        ]
        return "\n".join(lines)


__all__ = ["Instrumentation", "PassTimings", "PrintAfterChange"]
