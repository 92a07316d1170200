"""README.md cannot rot: its python blocks run in order and print the output blocks shown after them, its `$ attnpass`
commands run and print what it shows."""

from __future__ import annotations

import re
import shlex
import sys
import types
from pathlib import Path

import pytest

from attnpass.cli.main import main
from attnpass.passes import registry
from tests.util import requires

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = README.read_text()


@pytest.fixture(autouse=True)
def sandbox(monkeypatch, tmp_path):
    """Files the README writes go to a temporary directory; passes it registers stay in the test."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))


def blocks(language: str) -> list[tuple[int, str]]:
    """(line number, body) of every fenced block of ``language``."""
    return [
        (TEXT[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(rf"^```{language}\n(.*?)^```$", TEXT, flags=re.DOTALL | re.MULTILINE)
    ]


def test_the_top_of_the_readme_is_make_demo_then_make_test():
    assert TEXT.split("```")[1].split() == ["make", "demo", "make", "test"]


@requires("mlx.core", "jax", "mlx_lm", graphviz=True)
def test_python_blocks_run_in_order(capsys, monkeypatch):
    python = blocks("python")
    assert len(python) == 14
    module = types.ModuleType("readme")  # one module for all blocks, as if the README were a script
    monkeypatch.setitem(sys.modules, "readme", module)
    for line, body in python:
        try:
            exec(compile(body, f"{README}:{line}", "exec"), module.__dict__)
        except Exception as exc:
            pytest.fail(f"README.md python block at line {line} failed: {type(exc).__name__}: {exc}")
    out = capsys.readouterr().out
    assert "attnpass.backends.mlx.compile(decode): 1 signature(s) cached, 1 trace(s)" in out and "(1, 8, 4, 64) 1" in out
    assert re.search(r"<OptimizedModel Model \(restored\): 2 trace\(s\), \d+ routed>", out)
    assert "model.layers.0.self_attn.q_proj.weight" in out and "24 query heads over 2 KV heads (GQA 12)" in out
    assert Path("verify.json").is_file() and Path("verify.safetensors").is_file()
    assert "[head-chunk] applied sdpa: q_len*gqa = 60 > 32 (q_len 5, gqa 12): 4 subcalls" in out
    assert "// after head-chunk" in out and "// 13 added, 1 removed, 0 changed (nodes 5 -> 17, inputs 4 -> 4)" in out
    assert "head-chunk{budget=16},count-sdpa{warn_above=4},dce" in out
    assert "[count-sdpa] analysis: 8 sdpa call(s) (too many)" in out
    assert "[qsa-pool-cache] applied qsa_block_scores: block keys concat (qsa_pool of idx_keys) now come from" in out
    assert "up to the block keys run on the new block(s) only, not on 24 (each new block is replayed as row 0" in out
    assert "[decompose-sdpa] applied sdpa_gather: strategy decomposed (device cpu)" in out
    assert "(('idx_keys_blocks', 1),)" in out
    assert "[square-causal] applied sdpa: causal top_left -> bottom_right (" in out
    assert re.search(r"replay with: attnpass run --reproducer crashes/attnpass-crash-[0-9a-f]{8}\.json", out)
    assert "func.func public @main(%arg0: tensor<1x24x5x256xbf16>" in out
    assert Path("chunked.svg").read_text().lstrip().startswith("<?xml")
    assert "\n0.0009765625\n" in out  # the bf16 error the Lower block's comment states
    printed, shown = out.splitlines(), shown_outputs()
    assert len(shown) >= 7
    for line, rows in shown:
        for row in rows:
            pattern = _pattern(row.replace("...", "…"))
            assert any(pattern.match(got) for got in printed), f"README.md:{line}: no printed line starts like\n{row}"


def shown_outputs() -> list[tuple[int, list[str]]]:
    """(line, rows) of every plain block right after a python block: what that block prints ('…', '...': any text;
    a row may stop short of the printed line)."""
    found = re.finditer(r"^```python\n.*?^```\n\n```\n(.*?)^```$", TEXT, flags=re.DOTALL | re.MULTILINE)
    return [(TEXT[: m.start(1)].count("\n") + 1, m.group(1).splitlines()) for m in found]


def _pattern(shown: str) -> re.Pattern:
    """A shown output line; '…' stands for any text."""
    return re.compile(".*".join(re.escape(part) for part in shown.split("…")))


@requires("mlx.core", "jax", graphviz=True)
def test_command_line_examples_run_and_print_what_the_readme_shows(capsys):
    (line, body), *more = blocks("console")
    assert not more
    commands: list[tuple[str, list[str]]] = []
    for row in body.splitlines():
        if row.startswith("$ "):
            commands.append((row[2:], []))
        else:
            commands[-1][1].append(row)
    assert len(commands) >= 12
    for command, shown in commands:
        argv = shlex.split(command)
        assert argv[0] == "attnpass", command
        redirect = argv.index(">") if ">" in argv else None
        status = main(argv[1:redirect])
        out, err = capsys.readouterr()
        assert status == 0, f"README.md:{line}: `{command}` exited {status}: {err}"
        if redirect is not None:
            Path(argv[redirect + 1]).write_text(out)
        lines = out.splitlines()
        for row in shown:
            pattern = _pattern(row)
            assert any(pattern.fullmatch(got) for got in lines), f"`{command}` did not print:\n{row}"
