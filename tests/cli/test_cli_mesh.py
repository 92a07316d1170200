"""``--mesh`` on the command line: run/explain declare the graph's mesh, lower prints the sharded source
(without importing JAX), export writes StableHLO with its shardings; every mistake is one line on stderr."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnpass.models import verify_step
from tests.util import requires

PIPELINE = "head-chunk,shard-attention{heads=model}"
FITS = "is annotated for mesh axes model=2, but the mesh has"  # the graph's mesh against --mesh


@pytest.fixture
def graph_json(tmp_path) -> Path:
    path = tmp_path / "g.json"
    path.write_text(verify_step(q_len=4, kv_len=256).to_json())
    return path


@pytest.fixture
def sharded_json(cli, graph_json, tmp_path) -> Path:
    """The verify step after ``run --mesh model=2`` with head-chunk and shard-attention."""
    out = tmp_path / "s.json"
    status, _, err = cli("run", "--mesh", "model=2", "-p", PIPELINE, graph_json, "-o", out)
    assert status == 0, err
    return out


def one_line_error(result, message: str) -> None:
    status, out, err = result
    assert status == 1 and out == "", (status, out, err)
    assert err.startswith("attnpass: error: ") and err.count("\n") == 1, err
    assert message in err, err


def test_run_declares_the_mesh_before_the_pipeline(cli, sharded_json, graph_json):
    doc = json.loads(sharded_json.read_text())
    assert doc["mesh"] == [["model", 2]]
    assert any(n.get("sharding") for n in doc["nodes"])
    status, out, _ = cli("explain", "--mesh", "model=2", "-p", PIPELINE, graph_json)
    assert status == 0 and "[shard-attention] applied" in out and "KV heads over model" in out


def test_lower_prints_the_sharded_entry_point(cli, sharded_json):
    status, out, err = cli("lower", "--target", "jax", "--mesh", "model=2", sharded_json)
    assert status == 0, err
    assert "attention_sharded = jax.jit(" in out and "jax.lax.with_sharding_constraint(" in out
    status, plain, _ = cli("lower", "--target", "jax", sharded_json)  # without --mesh: the annotations are ignored
    assert status == 0 and "with_sharding_constraint" not in plain


@requires("jax")
def test_export_keeps_the_shardings_on_more_devices_than_this_process_has(cli, graph_json, tmp_path):
    out = tmp_path / "s8.json"
    assert cli("run", "--mesh", "seq=8", "-p", "shard-attention{seq=seq}", graph_json, "-o", out)[0] == 0
    status, text, err = cli("export", "--target", "stablehlo", "--mesh", "seq=8", out)  # an abstract 8-device mesh
    assert status == 0, err
    assert "sdy.sharding" in text and '{"seq"}' in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["lower", "--target", "jax", "--mesh", "model"], "--mesh: malformed mesh axis 'model'; expected name=size"),
        (["lower", "--target", "jax", "--mesh", "model=two"], "--mesh: malformed mesh axis 'model=two'"),
        (["lower", "--target", "jax", "--mesh", "model=0"], "--mesh: mesh axis model: size must be an int in [1,"),
        (["lower", "--target", "jax", "--mesh", "model=" + "9" * 5000], "--mesh: malformed mesh axis"),
        (["lower", "--target", "jax", "--mesh", "model=2,model=2"], "--mesh: mesh axis model is declared twice"),
        (["lower", "--target", "jax", "--mesh", "1x=2"], "--mesh: invalid mesh axis name '1x'"),
        (["lower", "--target", "jax", "--mesh", ","], "--mesh: mesh axis entry 1 of 2 in ',' is empty"),
        (["lower", "--target", "jax", "--mesh", "model=2,"], "--mesh: mesh axis entry 2 of 2 in 'model=2,' is empty"),
        (["lower", "--target", "jax", "--mesh", "model=4"], f"{FITS} model=4"),
        (["lower", "--target", "jax", "--mesh", "data=2"], f"{FITS} data=2"),
        (["lower", "--target", "mlx", "--mesh", "model=2"], "target 'mlx' has no sharded lowering; targets with one: jax"),
        (["lower", "--target", "numpy", "--mesh", "model=2"], "--mesh: target 'numpy' has no sharded lowering"),
        pytest.param(["export", "--target", "stablehlo", "--mesh", "model=3"], f"{FITS} model=3", marks=requires("jax")),
        (["export", "--target", "stablehlo", "--mesh", "model:2"], "--mesh: malformed mesh axis 'model:2'"),
    ],
)  # fmt: skip
def test_a_bad_mesh_is_one_line(cli, sharded_json, argv, message):
    one_line_error(cli(*argv, sharded_json), message)


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        ("model=5", "--mesh: set_mesh: value q: dimension 1 of size 24 does not divide over mesh axis model of size 5"),
        ("model=2=3", "--mesh: malformed mesh axis 'model=2=3'"),
        ("", "--mesh is empty"),
        ("  ", "--mesh is empty"),
        ("model=4,", "--mesh: mesh axis entry 2 of 2 in 'model=4,' is empty; expected name=size entries separated"),
        ("data=1,,model=2", "--mesh: mesh axis entry 2 of 3 in 'data=1,,model=2' is empty"),
    ],
)  # fmt: skip
def test_run_refuses_a_mesh_the_graph_does_not_fit(cli, sharded_json, mesh, message):
    one_line_error(cli("run", "--mesh", mesh, "-p", "dce", sharded_json), message)


def test_a_reproducer_replay_takes_no_mesh(cli, tmp_path):
    one_line_error(
        cli("run", "--reproducer", tmp_path / "crash.json", "--mesh", "model=2"), "give neither --pipeline, --mesh"
    )
