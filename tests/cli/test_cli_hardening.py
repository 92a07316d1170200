"""The command line under failure and at scale (issue 14, items 2-5 and the smaller "Why" points):
one line on stderr for every failure, --quiet/--summary/--remarks-json, short paths and wrapped
remarks, reproducers that record --load, switch typos that warn once, and cheap startup."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from attnpass.cli import commands, output
from attnpass.cli.main import build_parser, main
from attnpass.ir import Graph
from attnpass.ir.core import switches
from attnpass.models import EXAMPLES, qwen38, verify_step
from attnpass.passes import PassManager, parse_pipeline
from attnpass.passes.infra import registry
from tests.util import requires

QWEN38 = os.path.realpath(qwen38.__file__)
PIPELINE = "dce,head-chunk,qsa-gather,narrow-inputs"
MODEL_PIPELINE = EXAMPLES["qwen38-model"].pipeline  # qsa-gather{max_rows=4},head-chunk,dce,narrow-inputs,dce


@pytest.fixture(autouse=True)
def private_state(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(switches, "_WARNED", set())
    monkeypatch.delenv("ATTNPASS_SDPA_HEAD_CHUNK", raising=False)
    monkeypatch.delenv("ATTNPASS_QSA_GATHER", raising=False)


@pytest.fixture
def graph_json(tmp_path) -> Path:
    """The verify step as JSON, its locations as traced (absolute paths)."""
    path = tmp_path / "g.json"
    path.write_text(verify_step(4, 64).to_json())
    return path


def one_line_error(result, message: str) -> None:
    status, out, err = result
    assert status == 1 and out == "", (status, out, err)
    assert err.startswith("attnpass: error: ") and err.count("\n") == 1, err
    assert message in err, err


def edited(path: Path, change) -> Path:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))
    return path


# ----------------------------------------------------------------------------- item 2: failures are one line


def test_export_to_a_missing_directory_is_one_line(cli, graph_json, tmp_path):
    target = tmp_path / "missing" / "out.mlxfn"
    one_line_error(cli("export", "-t", "mlx", graph_json, "-o", target), f"cannot write {target}: no directory")
    one_line_error(cli("export", "-t", "stablehlo", graph_json, "-o", target), "no directory")


@requires("mlx.core")
def test_a_backend_failure_during_export_is_one_line(cli, graph_json, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("[export_function] Failed to open x\nmore detail")

    monkeypatch.setattr("mlx.core.export_function", broken)
    one_line_error(
        cli("export", "-t", "mlx", graph_json, "-o", tmp_path / "x.mlxfn"),
        "export to mlx failed in the backend: RuntimeError: [export_function] Failed to open x",
    )


@pytest.mark.parametrize(
    "command", [["show"], ["lower", "-t", "mlx"], ["export", "-t", "stablehlo"], ["run", "-p", "dce"]]
)
def test_huge_dims_are_one_line_everywhere(cli, graph_json, command):
    def huge(doc):
        doc["nodes"][1]["attrs"]["shape"][2] = doc["nodes"][1]["type"]["shape"][2] = 2**40

    path = edited(graph_json, huge)
    one_line_error(cli(*command, path), "out of range: dims at most 2147483647")


def test_load_of_a_file_with_a_syntax_error_is_one_line(cli, tmp_path):
    plugin = tmp_path / "broken_plugin.py"
    plugin.write_text("def oops(:\n    pass\n")
    one_line_error(cli("--load", plugin, "passes"), f"--load {plugin}: SyntaxError: ")
    plugin.write_text("raise RuntimeError('plugin refuses')\n")
    one_line_error(cli("--load", plugin, "passes"), f"--load {plugin}: RuntimeError: plugin refuses")
    assert "attnpass_plugin_broken_plugin" not in sys.modules


def test_an_unexpected_error_is_one_line_and_traceback_shows_it(cli, graph_json, monkeypatch):
    def crash(args):
        raise KeyError("surprise")

    monkeypatch.setattr(commands, "show", crash)
    one_line_error(cli("show", graph_json), "KeyError: 'surprise' (unexpected: rerun with --traceback to see where)")
    with pytest.raises(KeyError):
        main(["--traceback", "show", str(graph_json)])


@pytest.mark.parametrize("command", [["show"], ["run", "-p", "dce"], ["explain", "-p", "dce"], ["lower", "-t", "numpy"],
                                     ["diff", "{file}"], ["render", "-o", "g.dot"], ["export", "-t", "stablehlo"]])  # fmt: skip
def test_every_graph_command_reports_bad_files_in_one_line(cli, tmp_path, command):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{\x00")
    for bad, message in [(binary, f"{binary}: not UTF-8 text"), (tmp_path / "nope.json", "No such file or directory")]:
        one_line_error(cli(*[bad if a == "{file}" else a for a in command], bad), message)


def test_an_empty_pipeline_is_an_error_like_a_missing_one(cli, graph_json):
    one_line_error(cli("run", graph_json), "give --pipeline TEXT and a GRAPH file")  # explain: the default one
    for command in ("run", "explain"):
        for empty in ("", "  "):
            one_line_error(cli(command, "-p", empty, graph_json), "--pipeline is empty: name at least one pass")


@pytest.fixture
def passes_run(monkeypatch) -> list:
    """Every PassManager.run of the test, recorded (to show that a bad output path is refused first)."""
    runs: list = []
    original = PassManager.run

    def spy(self, graph):
        runs.append(graph.name)
        return original(self, graph)

    monkeypatch.setattr(PassManager, "run", spy)
    return runs


@pytest.mark.parametrize("command", ["run", "explain"])
def test_an_unwritable_output_is_refused_before_any_pass_runs(cli, graph_json, tmp_path, passes_run, command):
    missing = tmp_path / "missing" / "x.json"
    args = ["-p", PIPELINE, graph_json]
    if command == "run":
        one_line_error(cli("run", *args, "-o", missing), f"cannot write {missing}: no directory {missing.parent}")
    one_line_error(cli(command, *args, "--remarks-json", missing), f"cannot write {missing}: no directory")
    (tmp_path / "taken.json").mkdir()
    if command == "run":
        one_line_error(cli("run", *args, "-o", tmp_path / "taken.json"), "taken.json: it is a directory")
    assert passes_run == [] and not missing.parent.exists()
    assert cli(command, *args, "--remarks-json", tmp_path / "r.json")[0] == 0 and passes_run  # the spy sees runs


def test_run_output_must_be_json(cli, graph_json, tmp_path, passes_run):
    """``-o`` writes JSON: another suffix is an error listing the valid one, not JSON under a misleading name."""
    for name, given in (("out.txt", "suffix '.txt'"), ("out", "no suffix"), ("out.JSON", "suffix '.JSON'")):
        one_line_error(cli("run", "-p", PIPELINE, graph_json, "-o", tmp_path / name), f"{given}; valid: .json")
    assert passes_run == [] and sorted(p.name for p in tmp_path.iterdir()) == ["g.json"]
    assert cli("run", "-q", "-p", PIPELINE, graph_json, "-o", tmp_path / "out.json")[0] == 0
    assert Graph.from_json((tmp_path / "out.json").read_text()).name == Graph.from_json(graph_json.read_text()).name


def test_run_refuses_a_directory_it_may_not_write(cli, graph_json, tmp_path, passes_run, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only directory (root may write any)
    one_line_error(
        cli("run", "-p", PIPELINE, graph_json, "-o", tmp_path / "out.json"), f"directory {tmp_path} is not writable"
    )
    assert passes_run == []


# ----------------------------------------------------------------------------- item 2: long pipelines


@pytest.fixture
def model_json(tmp_path, cli) -> Path:
    path = tmp_path / "model.json"
    assert cli("example", "qwen38-model", "--layers", 8, "--n-kv", 4608, "-o", path)[0] == 0
    return path


def test_quiet_prints_no_remarks(cli, model_json, tmp_path):
    status, out, err = cli("run", "-q", "-p", MODEL_PIPELINE, model_json, "-o", tmp_path / "out.json")
    assert (status, out, err) == (0, "", "")
    status, out, _ = cli("run", "--quiet", "-p", MODEL_PIPELINE, model_json)
    assert status == 0 and out.startswith("graph qwen38_step(") and "[head-chunk]" not in out


def test_summary_prints_one_line_per_pass(cli, model_json, tmp_path):
    status, out, _ = cli("run", "--summary", "-p", MODEL_PIPELINE, model_json, "-o", tmp_path / "out.json")
    assert status == 0
    summary = [
        "// qsa-gather: 2 applied, 6 declined",
        "// head-chunk: 6 applied, 2 declined",  # each gathered QSA layer is one sdpa over its qsa_gather
        "// dce: 1 applied, 1 declined",  # both runs of dce
        "// narrow-inputs: 1 applied, 28 declined",
    ]
    assert out.splitlines() == [*summary, f"// wrote {tmp_path / 'out.json'}: changed, 151 -> 243 nodes"]
    assert cli("explain", "--summary", "-p", MODEL_PIPELINE, model_json) == (0, "\n".join(summary) + "\n", "")
    assert len(cli("run", "-p", MODEL_PIPELINE, model_json, "-o", tmp_path / "out.json")[1].splitlines()) == 48


def test_remarks_json_holds_every_remark_whole(cli, model_json, tmp_path):
    path = tmp_path / "remarks.json"
    status, out, _ = cli(
        "run", "--width", 40, "--remarks-json", path, "-p", MODEL_PIPELINE, model_json, "-o", tmp_path / "o.json"
    )
    assert status == 0
    rows = json.loads(path.read_text())
    expected = PassManager(parse_pipeline(MODEL_PIPELINE)).run(Graph.from_json(model_json.read_text())).remarks
    assert [(r["pass"], r["rule"], r["kind"], r["node"], r["reason"], r["message"]) for r in rows] == [
        (r.pass_name, r.rule, r.kind, r.node, r.reason, r.message) for r in expected
    ]
    assert any(r["rule"] for r in rows)  # rule-driven passes name their rule as a field
    assert all("\n" not in r["message"] for r in rows) and max(len(r["message"]) for r in rows) > 200
    assert {r["loc"]["file"] for r in rows if r["loc"]} >= {"attnpass/models/qwen38.py"}  # the example's module paths
    quiet = tmp_path / "quiet.json"
    assert cli("run", "-q", "--remarks-json", quiet, "-p", MODEL_PIPELINE, model_json)[0] == 0
    assert json.loads(quiet.read_text()) == rows


def test_remarks_wrap_to_the_width(cli, graph_json):
    status, out, _ = cli("explain", "--width", 60, "-p", PIPELINE, graph_json)
    assert status == 0
    lines = out.splitlines()
    assert all(len(line) <= 60 for line in lines if " " in line.strip())
    assert lines[1].startswith("[head-chunk] applied sdpa:") and lines[2].startswith("    ")
    remarks = [line for line in lines if line.startswith("[")]
    assert len(remarks) == 10  # one entry per remark; its continuation lines are indented
    unwrapped = cli("explain", "--width", 0, "-p", PIPELINE, graph_json)[1].splitlines()
    assert len(unwrapped) == 10 + 4 and max(map(len, unwrapped)) > 200


def test_wrapping_follows_the_terminal(monkeypatch):
    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setenv("COLUMNS", "70")
    assert output.terminal_width(Terminal()) == 70
    monkeypatch.setenv("COLUMNS", "300")
    assert output.terminal_width(Terminal()) == output.MAX_WIDTH == 100
    assert output.terminal_width(open(os.devnull, "w")) == 0  # a file or a pipe: whole lines


# ----------------------------------------------------------------------------- item 2: paths


def test_remark_paths_are_short_unless_full_paths(cli, graph_json, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, out, _ = cli("explain", "-p", "head-chunk", graph_json)
    assert status == 0 and "(attnpass/models/qwen38.py:30 in attention)" in out  # outside the cwd: the module
    assert QWEN38 not in out
    status, out, _ = cli("explain", "--full-paths", "-p", "head-chunk", graph_json)
    assert f"({qwen38.__file__}:30 in attention)" in out

    def local(doc):
        for node in doc["nodes"]:
            if node["loc"]:
                node["loc"]["file"] = str(tmp_path / "src" / "model.py")

    edited(graph_json, local)
    assert "(src/model.py:30 in attention)" in cli("explain", "-p", "head-chunk", graph_json)[1]
    edited(graph_json, lambda doc: doc["nodes"][-1]["loc"].update(file="/elsewhere/model.py"))
    assert "(/elsewhere/model.py:30 in attention)" in cli("explain", "-p", "head-chunk", graph_json)[1]


def test_example_json_carries_no_install_path(cli, tmp_path):
    status, out, _ = cli("example", "qwen38-verify", "--n-kv", 64)
    assert status == 0 and QWEN38 not in out and os.path.dirname(QWEN38) not in out
    files = {n.loc.file for n in Graph.from_json(out).nodes() if n.loc}
    assert files == {"attnpass/models/qwen38.py"}
    status, out, _ = cli("example", "qwen38-verify", "--n-kv", 64, "--full-paths")
    assert {n.loc.file for n in Graph.from_json(out).nodes() if n.loc} == {qwen38.__file__}


def test_show_locs_escapes_and_shortens(cli, graph_json, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    edited(graph_json, lambda doc: doc["nodes"][-1]["loc"].update(file=str(tmp_path / "a\nb.py"), function="f\tg"))
    status, out, _ = cli("show", "--locs", graph_json)
    assert status == 0 and out.count("\n") == 4
    assert out.splitlines()[1].endswith("  # a\\nb.py:30 in f\\tg")
    assert f"# {tmp_path}/a\\nb.py:30" in cli("show", "--locs", "--full-paths", graph_json)[1]


# ----------------------------------------------------------------------------- item 3: reproducers and --load

PLUGIN = '''
from dataclasses import dataclass
from typing import ClassVar

from attnpass.passes import Pass, register_pass


@register_pass
@dataclass(frozen=True)
class Boom(Pass):
    """Fails on purpose."""

    name: ClassVar[str] = "hardening-boom"

    def run(self, graph, remarks):
        raise RuntimeError("boom")
'''


def test_the_printed_replay_command_works_as_printed(tmp_path, graph_json):
    folder = tmp_path / "my plugins"  # a space: the command must quote
    folder.mkdir()
    plugin = folder / "boom_plugin.py"
    plugin.write_text(textwrap.dedent(PLUGIN))
    crashes = folder / "crashes"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    argv = ["attnpass", "--load", str(plugin), "run", "-p", "dce,hardening-boom", str(graph_json)]
    done = subprocess.run([*argv, "--reproducer-dir", str(crashes)], capture_output=True, text=True, env=env)
    assert done.returncode == 1
    (repro,) = crashes.iterdir()
    assert json.loads(repro.read_text())["load"] == [str(plugin)]
    replay = done.stderr.splitlines()[-1]
    assert (
        replay == f"replay with: attnpass --load {shlex.quote(str(plugin))} run --reproducer {shlex.quote(str(repro))}"
    )
    again = subprocess.run(replay.removeprefix("replay with: "), shell=True, capture_output=True, text=True, env=env)
    assert again.returncode == 1
    assert again.stderr == "attnpass: error: pass 'hardening-boom' failed (after: none): RuntimeError: boom\n"
    alone = subprocess.run(["attnpass", "run", "--reproducer", str(repro)], capture_output=True, text=True, env=env)
    assert alone.returncode == 1 and alone.stderr.count("\n") == 1
    assert (
        "unknown pass 'hardening-boom'" in alone.stderr and f"needs --load {shlex.quote(str(plugin))}" in alone.stderr
    )


def test_builtin_pass_crashes_record_no_load(cli, graph_json, tmp_path, monkeypatch):
    plugin = tmp_path / "noop_plugin.py"
    plugin.write_text("")
    from attnpass.passes.rewrites import head_chunk

    def explode(*args, **kwargs):
        raise RuntimeError("head-chunk broke")

    monkeypatch.setattr(head_chunk, "head_chunk_plan", explode)
    status, _, err = cli("--load", plugin, "run", "-p", "head-chunk", graph_json, "--reproducer-dir", tmp_path / "c")
    assert status == 1 and err.splitlines()[-1].startswith("replay with: attnpass run --reproducer ")
    (repro,) = (tmp_path / "c").iterdir()
    assert json.loads(repro.read_text())["load"] == []


# ----------------------------------------------------------------------------- item 4: switch typos


def test_an_unrecognised_switch_value_warns_once_per_variable(cli, graph_json, monkeypatch):
    monkeypatch.setenv("ATTNPASS_SDPA_HEAD_CHUNK", "flase")
    status, out, err = cli("explain", "-p", "head-chunk", graph_json)
    assert status == 0 and "[head-chunk] applied sdpa" in out  # the rule stands: only off values turn it off
    assert err == (
        "attnpass: warning: ATTNPASS_SDPA_HEAD_CHUNK='flase' is not a recognised value, so the rewrite stays on; "
        "accepted: false/off/no/0 turn it off, true/on/yes/1 (or unset) leave it on\n"
    )
    assert cli("explain", "-p", "head-chunk,head-chunk", graph_json)[2] == ""  # once per process


def pass_switch(name: str) -> tuple[bool, str]:
    """The switch as the passes read it (SwitchedPass.disabled)."""
    return switches.env_switch(name, None, default=True, subject="the rewrite")


def test_switch_values_and_their_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for value in ("true", " ON ", "Yes", "1", "false", "OFF", "no", "\t0 "):
            os.environ["ATTNPASS_QSA_GATHER"] = value
            assert pass_switch("ATTNPASS_QSA_GATHER")[0] == (value.strip().lower() in ("true", "on", "yes", "1"))
        del os.environ["ATTNPASS_QSA_GATHER"]
        assert pass_switch("ATTNPASS_QSA_GATHER") == (True, "ATTNPASS_QSA_GATHER unset")
    for name in ("ATTNPASS_QSA_GATHER", "ATTNPASS_SDPA_HEAD_CHUNK"):
        os.environ[name] = "enabled"
        try:
            with pytest.warns(switches.SwitchWarning, match=f"{name}='enabled' is not a recognised value"):
                assert pass_switch(name) == (True, f"{name}=enabled")
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                pass_switch(name)  # the second time: silent
        finally:
            del os.environ[name]


# ----------------------------------------------------------------------------- item 5: what starts up

PROBE = """
import sys
from attnpass.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("MODULES", " ".join(sorted({m.split(".")[0] for m in sys.modules} | {m for m in sys.modules if m.startswith("attnpass")})))
"""


def imported_by(*argv: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("MODULES ")]
    return set(line.split()[1:])


def test_help_imports_only_the_parser():
    modules = imported_by("--help")
    assert not modules & {"numpy", "networkx", "jax", "mlx", "ml_dtypes", "attnpass.ir", "attnpass.passes"}
    # cli.launch names the mlx-lm/mlx-vlm commands the parser lists (standard library only)
    assert {m for m in modules if m.startswith("attnpass")} == {
        "attnpass",
        "attnpass.cli",
        "attnpass.cli.main",
        "attnpass.cli.launch",
    }


def test_lower_prints_source_without_importing_the_backend(graph_json):
    modules = imported_by("lower", "-t", "jax", str(graph_json))
    assert "jax" not in modules and "mlx" not in modules and "attnpass.backends" not in modules
    assert "attnpass.lowering" in modules


def test_show_imports_no_lowering_or_backend(graph_json):
    modules = imported_by("show", str(graph_json))
    assert not modules & {"jax", "mlx", "attnpass.lowering", "attnpass.backends", "attnpass.passes"}


def test_importing_the_ir_does_not_import_networkx():
    code = "import sys, attnpass.ir; print('networkx' in sys.modules); attnpass.ir.Graph('g'); print('networkx' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "True"]


def test_help_still_lists_targets_and_documents_the_text_form(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["lower", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--target TARGET, -t TARGET numpy, mlx, jax" in out and "or the printed text form" in out
