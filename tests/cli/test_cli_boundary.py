"""Issue 32 item 5: the CLI names an unknown option and lists the commands, refuses a negative --width,
prints each pass's first sentence whole, replays a crash of a pass a script defined with the --load it
needs, names --params given a graph without weights or a file that is not safetensors, and explains the
default pipeline when no --pipeline is given."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from attnpass.cli.main import main
from attnpass.ir.frontends.weights import save_weights
from attnpass.models import verify_step
from attnpass.passes import available_passes, default_pipeline, format_pipeline


def test_an_unknown_option_is_named_with_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--bogus-flag"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "unrecognized arguments: --bogus-flag" in err and "one of show, run, explain" in err


def test_a_negative_width_is_a_usage_error(tmp_path, capsys):
    graph = tmp_path / "g.json"
    graph.write_text(verify_step(4, 64).to_json())
    with pytest.raises(SystemExit) as info:
        main(["run", "-p", "dce", str(graph), "--width", "-3"])
    assert info.value.code == 2 and "argument --width: must be an int >= 0, got '-3'" in capsys.readouterr().err


def test_passes_prints_whole_first_sentences(cli):
    status, out, _ = cli("passes")
    assert status == 0
    summaries = [  # an option's description is indented further, under its "    option" line
        line.strip()
        for line in out.splitlines()
        if line.startswith("    ") and not line.startswith(("    option", "        "))
    ]
    assert len(summaries) == len(available_passes())
    assert all(s.endswith(".") for s in summaries), summaries
    assert any("concatenated along the rows; valid IR in, valid IR out." in s for s in summaries)


SCRIPT = """
from dataclasses import dataclass
from typing import ClassVar

from attnpass.models import verify_step
from attnpass.passes import Pass, PassManager, register_pass


@register_pass
@dataclass(frozen=True)
class ScriptBoom(Pass):
    \"\"\"Fails on purpose.\"\"\"

    name: ClassVar[str] = "script-boom"

    def run(self, graph, remarks):
        raise RuntimeError("boom")


if __name__ == "__main__":
    PassManager([ScriptBoom()], reproducer_dir="crashes").run(verify_step(4, 64))
"""


def test_a_crash_of_a_pass_a_script_defines_replays_with_the_load_it_needs(tmp_path):
    """The script runs the PassManager itself (no --load anywhere): the reproducer records the script's file and
    the printed command, run as printed, replays the crash."""
    script = tmp_path / "my_passes.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 1
    replay = next(line for line in done.stderr.splitlines() if line.startswith("replay with: "))
    assert replay.startswith(f"replay with: attnpass --load {script} run --reproducer crashes/attnpass-crash-")
    again = subprocess.run(
        replay.removeprefix("replay with: "), shell=True, capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert again.returncode == 1
    assert again.stderr == "attnpass: error: pass 'script-boom' failed (after: none): RuntimeError: boom\n"


def _weighted_graph(tmp_path: Path) -> Path:
    """A graph with one imported weight input (a path) and its sibling .safetensors."""
    from attnpass.ir import DType, Graph, TensorType

    g = Graph("linear")
    x = g.add_input("x", TensorType((2, 4), DType.float32))
    w = g.add_input("w", TensorType((4, 4), DType.float32), role="resident", path="layer.weight")
    g.set_outputs([g.add_node("matmul", [x, w])])
    path = tmp_path / "linear.json"
    path.write_text(g.to_json())
    save_weights(g, {"w": np.eye(4, dtype=np.float32)}, tmp_path / "linear.safetensors")
    return path


def test_params_on_a_graph_without_weights_is_named(cli, tmp_path):
    weighted = _weighted_graph(tmp_path)
    plain = tmp_path / "g.json"
    plain.write_text(verify_step(4, 64).to_json())
    weights = tmp_path / "linear.safetensors"
    status, out, err = cli("run", "-p", "dce", "--params", weights, plain, "-o", tmp_path / "out.json")
    assert status == 1 and out == "" and err.count("\n") == 1
    assert f"--params {weights}: graph attention ({plain}) has no weight inputs to read it into" in err
    assert not (tmp_path / "out.json").exists()
    status, _, err = cli("run", "-p", "dce", "--params", weights, weighted, "-o", tmp_path / "w.json")
    assert status == 0 and (tmp_path / "w.safetensors").is_file(), err


def test_params_given_the_graph_json_says_what_it_is(cli, tmp_path):
    weighted = _weighted_graph(tmp_path)
    status, _, err = cli("run", "-p", "dce", "--params", weighted, weighted)
    assert status == 1 and err.count("\n") == 1
    assert f"{weighted}: JSON text, not safetensors (a graph file?)" in err and "expected the weights" in err


def test_explain_without_a_pipeline_explains_the_default_one(cli, tmp_path):
    graph = tmp_path / "g.json"
    graph.write_text(verify_step(4, 64).to_json())
    status, out, _ = cli("explain", graph)
    first = out.splitlines()[0]
    assert status == 0
    pipeline = format_pipeline(default_pipeline("cpu"))
    assert first == f"// pipeline: the default for device cpu (default_pipeline('cpu')): {pipeline}"
    assert "[decompose-sdpa] applied sdpa: strategy decomposed (device cpu)" in out
    status, out, _ = cli("explain", "--device", "gpu", graph)
    assert status == 0 and "default_pipeline('gpu')" in out.splitlines()[0] and "strategy fused" in out
    status, _, err = cli("explain", "--device", "npu", graph)
    assert status == 1 and "--device must be one of cpu, metal, gpu, tpu, got 'npu'" in err
    status, _, err = cli("explain", "-p", "dce", "--device", "gpu", graph)
    assert status == 1 and "--device picks the default pipeline" in err
    status, _, err = cli("run", graph)
    assert status == 1 and "give --pipeline TEXT" in err  # run still needs one
