"""Sharding annotations in the IR: printed, parsed, kept in JSON, checked by the verifier, kept by passes."""

from __future__ import annotations

import json
import re

import pytest

from attnpass.ir import Graph, GraphFormatError, VerifyError, diff_graphs, parse_graph
from attnpass.models import verify_step
from attnpass.passes import PassManager, parse_pipeline

HEADS = (None, "model", None, None)


def annotated() -> Graph:
    graph = verify_step(q_len=4, kv_len=64)
    graph.set_mesh({"data": 1, "model": 2})
    for name in ("q", "k_cache", "v_cache", "sdpa"):
        graph.set_sharding(name, HEADS)
    return graph.verify()


def test_the_text_form_names_the_mesh_and_each_split_dimension():
    text = str(annotated())
    assert text.splitlines()[0].endswith(") mesh(data=1, model=2) {")
    assert "k_cache:bf16[1,2@model,64,256]{resident}" in text
    assert "sdpa:bf16[1,24@model,4,256] = sdpa[" in text
    assert "mask:bool[1,1,4,64]" in text  # unannotated values print as before


def test_text_and_json_round_trip_mesh_and_shardings():
    graph = annotated()
    assert parse_graph(str(graph)) == graph
    loaded = Graph.from_json(graph.to_json())
    assert loaded == graph
    assert dict(loaded.mesh_axes) == {"data": 1, "model": 2}
    assert loaded.node("sdpa").sharding == HEADS
    doc = json.loads(graph.to_json())
    assert doc["mesh"] == [["data", 1], ["model", 2]]
    assert [n.get("sharding") for n in doc["nodes"]] == [list(HEADS), list(HEADS), list(HEADS), None, list(HEADS)]


def test_an_unsharded_graph_writes_neither_field():
    doc = json.loads(verify_step(q_len=4, kv_len=64).to_json())
    assert "mesh" not in doc and all("sharding" not in n for n in doc["nodes"])


def test_equality_sees_shardings_and_the_mesh_but_the_fingerprint_does_not():
    plain, graph = verify_step(q_len=4, kv_len=64), annotated()
    assert plain != graph
    assert plain.fingerprint() == graph.fingerprint()  # placement is not arithmetic
    bare_mesh = verify_step(q_len=4, kv_len=64)
    bare_mesh.set_mesh({"model": 2})
    assert bare_mesh != plain
    assert diff_graphs(plain, graph).changed == ("q", "k_cache", "v_cache", "sdpa")


@pytest.mark.parametrize(
    ("sharding", "message"),
    [
        ((None, "rows", None, None), "not a mesh axis of the graph (declared: data, model)"),
        ((None, "model", "model", None), "mesh axis model shards more than one dimension"),
        ((None, "model", None), "has 3 entries for rank 4"),
        (("model", None, None, None), "dimension 0 of size 1 does not divide over mesh axis model of size 2"),
    ],
)
def test_the_verifier_rejects_bad_shardings(sharding, message):
    graph = annotated()
    node = graph.node("sdpa")
    graph.replace_node("sdpa", node.replace(sharding=sharding))
    with pytest.raises(VerifyError, match=re.escape(message)):
        graph.verify()
    with pytest.raises(VerifyError, match=re.escape(message)):
        annotated().set_sharding("sdpa", sharding)


def test_set_mesh_rejects_a_mesh_the_annotations_do_not_fit():
    graph = annotated()
    with pytest.raises(VerifyError, match="value q: dimension 1 is sharded over 'model', which is not a mesh axis"):
        graph.set_mesh({"data": 2})
    with pytest.raises(VerifyError, match="size 2 does not divide over mesh axis model of size 4"):
        graph.set_mesh({"model": 4})  # k_cache has 2 heads
    with pytest.raises(GraphFormatError, match=r"size must be an int in \[1, 2147483647\], got 0"):
        graph.set_mesh({"model": 0})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(mesh=[["model", "two"]]), r"size must be an int in \[1, 2147483647\], got .two."),
        (lambda d: d.update(mesh={"model": 2}), "must be a list of \\[axis, size\\] pairs"),
        (lambda d: d["nodes"][0].update(sharding="model"), "sharding must be a list of mesh axis names and nulls"),
        (lambda d: d["nodes"][0].update(sharding=[None, "rows", None, None]), "not a mesh axis of the graph"),
    ],
)
def test_json_loading_validates_mesh_and_shardings(edit, message):
    doc = json.loads(annotated().to_json())
    edit(doc)
    with pytest.raises(GraphFormatError, match=message):
        Graph.from_json(json.dumps(doc))


# Hostile mesh and sharding fields: each is refused with a GraphFormatError (never another exception).
HOSTILE_JSON = {
    "mesh-null": lambda d: d.update(mesh=None),
    "mesh-not-pairs": lambda d: d.update(mesh=["model"]),
    "mesh-short-pair": lambda d: d.update(mesh=[["model"]]),
    "mesh-name-not-str": lambda d: d.update(mesh=[[["model"], 2]]),
    "mesh-name-not-identifier": lambda d: d.update(mesh=[["a b", 2]]),
    "mesh-size-bool": lambda d: d.update(mesh=[["model", True]]),
    "mesh-size-huge": lambda d: d.update(mesh=[["model", 10**19]]),
    "mesh-size-float": lambda d: d.update(mesh=[["model", 2.0]]),
    "mesh-axis-twice": lambda d: d.update(mesh=[["model", 2], ["model", 2]]),
    "sharding-int": lambda d: d["nodes"][0].update(sharding=[0, None, None, None]),
    "sharding-dict": lambda d: d["nodes"][0].update(sharding={"model": 1}),
    "sharding-rank": lambda d: d["nodes"][0].update(sharding=["model"]),
    "sharding-axis-twice": lambda d: d["nodes"][1].update(sharding=[None, "model", "model", None]),
    "sharding-long-name": lambda d: d["nodes"][0].update(sharding=[None, "x" * 100000, None, None]),
    "sharding-without-mesh": lambda d: d.pop("mesh"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_JSON))
def test_hostile_mesh_and_sharding_fields_are_clean_load_errors(name):
    doc = json.loads(annotated().to_json())
    HOSTILE_JSON[name](doc)
    with pytest.raises(GraphFormatError) as info:
        Graph.from_json(json.dumps(doc))
    assert len(str(info.value).splitlines()[0]) < 400  # quoted input stays short


def test_the_parser_rejects_a_malformed_mesh():
    text = str(annotated()).replace("mesh(data=1, model=2)", "mesh(data, model=2)")
    with pytest.raises(GraphFormatError, match="malformed mesh axis 'data'; expected name=size"):
        parse_graph(text)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("mesh(data=1, model=2)", "mesh(data=1, model=" + "9" * 5000 + ")", "malformed mesh axis"),
        ("mesh(data=1, model=2)", "mesh(data=1, model=\u00b2)", "malformed mesh axis"),
        ("mesh(data=1, model=2)", "mesh(data=1, model=0)", "size must be an int in"),
        ("mesh(data=1, model=2)", "mesh(data=1, data=2)", "declared twice"),
        ("k_cache:bf16[1,2@model,64,256]", "k_cache:bf16[1,2@nowhere,64,256]", "not a mesh axis of the graph"),
        ("k_cache:bf16[1,2@model,64,256]", "k_cache:bf16[1,2@model,64@model,256]", "more than one dimension"),
        ("k_cache:bf16[1,2@model,64,256]", "k_cache:bf16[1,2@,64,256]", "malformed type"),
        ("k_cache:bf16[1,2@model,64,256]", "k_cache:bf16[1,2@model@data,64,256]", "malformed type"),
        ("sdpa:bf16[1,24@model,4,256]", "sdpa:bf16[1,24@data@model,4,256]", "malformed type"),
        ("sdpa:bf16[1,24@model,4,256]", "sdpa:bf16[1,24@model," + "4" * 30 + ",256]", "out of range"),
    ],
)
def test_the_parser_refuses_hostile_mesh_and_sharding_text(old, new, message):
    text = str(annotated())
    assert old in text
    with pytest.raises(GraphFormatError, match=message):
        parse_graph(text.replace(old, new.encode().decode("unicode_escape")))


def test_a_long_header_parses_in_linear_time():
    text = str(annotated()).replace(") mesh(", ")" + " mesh(" * 20000 + "x=1) mesh(", 1)
    with pytest.raises(GraphFormatError, match="malformed graph header"):
        parse_graph(text)


def test_passes_keep_the_annotations_of_what_they_do_not_touch():
    graph = annotated()
    graph.set_sharding("sdpa", None)  # head-chunk replaces sdpa: its own annotation goes with it
    result = PassManager(parse_pipeline("dce,head-chunk,dce")).run(graph).graph
    assert result.node("sdpa_c0").sharding is None
    assert [result.node(n).sharding for n in ("q", "k_cache", "v_cache")] == [HEADS] * 3
    assert dict(result.mesh_axes) == {"data": 1, "model": 2}
