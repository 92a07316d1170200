"""The pass manager: runs a flat list of passes and enforces the pass contract.

Driver order (the one place this is written down):

- **Passes run in list order.** Each pass sees the *whole* graph and decides
  for itself how to walk it (a pass's own docstring says whether it goes
  top-down or bottom-up); the manager never interleaves two passes on one node.
- **One pass at a time, on a private copy.** The caller's graph is verified
  once and never mutated. Each pass rewrites a fresh ``graph.copy()`` of the
  previous pass's result; the copy is kept only when the pass returns normally
  and the verifier accepts it. Any failure raises :class:`PassError` naming the
  pass and the passes that ran before it, and nothing partial is returned.
- **``changed`` is checked.** After each pass the copy is compared structurally
  (``Graph.__eq__``) with the graph the pass started from; a pass whose
  returned flag disagrees, in either direction, is a :class:`PassError`.
- **Fixed point = repeat the whole pipeline.** With ``fixed_point=True`` the
  full list runs again until one complete iteration changes nothing, at most
  ``max_iterations`` times. If the last allowed iteration still changed the
  graph, the manager stops and records an ``analysis`` remark saying the
  pipeline did not converge; it never loops unboundedly.
- **Instrumentation** hooks (:mod:`attnpass.passes.infra.instrument`) are called
  before and after every pass run, in the order given.
- **Crash reproducers.** With ``reproducer_dir`` set, a failing pass also
  writes the graph it received and itself (:mod:`attnpass.passes.infra.reproducer`)
  there; the PassError message ends with the file and the command replaying it.
  ``plugin_loads`` names the modules (``--load`` specs) defining plugin passes,
  which the reproducer records and its replay command loads again.
"""

from __future__ import annotations

import os
import time
from typing import Iterable, Sequence

from attnpass.ir import Graph, ImportedGraph, VerifyError, require_int
from attnpass.ir.core.arguments import argument_error, require_bool

from .base import Pass, PassError, PassResult, Remark, Remarks
from .instrument import Instrumentation
from .pipeline_text import pipeline_passes
from .reproducer import crash_note

MANAGER_NAME = "pass_manager"


class PassManager:
    """Runs ``passes`` in order over a copy of a graph; see the module docstring for the order.

    ``passes`` is a pipeline as :func:`~attnpass.passes.parse_pipeline` takes it: text, or pass names and Pass
    objects."""

    def __init__(
        self,
        passes: str | Iterable[str | Pass],
        *,
        fixed_point: bool = False,
        max_iterations: int = 8,
        instrumentations: Sequence[Instrumentation] = (),
        reproducer_dir: str | os.PathLike | None = None,
        plugin_loads: Sequence[str] = (),
    ) -> None:
        self.passes: tuple[Pass, ...] = tuple(pipeline_passes(passes, "PassManager"))
        require_int("PassManager", "max_iterations", max_iterations)
        require_bool("PassManager", "fixed_point", fixed_point)
        self.fixed_point = fixed_point
        self.max_iterations = max_iterations
        self.instrumentations: tuple[Instrumentation, ...] = tuple(instrumentations)
        self.reproducer_dir = reproducer_dir
        self.plugin_loads: tuple[str, ...] = tuple(plugin_loads)  # the modules defining plugin passes, for replays

    def __repr__(self) -> str:
        names = ", ".join(p.name for p in self.passes)
        fp = f", fixed_point=True, max_iterations={self.max_iterations}" if self.fixed_point else ""
        return f"PassManager([{names}]{fp})"

    def run(self, graph: Graph | ImportedGraph) -> PassResult:
        """Verify ``graph``, run the pipeline on copies and return the result; ``graph`` is untouched. An
        ImportedGraph (``from_mlx``, ``from_jax``) is its ``.graph``, as ``lower`` takes it.

        Raises VerifyError when ``graph`` itself is invalid, PassError when a pass fails, ArgumentError when
        ``graph`` is neither.
        """
        if isinstance(graph, ImportedGraph):
            graph = graph.graph
        elif not isinstance(graph, Graph):
            valid = "a Graph or an ImportedGraph (from_mlx, from_jax)"
            hint = "read a saved graph first: Graph.from_json(text) or ImportedGraph.load(path)"
            raise argument_error("PassManager.run", "graph", graph, valid, hint if isinstance(graph, str) else "")
        graph.verify()
        current = graph  # never mutated: every pass runs on a copy of it
        remarks: list[Remark] = []
        history: list[str] = []
        any_changed = False
        iterations = self.max_iterations if self.fixed_point else 1
        for iteration in range(1, iterations + 1):
            iteration_changed = False
            for pass_ in self.passes:
                try:
                    current, changed = self._run_one(pass_, current, history, remarks, iteration)
                except PassError as exc:
                    if self.reproducer_dir is None:
                        raise
                    note = crash_note(self.reproducer_dir, pass_, current, history, str(exc), self.plugin_loads)
                    raise PassError(f"{exc}\n{note}") from exc
                history.append(pass_.name)
                iteration_changed |= changed
            any_changed |= iteration_changed
            if not iteration_changed:
                break
        else:
            if self.fixed_point and iteration_changed:
                remarks.append(
                    Remark(
                        MANAGER_NAME,
                        "analysis",
                        None,
                        "not_converged",
                        f"fixed point not reached: the pipeline still changed the graph after "
                        f"{self.max_iterations} iterations (max_iterations); stopped there",
                        data={"max_iterations": self.max_iterations},
                    )
                )
        result = current if current is not graph else graph.copy()  # never hand back the caller's object
        return PassResult(result, any_changed, tuple(remarks))

    def _run_one(
        self, pass_: Pass, before: Graph, history: list[str], remarks: list[Remark], iteration: int
    ) -> tuple[Graph, bool]:
        """Run one pass on a copy of ``before``; returns (new graph, changed) or raises PassError."""
        where = self._describe(pass_, history, iteration)
        work = before.copy()
        sink = Remarks(pass_.name)
        for inst in self.instrumentations:
            inst.before_pass(pass_, work)
        start = time.perf_counter()
        try:
            flag = pass_.run(work, sink)
        except Exception as exc:
            raise PassError(f"{where}: {type(exc).__name__}: {exc}") from exc
        seconds = time.perf_counter() - start
        if not isinstance(flag, bool):
            raise PassError(f"{where}: run() must return a bool 'changed' flag, got {flag!r}")
        try:
            work.verify()
        except VerifyError as exc:
            raise PassError(f"{where}: it produced an invalid graph:\n{exc}") from exc
        actual = work != before
        if flag != actual:
            truth = "changed the graph" if actual else "left the graph unchanged"
            raise PassError(f"{where}: it reported changed={flag} but {truth}")
        remarks.extend(sink.items)
        for inst in self.instrumentations:
            inst.after_pass(pass_, work, actual, seconds)
        return work, actual

    def _describe(self, pass_: Pass, history: list[str], iteration: int) -> str:
        after = ", ".join(history) if history else "none"
        it = f", iteration {iteration}" if self.fixed_point else ""
        return f"pass {pass_.name!r} failed (after: {after}{it})"
