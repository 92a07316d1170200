"""The README and docs/ cannot rot: each page's python blocks run in order, as one script per page, and print the
output blocks shown after them; docs/cli.md's `$ attnpass` commands run and print what it shows."""

from __future__ import annotations

import re
import shlex
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

from attnpass.cli.main import main
from attnpass.passes.infra import registry
from tests.util import requires

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Page:
    """A page with python blocks: how many, what they need installed, and lines its output must contain."""

    blocks: int
    needs: tuple[str, ...] = ()
    graphviz: bool = False
    prints: tuple[str, ...] = ()
    files: tuple[str, ...] = ()  # what the page's blocks write


PAGES = {
    "README.md": Page(
        2,
        ("mlx.core", "mlx_lm"),
        prints=(
            "attnpass.backends.mlx.compile(decode): 1 signature(s) cached, 1 trace(s)",
            "<OptimizedModel Model (restored): 1 trace(s), 0 routed>",  # on CPU: every call under MIN_KEYS
            "declined: 36 x short_context",
        ),
    ),
    "docs/dropin.md": Page(1, ("jax",), prints=("(1, 8, 4, 64) 1",)),
    "docs/guide.md": Page(
        10,
        ("mlx.core", "jax", "mlx_lm"),
        graphviz=True,
        prints=(
            "model.layers.0.self_attn.q_proj.weight",
            "24 query heads over 2 KV heads (GQA 12)",
            "[head-chunk] applied sdpa: q_len*gqa = 60 > 32 (q_len 5, gqa 12): 4 subcalls",
            "// after head-chunk",
            "// 13 added, 1 removed, 0 changed (nodes 5 -> 17, inputs 4 -> 4)",
            "head-chunk{budget=16},count-sdpa{warn_above=4},dce",
            "[count-sdpa] analysis: 8 sdpa call(s) (too many)",
            "[square-causal] applied sdpa: causal top_left -> bottom_right (",
            "func.func public @main(%arg0: tensor<1x24x5x256xbf16>",
            "\n0.0009765625\n",  # the bf16 error the Lower block's comment states
        ),
        files=("verify.json", "verify.safetensors", "chunked.svg", "chunked.mlxfn"),
    ),
    "docs/qsa.md": Page(
        1,
        ("mlx.core",),
        prints=(
            "[qsa-pool-cache] applied qsa_block_scores: block keys concat (qsa_pool of idx_keys) now come from",
            "up to the block keys run on the new block(s) only, not on 24 (each new block's sums run over it as row 0",
            "[decompose-sdpa] applied sdpa_gather: strategy decomposed (device cpu)",
            "(('idx_keys_blocks', 1),)",
        ),
    ),
    "docs/semantics.md": Page(6),
    "docs/numerics.md": Page(1, ("jax",)),
    "docs/mla.md": Page(1, prints=("mla-absorb applied {'rows': 3, 'crossover': 43.5}",)),
}


def text(page: str) -> str:
    return (ROOT / page).read_text()


def blocks(page: str, language: str) -> list[tuple[int, str]]:
    """(line number, body) of every fenced block of ``language`` in ``page``."""
    body = text(page)
    return [
        (body[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(rf"^```{language}\n(.*?)^```$", body, flags=re.DOTALL | re.MULTILINE)
    ]


def test_the_top_of_the_readme_is_make_demo_then_make_test():
    assert text("README.md").split("```")[1].split() == ["make", "demo", "make", "test"]


def test_the_readme_is_short_and_every_page_with_python_blocks_runs():
    assert len(text("README.md").splitlines()) <= 200
    pages = ["README.md", *(p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md")))]
    with_blocks = {page for page in pages if blocks(page, "python")}
    assert with_blocks == set(PAGES), "a page with python blocks that no test runs, or a page that lost them"


def test_links_between_pages_resolve():
    for page in ["README.md", *(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", text(page)):
            assert (ROOT / page).parent.joinpath(target).resolve().is_file(), f"{page}: link to missing {target}"


def _page_params() -> list:
    return [
        pytest.param(page, spec, marks=requires(*spec.needs, graphviz=spec.graphviz), id=page)
        for page, spec in PAGES.items()
    ]


@pytest.mark.parametrize(("page", "spec"), _page_params())
def test_python_blocks_run_in_order(page, spec, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # files a page writes go to a temporary directory
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # passes it registers stay in the test
    python = blocks(page, "python")
    assert len(python) == spec.blocks
    module = types.ModuleType("docs_page")  # one module for all blocks, as if the page were a script
    monkeypatch.setitem(sys.modules, "docs_page", module)
    for line, body in python:
        try:
            exec(compile(body, f"{ROOT / page}:{line}", "exec"), module.__dict__)
        except Exception as exc:
            pytest.fail(f"{page} python block at line {line} failed: {type(exc).__name__}: {exc}")
    out = capsys.readouterr().out
    for expected in spec.prints:
        assert expected in out, f"{page}: the output lacks {expected!r}"
    for name in spec.files:
        assert (tmp_path / name).stat().st_size > 0, f"{page}: no {name} written"
    printed = out.splitlines()
    for line, rows in shown_outputs(page):
        for row in rows:
            pattern = _pattern(row.replace("...", "…"))
            assert any(pattern.match(got) for got in printed), f"{page}:{line}: no printed line starts like\n{row}"


def shown_outputs(page: str) -> list[tuple[int, list[str]]]:
    """(line, rows) of every plain block right after a python block: what that block prints ('…', '...': any text;
    a row may stop short of the printed line)."""
    body = text(page)
    found = re.finditer(r"^```python\n.*?^```\n\n```\n(.*?)^```$", body, flags=re.DOTALL | re.MULTILINE)
    return [(body[: m.start(1)].count("\n") + 1, m.group(1).splitlines()) for m in found]


def _pattern(shown: str) -> re.Pattern:
    """A shown output line; '…' stands for any text."""
    return re.compile(".*".join(re.escape(part) for part in shown.split("…")))


@requires("mlx.core", "jax", graphviz=True)
def test_command_line_examples_run_and_print_what_the_page_shows(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (line, body), *more = blocks("docs/cli.md", "console")
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
        assert status == 0, f"docs/cli.md:{line}: `{command}` exited {status}: {err}"
        if redirect is not None:
            Path(argv[redirect + 1]).write_text(out)
        lines = out.splitlines()
        for row in shown:
            pattern = _pattern(row)
            assert any(pattern.fullmatch(got) for got in lines), f"`{command}` did not print:\n{row}"
