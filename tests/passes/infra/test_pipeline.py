"""Pass registry, textual pipelines (typed options, round trip, errors), plugins and crash reproducers."""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnpass.ir import Graph, GraphFormatError, TensorSpec, ops, trace
from attnpass.passes import (
    DeadCodeElimination,
    HeadChunkSDPA,
    NarrowInputs,
    Pass,
    PassError,
    PassManager,
    PipelineError,
    QSAGather,
    RaiseAttention,
    Remarks,
    available_passes,
    format_pipeline,
    get_pass,
    load_reproducer,
    parse_pipeline,
    register_pass,
)
from attnpass.passes.infra import registry

BUILTINS = {
    "dce": DeadCodeElimination,
    "head-chunk": HeadChunkSDPA,
    "narrow-inputs": NarrowInputs,
    "qsa-gather": QSAGather,
    "raise-attention": RaiseAttention,
}


@pytest.fixture(autouse=True)
def private_registry(monkeypatch):
    """Passes registered by a test stay in that test."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def model(x, y):
    a = ops.exp(x)
    ops.relu(y)  # dead
    return a + 1.0


def small_graph() -> Graph:
    return trace(model, TensorSpec((2, 3)), TensorSpec((2, 3)))


@dataclass(frozen=True)
class Explode(Pass):
    """Raises on any graph with an ``exp``."""

    name: ClassVar[str] = "test-explode"
    message: str = "boom"

    def run(self, graph: Graph, remarks: Remarks) -> bool:
        if any(n.op == "exp" for n in graph.nodes()):
            raise RuntimeError(self.message)
        return False


# ----------------------------------------------------------------------------- registry and parsing


def test_builtin_passes_have_stable_kebab_case_names():
    assert set(BUILTINS) <= set(available_passes())
    for name, cls in BUILTINS.items():
        assert get_pass(name) is cls and cls.name == name


def test_options_are_converted_from_the_dataclass_field_types():
    (hc, qg) = parse_pipeline("head-chunk{budget=16}, qsa-gather{ pad_multiple = 256 , min_depth_factor=2 }")
    assert hc == HeadChunkSDPA(budget=16) and type(hc.budget) is int
    assert qg == QSAGather(pad_multiple=256, min_depth_factor=2.0) and type(qg.min_depth_factor) is float
    assert parse_pipeline("head-chunk{enabled=OFF}")[0].enabled is False
    assert parse_pipeline("head-chunk{enabled=true}")[0].enabled is True
    assert parse_pipeline("head-chunk{enabled=none}")[0].enabled is None
    assert parse_pipeline("qsa-gather{min_depth_factor=0.5}")[0].min_depth_factor == 0.5
    assert parse_pipeline("dce,dce{}") == [DeadCodeElimination(), DeadCodeElimination()]
    assert parse_pipeline([]) == []  # the empty pipeline; the empty text is an error (test_bad_pipelines_...)


def test_format_then_parse_round_trips_the_builtin_pipeline():
    passes = [DeadCodeElimination(), HeadChunkSDPA(budget=16), QSAGather(pad_multiple=256, enabled=False),
              NarrowInputs(), RaiseAttention()]  # fmt: skip
    text = format_pipeline(passes)
    assert text == "dce,head-chunk{budget=16},qsa-gather{enabled=false,pad_multiple=256},narrow-inputs,raise-attention"
    assert parse_pipeline(text) == passes
    full = format_pipeline(passes, include_defaults=True)
    assert "head-chunk{enabled=none,budget=16}" in full and "raise-attention" in full
    assert parse_pipeline(full) == passes


@settings(max_examples=40, deadline=None)
@given(
    budget=st.integers(1, 10_000),
    enabled=st.sampled_from([None, True, False]),
    pad=st.integers(1, 4096),
    rows=st.integers(1, 64),
    depth=st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
)
def test_round_trip_for_any_option_values(budget, enabled, pad, rows, depth):
    passes = [
        HeadChunkSDPA(enabled=enabled, budget=budget),
        QSAGather(enabled=enabled, max_rows=rows, min_depth_factor=depth, pad_multiple=pad),
    ]
    assert parse_pipeline(format_pipeline(passes)) == passes
    assert parse_pipeline(format_pipeline(passes, include_defaults=True)) == passes


@pytest.mark.parametrize(
    "text, message",
    [
        ("dce,fuse-everything", "unknown pass 'fuse-everything'; available passes: block-sparse, canonicalize, dce, "
                                "decompose-sdpa, dsa-gather, head-chunk, mla-absorb, narrow-inputs"),
        ("head-chunk{bugdet=16}", "pass head-chunk has no option 'bugdet'; its options: enabled: bool | None = none; "
                                  "budget: int = 32"),
        ("head-chunk{budget=16.5}", "pass head-chunk: option budget: expected int, got '16.5'"),
        ("head-chunk{enabled=maybe}", "option enabled: expected bool or none, got 'maybe'"),
        ("head-chunk{budget=1,budget=2}", "option budget given twice"),
        ("head-chunk{budget}", "malformed option 'budget'; expected key=value"),
        ("head-chunk{budget=16", "'{' at offset 10 is never closed"),
        ("head-chunk{budget=16}dce", "expected ',' after the options of head-chunk"),
        ("dce,", "trailing ','"),
        ("dce,,dce", "empty pass name at offset 4"),
        ("", "the pipeline is the empty text ''; give pass names separated by ',' ('raise-attention,"
             "dce'; available passes: block-sparse, canonicalize, dce, "),
        ("  ", "the pipeline is the empty text '  '; give pass names separated by ','"),
        ("dce head-chunk", "unknown pass 'dce head-chunk'; available passes: block-sparse, canonicalize, dce, "),
        ("dce head-chunk", "; passes are separated by ',', not spaces: did you mean 'dce,head-chunk'?"),
        ("dce,head-chunck{budget=4}", "unknown pass 'head-chunck'; available passes: block-sparse, "),
        ("dce,head-chunck{budget=4}", "; did you mean 'head-chunk'?"),
        ("qsa-gather{pad_multiple=0}", "pass qsa-gather: QSAGather: pad_multiple must be an int >= 1, got 0"),
        ("raise-attention{rules=x}", "option rules has type"),
    ],
)  # fmt: skip
def test_bad_pipelines_are_clear_errors(text, message):
    with pytest.raises(PipelineError) as info:
        parse_pipeline(text)
    assert message in str(info.value)


def test_values_without_a_text_form_are_refused():
    with pytest.raises(PipelineError, match="has no text form"):
        format_pipeline([RaiseAttention(rules=())])


# ----------------------------------------------------------------------------- third-party passes


def test_decorated_pass_works_in_a_pipeline():
    @register_pass
    @dataclass(frozen=True)
    class CountExp(Pass):
        name: ClassVar[str] = "count-exp"
        limit: int = 1

        def run(self, graph: Graph, remarks: Remarks) -> bool:
            found = sum(n.op == "exp" for n in graph.nodes())
            remarks.analysis(None, f"{found} exp (limit {self.limit})")
            return False

    assert "count-exp" in available_passes()
    result = PassManager(parse_pipeline("dce,count-exp{limit=3}")).run(small_graph())
    assert [str(r) for r in result.remarks][-1] == "[count-exp] analysis: 1 exp (limit 3)"
    assert format_pipeline(parse_pipeline("count-exp{limit=3}")) == "count-exp{limit=3}"
    assert register_pass(CountExp) is CountExp  # registering the same class again is a no-op


def test_registration_rejects_clashes_bad_names_and_non_passes():
    @dataclass(frozen=True)
    class FakeDCE(Pass):
        name: ClassVar[str] = "dce"

        def run(self, graph: Graph, remarks: Remarks) -> bool:
            return False

    with pytest.raises(
        PipelineError, match="the name 'dce' is taken by attnpass.passes.rewrites.dce.DeadCodeElimination"
    ):
        register_pass(FakeDCE)

    @dataclass(frozen=True)
    class Braces(Pass):
        name: ClassVar[str] = "a{b}"

        def run(self, graph: Graph, remarks: Remarks) -> bool:
            return False

    with pytest.raises(PipelineError, match="is not a pass name"):
        register_pass(Braces)
    with pytest.raises(PipelineError, match="is not a Pass dataclass"):
        register_pass(int)  # type: ignore[arg-type]


PLUGIN = """
from dataclasses import dataclass
from typing import ClassVar

from attnpass.passes import Pass


@dataclass(frozen=True)
class Scale(Pass):
    name: ClassVar[str] = "ep-scale"
    factor: float = 1.0

    def run(self, graph, remarks):
        remarks.analysis(None, f"factor {self.factor}")
        return False


@dataclass(frozen=True)
class Misnamed(Pass):
    name: ClassVar[str] = "something-else"

    def run(self, graph, remarks):
        return False
"""


@pytest.fixture
def entry_points(monkeypatch, tmp_path):
    """A fake installed plugin: module ``ep_plugin`` on sys.path and entry points in attnpass.passes."""
    (tmp_path / "ep_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ep_plugin", raising=False)
    eps = [
        importlib.metadata.EntryPoint("ep-scale", "ep_plugin:Scale", registry.ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("ep-misnamed", "ep_plugin:Misnamed", registry.ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("ep-missing", "no_such_module:Pass", registry.ENTRY_POINT_GROUP),
    ]
    real = importlib.metadata.entry_points

    def fake(**params):
        if params.get("group") == registry.ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints(eps)
        return real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    return eps


def test_entry_point_passes_are_listed_lazily_and_loaded_on_use(entry_points):
    assert {"ep-scale", "ep-misnamed", "ep-missing", "dce"} <= set(available_passes())
    assert "ep_plugin" not in sys.modules  # listing imports nothing
    (scale,) = parse_pipeline("ep-scale{factor=2.5}")
    assert "ep_plugin" in sys.modules and type(scale).__module__ == "ep_plugin" and scale.factor == 2.5
    result = PassManager([scale]).run(small_graph())
    assert str(result.remarks[0]) == "[ep-scale] analysis: factor 2.5"
    assert format_pipeline([scale]) == "ep-scale{factor=2.5}"


def test_broken_entry_points_are_clear_errors(entry_points):
    with pytest.raises(PipelineError, match="entry point 'ep_plugin:Misnamed' names a pass called 'something-else'"):
        get_pass("ep-misnamed")
    with pytest.raises(PipelineError, match="pass 'ep-missing': loading entry point 'no_such_module:Pass' failed: "
                                            "ModuleNotFoundError"):  # fmt: skip
        get_pass("ep-missing")


# ----------------------------------------------------------------------------- crash reproducers


def test_a_crash_writes_a_reproducer_that_replays_it(tmp_path):
    register_pass(Explode)
    graph = small_graph()
    manager = PassManager(parse_pipeline("dce,test-explode{message=kaboom}"), reproducer_dir=tmp_path)
    with pytest.raises(PassError) as info:
        manager.run(graph)
    message = str(info.value)
    assert message.startswith("pass 'test-explode' failed (after: dce): RuntimeError: kaboom")
    (path,) = tmp_path.iterdir()
    assert re.fullmatch(r"attnpass-crash-[0-9a-f]{8}\.json", path.name)
    # a pass defined outside attnpass: the replay loads the module that defines it (this one, a package module)
    assert f"crash reproducer: {path}\nreplay with: attnpass --load {__name__} run --reproducer {path}" in message
    rep = load_reproducer(path)
    assert rep.load == (__name__,)
    assert rep.pipeline == "test-explode{message=kaboom}" and rep.after == ("dce",)
    assert rep.graph == DeadCodeElimination()(graph).graph  # the graph the failing pass received
    assert rep.error == message.split("\ncrash reproducer")[0]
    assert json.loads(path.read_text())["graph"]["format"] == "attnpass.graph"
    with pytest.raises(PassError, match="RuntimeError: kaboom"):
        PassManager(rep.passes).run(rep.graph)
    with pytest.raises(PassError):
        manager.run(graph)
    assert list(tmp_path.iterdir()) == [path]  # the same crash maps to the same file


def test_no_reproducer_unless_asked_and_unregistered_passes_say_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PassError) as info:
        PassManager([Explode()]).run(small_graph())
    assert "reproducer" not in str(info.value) and not list(tmp_path.iterdir())
    with pytest.raises(PassError, match="pass 'test-explode' is not registered: register it with @register_pass"):
        PassManager([Explode()], reproducer_dir=tmp_path / "crashes").run(small_graph())
    assert len(list((tmp_path / "crashes").iterdir())) == 1


def test_a_pass_that_lies_about_changed_is_a_crash_too(tmp_path):
    @register_pass
    @dataclass(frozen=True)
    class Liar(Pass):
        name: ClassVar[str] = "test-liar"

        def run(self, graph: Graph, remarks: Remarks) -> bool:
            return True

    with pytest.raises(PassError, match="reported changed=True but left the graph unchanged") as info:
        PassManager([Liar()], reproducer_dir=tmp_path).run(small_graph())
    assert f"replay with: attnpass --load {__name__} run --reproducer" in str(info.value)
    assert load_reproducer(next(tmp_path.iterdir())).pipeline == "test-liar"


def test_load_reproducer_rejects_other_files(tmp_path):
    graph_file = tmp_path / "g.json"
    graph_file.write_text(small_graph().to_json())
    with pytest.raises(GraphFormatError, match="not an attnpass crash reproducer"):
        load_reproducer(graph_file)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(GraphFormatError, match="malformed JSON"):
        load_reproducer(tmp_path / "bad.json")
