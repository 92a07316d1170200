"""The ``attnpass`` command line: every subcommand, its output, and its errors (one line, no traceback)."""

from __future__ import annotations

import importlib.metadata
import io
import json
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from attnpass.cli.main import build_parser, main
from attnpass.ir import Graph
from attnpass.ir.core import rendering as render_module
from attnpass.models import verify_step
from attnpass.passes import PassManager, parse_pipeline
from attnpass.passes.infra import registry
from tests.util import lazy_import, requires

mx = lazy_import("mlx.core")

PIPELINE = "dce,head-chunk,qsa-gather,narrow-inputs"
SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(autouse=True)
def private_registry(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


@pytest.fixture
def verify_json(tmp_path, cli) -> Path:
    path = tmp_path / "verify.json"
    assert cli("example", "qwen38-verify", "--n-kv", 64, "-o", path)[0] == 0
    return path


@pytest.fixture
def chunked_json(tmp_path, cli, verify_json) -> Path:
    path = tmp_path / "chunked.json"
    assert cli("run", "--pipeline", PIPELINE, verify_json, "-o", path)[0] == 0
    return path


def load(path: Path) -> Graph:
    return Graph.from_json(path.read_text())


# ----------------------------------------------------------------------------- examples, show


def test_example_lists_and_writes_the_builtin_graphs(cli, tmp_path):
    status, out, _ = cli("example")
    assert status == 0
    assert "qwen38-verify  (--q-len 4 --n-kv 4096)" in out and "try: --pipeline 'head-chunk'" in out
    assert "qwen38-qsa-decode  (--n-kv 8192)" in out and "qwen38-model  (--layers 48 --q-len 4 --n-kv 8192)" in out

    status, out, _ = cli("example", "qwen38-verify")
    assert status == 0 and Graph.from_json(out) == verify_step(4, 4096)
    assert cli("example", "qwen38-qsa-decode", "--n-kv", 4608, "-o", tmp_path / "qsa.json")[0] == 0
    assert load(tmp_path / "qsa.json").node("k_cache").type.shape == (1, 2, 4608, 256)
    assert cli("example", "qwen38-model", "--layers", 4, "--n-kv", 4608, "-o", tmp_path / "m.json")[0] == 0
    ops = [n.op for n in load(tmp_path / "m.json").nodes()]
    assert ops.count("sdpa") == 4 and ops.count("qsa_select") == 1  # layer 3 is the QSA layer


def test_show_prints_the_text_form_from_a_file_or_stdin(cli, verify_json, monkeypatch):
    graph = load(verify_json)
    assert cli("show", verify_json) == (0, f"{graph}\n", "")
    status, out, _ = cli("show", "--locs", verify_json)
    assert "  # " in out and "qwen38.py:" in out
    monkeypatch.setattr(sys, "stdin", io.StringIO(str(graph)))  # the printed text form is accepted too
    assert cli("show", "-") == (0, f"{graph}\n", "")


# ----------------------------------------------------------------------------- run, explain, diff


def test_run_applies_the_pipeline_prints_remarks_and_saves(cli, verify_json, tmp_path):
    out_path = tmp_path / "out.json"
    status, out, err = cli("run", "-p", PIPELINE, verify_json, "-o", out_path, "--timings", "--print-after-change")
    assert status == 0 and err == ""
    expected = PassManager(parse_pipeline(PIPELINE)).run(load(verify_json)).graph
    assert load(out_path) == expected
    assert out.count("// after ") == 1 and f"// after head-chunk\n{expected}\n" in out
    assert "[head-chunk] applied sdpa: q_len*gqa = 48 > 32 (q_len 4, gqa 12): 4 subcalls" in out
    assert (
        "[dce] declined (no_candidates): no dead values" in out and "[narrow-inputs] declined mask (read_whole):" in out
    )
    table = out[out.index("pass ") :].splitlines()
    assert table[0].split() == ["pass", "runs", "total", "ms", "%"]
    assert [row.split()[0] for row in table[1:6]] == ["dce", "head-chunk", "qsa-gather", "narrow-inputs", "total"]
    assert out.rstrip().endswith(f"// wrote {out_path}: changed, 5 -> 17 nodes")


def test_run_without_output_prints_the_result(cli, verify_json):
    status, out, _ = cli("run", "-p", "head-chunk{budget=64}", verify_json)
    assert status == 0
    assert "[head-chunk] declined sdpa (fused_kernel_serves): q_len*gqa = 48 <= 64" in out
    assert out.endswith(f"{load(verify_json)}\n")


def test_explain_prints_applied_and_declined_remarks_only(cli, verify_json):
    status, out, _ = cli("explain", "--pipeline", PIPELINE, verify_json)
    assert status == 0 and "graph attention" not in out
    assert (
        "[head-chunk] applied sdpa:" in out
        and "[qsa-gather] declined sdpa_c0 (mask_not_selection): masked path kept" in out
    )
    assert out.endswith(
        "// dce: 0 applied, 1 declined\n// head-chunk: 1 applied, 0 declined\n"
        "// qsa-gather: 0 applied, 4 declined\n// narrow-inputs: 0 applied, 4 declined\n"
    )


def test_diff_shows_a_unified_diff_and_the_node_summary(cli, verify_json, chunked_json):
    status, out, _ = cli("diff", verify_json, chunked_json)
    assert status == 0
    lines = out.splitlines()
    assert lines[:2] == [f"--- {verify_json}", f"+++ {chunked_json}"]
    assert "-  sdpa:bf16[1,24,4,256] = sdpa[scale=0.0625, causal='none'] q k_cache v_cache mask=mask" in lines
    assert "+  sdpa_heads:bf16[1,24,4,256] = concat[axis=1] sdpa_c0 sdpa_c1 sdpa_c2 sdpa_c3" in lines
    assert "// 13 added, 1 removed, 0 changed (nodes 5 -> 17, inputs 4 -> 4)" in lines
    assert any(line.startswith("added (8 slice, 4 sdpa, 1 concat): sdpa_k0, sdpa_v0, sdpa_q0") for line in lines)
    assert "removed (1 sdpa): sdpa" in lines
    assert cli("diff", "--exit-code", verify_json, chunked_json)[0] == 1

    status, out, _ = cli("diff", "--exit-code", verify_json, verify_json)
    assert status == 0 and not out.startswith("---")
    assert out.splitlines()[0] == "// 0 added, 0 removed, 0 changed (nodes 5 -> 5, inputs 4 -> 4)"
    assert "(structurally equal)" in out


# ----------------------------------------------------------------------------- render


def _node_fills(svg_path: Path) -> dict[str, set[str]]:
    """node title -> the fill colours drawn in its group."""
    root = ET.parse(svg_path).getroot()
    fills = {}
    for group in root.iter(f"{SVG}g"):
        if group.get("class") == "node":
            title = group.find(f"{SVG}title").text
            fills[title] = {e.get("fill") for e in group if e.get("fill") not in (None, "none")}
    return fills


@requires(graphviz=True)
def test_render_svg_highlights_what_the_pipeline_rewrote(cli, verify_json, chunked_json, tmp_path):
    svg = tmp_path / "chunked.svg"
    status, out, _ = cli("render", chunked_json, "-o", svg, "--highlight-against", verify_json)
    assert status == 0 and out == f"// wrote {svg}\n"
    fills = _node_fills(svg)
    after = load(chunked_json)
    assert set(fills) == {n.name for n in after.nodes()}
    highlighted = {name for name, colours in fills.items() if render_module.ADDED in colours}
    assert highlighted == {n.name for n in after.nodes()} - set(after.inputs)  # every non-input node is new
    assert fills["q"] == {render_module.STREAMED} and fills["k_cache"] == {render_module.RESIDENT}
    assert "13 added (orange), 0 changed (yellow), 1 removed (sdpa)" in svg.read_text()


@requires(graphviz=True)
def test_render_png_and_dot(cli, verify_json, chunked_json, tmp_path):
    png = tmp_path / "g.png"
    assert cli("render", chunked_json, "-o", png)[0] == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 500 and height > 200  # 17 nodes laid out, not an empty canvas

    dot = tmp_path / "g.dot"
    assert cli("render", chunked_json, "-o", dot, "--highlight-against", verify_json)[0] == 0
    text = dot.read_text()
    assert text.startswith('digraph "attention" {') and '"sdpa_q0" -> "sdpa_c0";' in text
    label = "sdpa_heads = concat\\n[axis=1]\\nbf16[1,24,4,256]"
    assert f'"sdpa_heads" [label="{label}", fillcolor="{render_module.ADDED}", peripheries=2];' in text


def test_render_without_graphviz_says_how_to_get_it(cli, verify_json, tmp_path, monkeypatch):
    monkeypatch.setattr(render_module, "DOT_PROGRAMS", ("attnpass-no-such-dot",))
    status, out, err = cli("render", verify_json, "-o", tmp_path / "g.svg")
    assert status == 1 and out == ""
    assert err == (
        "attnpass: error: rendering SVG/PNG needs Graphviz: pip install 'attnpass[render]' (graphviz-pure), "
        "or write DOT with -o FILE.dot\n"
    )
    assert cli("render", verify_json, "-o", tmp_path / "g.dot")[0] == 0  # DOT needs no binary


# ----------------------------------------------------------------------------- lower, export, passes


@pytest.mark.parametrize(
    "target, call",
    [
        ("numpy", "ref.sdpa("),
        pytest.param("mlx", "mx.fast.scaled_dot_product_attention", marks=requires("mlx.core")),
        pytest.param("jax", "jax.nn.dot_product_attention", marks=requires("jax")),
    ],
)
def test_lower_prints_the_generated_source(cli, verify_json, target, call):
    status, out, _ = cli("lower", "--target", target, verify_json)
    assert status == 0
    assert f'def attention(q, k_cache, v_cache, mask):\n    """{target} program for graph attention' in out
    assert call in out and "# sdpa:bf16[1,24,4,256]" in out
    assert "#" not in cli("lower", "-t", target, "--no-comments", verify_json)[1].split('"""')[-1]


@requires("mlx.core", "jax")
def test_export_writes_mlxfn_and_stablehlo(cli, chunked_json, tmp_path):
    mlxfn = tmp_path / "out.mlxfn"
    assert cli("export", "--target", "mlx", chunked_json, "-o", mlxfn) == (
        0, f"// wrote {mlxfn} (load it with mlx.core.import_function)\n", ""
    )  # fmt: skip
    _, metadata = mx.import_function(str(mlxfn), return_metadata=True)
    assert json.loads(metadata)["inputs"] == ["q", "k_cache", "v_cache", "mask"]

    status, out, _ = cli("export", "--target", "stablehlo", chunked_json)
    assert status == 0 and out.startswith("module @jit_attention") and out.count("stablehlo.exponential") == 4
    assert cli("export", "-t", "stablehlo", chunked_json, "-o", tmp_path / "out.mlir")[0] == 0
    assert (tmp_path / "out.mlir").read_text().rstrip("\n") == out.rstrip("\n")


def test_passes_lists_names_and_typed_options(cli):
    status, out, _ = cli("passes")
    assert status == 0
    assert "head-chunk  (attnpass.passes.rewrites.head_chunk.HeadChunkSDPA)" in out
    assert "    option budget: int = 32" in out and "    option min_depth_factor: float = 2" in out
    assert "    option rules (not settable from text)" in out


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "argv, message",
    [
        (["show", "missing.json"], "No such file or directory: missing.json"),
        (["show", "{bad}"], "{bad}: malformed JSON: Expecting value"),
        (
            ["run", "-p", "dce,fuse", "{graph}"],
            "unknown pass 'fuse'; available passes: block-sparse, canonicalize, dce, decompose-sdpa",
        ),
        (["run", "-p", "head-chunk{budget=x}", "{graph}"], "pass head-chunk: option budget: expected int, got 'x'"),
        (["run", "{graph}"], "give --pipeline TEXT and a GRAPH file (or --reproducer FILE)"),
        (["run", "--reproducer", "{graph}", "-p", "dce"], "--reproducer replays a saved crash"),
        (["run", "--reproducer", "{graph}"], "not an attnpass crash reproducer"),
        (["example", "qwen38-prefill"], "unknown example 'qwen38-prefill'; examples: qwen38-verify"),
        (["example", "qwen38-verify", "--layers", "2"], "example qwen38-verify has no option layers"),
        (["example", "qwen38-verify", "--q-len", "0"], "example qwen38-verify: q_len must be >= 1, got 0"),
        (["render", "{graph}", "-o", "g.pdf"], "cannot render to 'g.pdf': the file name must end in .svg, .png or"),
        (["export", "-t", "mlx", "{graph}"], "--target mlx writes a binary .mlxfn file: give -o FILE.mlxfn"),
        (["--load", "no_such_plugin_module", "passes"], "--load no_such_plugin_module: No module named"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_on_stderr(cli, tmp_path, verify_json, argv, message):
    (tmp_path / "bad.json").write_text('{"format": ')
    paths = {"{graph}": str(verify_json), "{bad}": str(tmp_path / "bad.json")}
    status, out, err = cli(*[paths.get(a, a) for a in argv])
    assert status == 1 and out == ""
    assert err.startswith("attnpass: error: ") and err.count("\n") == 1
    assert message.format(bad=paths["{bad}"]) in err


SUBCOMMANDS = ["show", "run", "explain", "diff", "render", "lower", "export", "example", "passes"]


@pytest.mark.parametrize("command", [None, *SUBCOMMANDS])
def test_help_everywhere(command, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, "--help"] if command else ["--help"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("usage: attnpass")


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["lower", "--target", "tpu", "g.json"], ["diff", "only-one.json"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- plugins and crashes

PLUGIN = '''
from dataclasses import dataclass
from typing import ClassVar

from attnpass.passes import Pass, register_pass


@register_pass
@dataclass(frozen=True)
class Explode(Pass):
    """Fails on graphs with an sdpa."""

    name: ClassVar[str] = "cli-explode"
    why: str = "boom"

    def run(self, graph, remarks):
        if any(n.op == "sdpa" for n in graph.nodes()):
            raise RuntimeError(self.why)
        return False
'''


def test_plugin_pass_crash_writes_a_reproducer_that_the_cli_replays(cli, verify_json, tmp_path, monkeypatch):
    plugin = tmp_path / "cli_plugin.py"
    plugin.write_text(textwrap.dedent(PLUGIN))
    monkeypatch.delitem(sys.modules, "cli_plugin", raising=False)
    crashes = tmp_path / "crashes"
    status, out, err = cli(
        "--load", plugin, "run", "-p", "dce,cli-explode{why=kaboom}", verify_json, "--reproducer-dir", crashes
    )
    assert status == 1
    (repro,) = crashes.iterdir()
    assert err.splitlines() == [
        "attnpass: error: pass 'cli-explode' failed (after: dce): RuntimeError: kaboom",
        f"crash reproducer: {repro}",
        f"replay with: attnpass --load {plugin} run --reproducer {repro}",
    ]
    assert json.loads(repro.read_text())["pipeline"] == "cli-explode{why=kaboom}"

    status, out, err = cli("--load", plugin, "run", "--reproducer", repro)
    assert status == 1
    assert out == f"// replaying {repro}: pipeline 'cli-explode{{why=kaboom}}' (ran after: dce)\n"
    assert err == "attnpass: error: pass 'cli-explode' failed (after: none): RuntimeError: kaboom\n"
    assert list(crashes.iterdir()) == [repro]

    monkeypatch.setattr(registry, "_REGISTRY", {k: v for k, v in registry._REGISTRY.items() if k != "cli-explode"})
    status, _, err = cli("run", "--reproducer", repro)
    assert status == 1 and err.startswith("attnpass: error: unknown pass 'cli-explode'")


EP_PLUGIN = '''
from dataclasses import dataclass
from typing import ClassVar

from attnpass.passes import Pass


@dataclass(frozen=True)
class Note(Pass):
    """Leaves a note."""

    name: ClassVar[str] = "ep-note"
    text: str = "hello"

    def run(self, graph, remarks):
        remarks.analysis(None, self.text)
        return False
'''


def test_entry_point_passes_are_listed_and_usable(cli, verify_json, tmp_path, monkeypatch):
    (tmp_path / "ep_cli_plugin.py").write_text(textwrap.dedent(EP_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ep_cli_plugin", raising=False)
    eps = {
        "ep-note": importlib.metadata.EntryPoint("ep-note", "ep_cli_plugin:Note", registry.ENTRY_POINT_GROUP),
        "ep-broken": importlib.metadata.EntryPoint("ep-broken", "ep_cli_plugin:Gone", registry.ENTRY_POINT_GROUP),
    }
    monkeypatch.setattr(registry, "_entry_points", lambda: eps)
    status, out, _ = cli("passes")
    assert status == 0 and "ep-note  (ep_cli_plugin.Note)\n    Leaves a note.\n    option text: str = hello" in out
    assert "ep-broken  (not loadable: pass 'ep-broken': loading entry point 'ep_cli_plugin:Gone' failed" in out
    status, out, _ = cli("explain", "-p", "ep-note{text=hi there}", verify_json)
    assert status == 0 and out.splitlines()[0] == "[ep-note] analysis: hi there"


def test_installed_console_script(tmp_path):
    script = Path(sys.executable).with_name("attnpass")
    done = subprocess.run([script, "show", tmp_path / "missing.json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == f"attnpass: error: No such file or directory: {tmp_path / 'missing.json'}\n"
    module = [sys.executable, "-m", "attnpass.cli", "--version"]
    done = subprocess.run(module, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("attnpass ")
