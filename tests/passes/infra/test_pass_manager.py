"""PassManager contract: no mutation, verification, failure isolation, changed checks, fixed point, hooks."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import ClassVar

import pytest

from attnpass.ir import Graph, TensorSpec, TensorType, VerifyError, ops, trace
from attnpass.passes import (
    DeadCodeElimination,
    Instrumentation,
    Pass,
    PassError,
    PassManager,
    PassResult,
    PassTimings,
    PrintAfterChange,
    Remarks,
)
from attnpass.passes.infra.manager import MANAGER_NAME


def model(x, y):
    a = ops.exp(x)
    ops.relu(y)  # dead
    return a + 1.0


def make_graph() -> Graph:
    return trace(model, TensorSpec((2, 3)), TensorSpec((2, 3)))


def snapshot(g: Graph) -> tuple[Graph, str, str]:
    return g.copy(), str(g), g.fingerprint()


def assert_untouched(g: Graph, snap: tuple[Graph, str, str]) -> None:
    copy, text, fp = snap
    assert g == copy
    assert str(g) == text
    assert g.fingerprint() == fp
    g.verify()


# ----------------------------------------------------------------------------- helper passes


@dataclass(frozen=True)
class NoOp(Pass):
    name: ClassVar[str] = "noop"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        remarks.declined(None, "nothing to do", reason="no_candidates")
        return False


@dataclass(frozen=True)
class AppendDead(Pass):
    """Always changes the graph: appends one unused constant."""

    name: ClassVar[str] = "append_dead"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        n = graph.add_node("constant", [], {"value": (0.0,), "shape": (), "dtype": "float32"})
        remarks.applied(n, "appended a dead constant")
        return True


@dataclass(frozen=True)
class RemoveOneDead(Pass):
    """Removes at most one dead node per run, so a fixed point needs several iterations."""

    name: ClassVar[str] = "remove_one_dead"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        live = graph.ancestors(graph.outputs)
        dead = [n for n in graph.nodes() if n.name not in live and n.op != "input"]
        if not dead:
            return False
        graph.remove_node(dead[-1].name)
        return True


@dataclass(frozen=True)
class Corrupt(Pass):
    """Annotates the exp node with a wrong type: the verifier must catch it."""

    name: ClassVar[str] = "corrupt"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        node = graph.node("exp")
        graph.replace_node("exp", node.replace(type=TensorType((7,), node.type.dtype)))
        return True


@dataclass(frozen=True)
class MutateThenRaise(Pass):
    name: ClassVar[str] = "explode"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        graph.remove_node("relu")
        remarks.applied("relu", "half done")
        raise ValueError("boom")


@dataclass(frozen=True)
class ClaimsChange(Pass):
    name: ClassVar[str] = "claims_change"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        return True


@dataclass(frozen=True)
class HidesChange(Pass):
    name: ClassVar[str] = "hides_change"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        graph.remove_node("relu")
        return False


@dataclass(frozen=True)
class ReturnsNone(Pass):
    name: ClassVar[str] = "returns_none"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        return None  # type: ignore[return-value]


class Recorder(Instrumentation):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def before_pass(self, pass_: Pass, graph: Graph) -> None:
        self.events.append(("before", pass_.name, len(graph)))

    def after_pass(self, pass_: Pass, graph: Graph, changed: bool, seconds: float) -> None:
        assert seconds >= 0.0
        self.events.append(("after", pass_.name, len(graph), changed))


# ----------------------------------------------------------------------------- basics


def test_result_and_input_not_mutated():
    g = make_graph()
    snap = snapshot(g)
    result = PassManager([AppendDead(), DeadCodeElimination(), NoOp()]).run(g)
    assert isinstance(result, PassResult)
    assert_untouched(g, snap)
    assert result.graph is not g
    assert result.changed
    assert "relu" in g and "relu" not in result.graph
    assert result.graph.inputs == ("x",) and g.inputs == ("x", "y")
    result.graph.verify()
    # remarks arrive in pass order
    assert [r.pass_name for r in result.remarks] == ["append_dead", "dce", "dce", "noop"]


def test_no_change_pipeline_returns_equal_graph():
    g = make_graph()
    result = PassManager([NoOp(), NoOp()]).run(g)
    assert not result.changed
    assert result.graph == g and result.graph is not g
    assert [r.kind for r in result.remarks] == ["declined", "declined"]


def test_pass_call_runs_through_manager():
    g = make_graph()
    snap = snapshot(g)
    result = DeadCodeElimination()(g)
    assert result.changed and "relu" not in result.graph
    assert_untouched(g, snap)


def test_invalid_input_graph_is_rejected_before_any_pass():
    g = make_graph()
    node = g.node("exp")
    g.replace_node("exp", node.replace(type=TensorType((7,), node.type.dtype)))
    rec = Recorder()
    with pytest.raises(VerifyError, match="shape rule gives"):
        PassManager([NoOp()], instrumentations=[rec]).run(g)
    assert rec.events == []


def test_constructor_validates():
    with pytest.raises(TypeError):
        PassManager([object()])  # type: ignore[list-item]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError):
            PassManager([NoOp()], max_iterations=bad)  # type: ignore[arg-type]
    assert repr(PassManager([NoOp(), DeadCodeElimination()])) == "PassManager([noop, dce])"


# ----------------------------------------------------------------------------- failures


def test_verifier_runs_after_every_pass_and_names_history():
    g = make_graph()
    snap = snapshot(g)
    with pytest.raises(PassError) as info:
        PassManager([NoOp(), DeadCodeElimination(), Corrupt(), NoOp()]).run(g)
    msg = str(info.value)
    assert msg.startswith("pass 'corrupt' failed (after: noop, dce)")
    assert "invalid graph" in msg and "shape rule gives" in msg
    assert isinstance(info.value.__cause__, VerifyError)
    assert_untouched(g, snap)


def test_verifier_failure_of_first_pass():
    g = make_graph()
    with pytest.raises(PassError, match=r"^pass 'corrupt' failed \(after: none\)"):
        PassManager([Corrupt()]).run(g)


def test_exception_leaves_no_partial_result_and_is_chained():
    g = make_graph()
    snap = snapshot(g)
    rec = Recorder()
    with pytest.raises(PassError) as info:
        PassManager([AppendDead(), MutateThenRaise(), NoOp()], instrumentations=[rec]).run(g)
    err = info.value
    assert str(err) == "pass 'explode' failed (after: append_dead): ValueError: boom"
    assert isinstance(err.__cause__, ValueError) and str(err.__cause__) == "boom"
    assert_untouched(g, snap)
    assert "relu" in g
    # the failing pass never reached after_pass, and nothing ran after it
    assert [e[:2] for e in rec.events] == [("before", "append_dead"), ("after", "append_dead"), ("before", "explode")]


def test_claimed_change_without_change_is_rejected():
    g = make_graph()
    snap = snapshot(g)
    expected = r"pass 'claims_change' failed \(after: noop\): .*changed=True but left the graph unchanged"
    with pytest.raises(PassError, match=expected):
        PassManager([NoOp(), ClaimsChange()]).run(g)
    assert_untouched(g, snap)


def test_hidden_change_is_rejected():
    g = make_graph()
    snap = snapshot(g)
    with pytest.raises(PassError, match=r"changed=False but changed the graph"):
        PassManager([HidesChange()]).run(g)
    assert_untouched(g, snap)


def test_non_bool_flag_is_rejected():
    with pytest.raises(PassError, match="must return a bool"):
        PassManager([ReturnsNone()]).run(make_graph())


# ----------------------------------------------------------------------------- fixed point


def many_dead(x):
    y = x
    for _ in range(3):
        ops.exp(y)  # three dead exps
    return ops.relu(x)


def test_fixed_point_converges():
    g = trace(many_dead, TensorSpec((4,)))
    timings = PassTimings()
    result = PassManager([RemoveOneDead()], fixed_point=True, instrumentations=[timings]).run(g)
    assert result.changed
    assert [n.op for n in result.graph.nodes()] == ["input", "relu"]
    # three changing iterations, then one that changes nothing
    assert timings.runs == {"remove_one_dead": 4}
    assert not any(r.kind == "analysis" for r in result.remarks)


def test_without_fixed_point_runs_once():
    g = trace(many_dead, TensorSpec((4,)))
    timings = PassTimings()
    result = PassManager([RemoveOneDead()], instrumentations=[timings]).run(g)
    assert timings.runs == {"remove_one_dead": 1}
    assert len(result.graph) == len(g) - 1


def test_fixed_point_is_bounded_and_remarks_non_convergence():
    g = make_graph()
    snap = snapshot(g)
    timings = PassTimings()
    pipeline = [DeadCodeElimination(), AppendDead()]
    pm = PassManager(pipeline, fixed_point=True, max_iterations=3, instrumentations=[timings])
    result = pm.run(g)
    assert timings.runs == {"dce": 3, "append_dead": 3}
    assert result.changed
    last = result.remarks[-1]
    assert (last.kind, last.pass_name, last.reason) == ("analysis", MANAGER_NAME, "not_converged")
    assert "after 3 iterations" in last.message  # it names the bound
    # the bound stopped the driver after the last append: exactly one dead constant remains
    assert sum(1 for n in result.graph.nodes() if n.op == "constant") == 2
    assert_untouched(g, snap)


def test_converging_at_the_bound_is_not_flagged():
    g = trace(many_dead, TensorSpec((4,)))
    # 3 changing iterations + 1 quiet one = 4 iterations exactly
    result = PassManager([RemoveOneDead()], fixed_point=True, max_iterations=4).run(g)
    assert not any(r.kind == "analysis" for r in result.remarks)
    # one fewer: still changing at the bound
    result = PassManager([RemoveOneDead()], fixed_point=True, max_iterations=3).run(g)
    assert [r.kind for r in result.remarks] == ["analysis"]


def test_failure_in_later_iteration_names_full_history():
    g = trace(many_dead, TensorSpec((4,)))

    @dataclass(frozen=True)
    class FailWhenClean(Pass):
        name: ClassVar[str] = "fail_when_clean"

        def run(self, graph: Graph, remarks: Remarks) -> bool:
            if len(graph) == 2:
                raise RuntimeError("clean")
            return False

    with pytest.raises(PassError) as info:
        PassManager([RemoveOneDead(), FailWhenClean()], fixed_point=True).run(g)
    assert str(info.value) == (
        "pass 'fail_when_clean' failed (after: remove_one_dead, fail_when_clean, remove_one_dead, "
        "fail_when_clean, remove_one_dead, iteration 3): RuntimeError: clean"
    )


# ----------------------------------------------------------------------------- instrumentation


def test_hooks_called_in_order_with_changed_flags():
    rec = Recorder()
    g = make_graph()
    PassManager([NoOp(), DeadCodeElimination()], instrumentations=[rec]).run(g)
    n = len(g)
    assert rec.events == [
        ("before", "noop", n),
        ("after", "noop", n, False),
        ("before", "dce", n),
        ("after", "dce", n - 2, True),
    ]


def test_print_after_change_prints_only_changing_passes():
    stream = io.StringIO()
    g = make_graph()
    result = PassManager([NoOp(), DeadCodeElimination(), NoOp()], instrumentations=[PrintAfterChange(stream)]).run(g)
    out = stream.getvalue()
    assert out.count("// after ") == 1
    assert "// after noop" not in out
    assert out == f"// after dce\n{result.graph}\n"


def test_print_after_change_defaults_to_stdout(capsys):
    PassManager([DeadCodeElimination()], instrumentations=[PrintAfterChange()]).run(make_graph())
    assert capsys.readouterr().out.startswith("// after dce\ngraph model(")


def test_pass_timings_table_lists_every_pass():
    timings = PassTimings()
    PassManager([NoOp(), DeadCodeElimination(), AppendDead()], instrumentations=[timings]).run(make_graph())
    assert timings.runs == {"noop": 1, "dce": 1, "append_dead": 1}
    assert all(s >= 0.0 for s in timings.seconds.values())
    lines = timings.table().splitlines()
    assert lines[0].split() == ["pass", "runs", "total", "ms", "%"]
    assert [ln.split()[0] for ln in lines[1:]] == ["noop", "dce", "append_dead", "total"]
    assert len({len(ln) for ln in lines}) == 1  # aligned columns
    pct = [float(ln.split()[-1]) for ln in lines[1:-1]]
    assert sum(pct) == pytest.approx(100.0, abs=0.2)
    assert lines[-1].split()[1] == "3"


def test_pass_timings_accumulates_over_iterations():
    timings = PassTimings()
    PassManager([AppendDead()], fixed_point=True, max_iterations=5, instrumentations=[timings]).run(make_graph())
    assert timings.runs == {"append_dead": 5}
    assert timings.table().splitlines()[1].split()[:2] == ["append_dead", "5"]
