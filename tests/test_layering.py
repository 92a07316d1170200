"""The import direction of the layers holds: core IR <- dialects/frontends <- passes/lowering <- models/backends <- cli.

Every ``import``/``from`` statement of every library module (top level or
inside a function) is read with :mod:`ast`; a module may import only from its
own layer and the layers its layer is allowed to see.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# layer -> the layers it may import (besides itself)
ALLOWED = {
    "ir.core": set(),
    "ir.dialects": {"ir.core"},
    "ir.frontends": {"ir.core", "ir.dialects"},
    "ir": {"ir.core", "ir.dialects", "ir.frontends"},
    "passes": {"ir", "ir.core", "ir.dialects", "ir.frontends"},
    "lowering": {"ir", "ir.core", "ir.dialects", "ir.frontends"},
    "models": {"ir", "ir.core", "ir.dialects", "ir.frontends", "passes"},
    "backends": {"ir", "ir.core", "ir.dialects", "ir.frontends", "passes", "lowering"},
    "cli": {"ir", "ir.core", "ir.dialects", "ir.frontends", "passes", "lowering", "models", "backends"},
}


def layer_of(dotted: str) -> str | None:
    """``attnpass.ir.core.graph`` -> ``ir.core``; ``attnpass.passes.rewrites.dce`` -> ``passes``."""
    parts = dotted.split(".")
    if parts[0] != "attnpass" or len(parts) < 2:
        return None
    if parts[1] == "ir" and len(parts) > 2 and f"ir.{parts[2]}" in ALLOWED:
        return f"ir.{parts[2]}"
    return parts[1] if parts[1] in ALLOWED else None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["attnpass", *parts])


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` for every import in ``path`` (relative imports resolved)."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return found


LAYERS = ("ir", "passes", "lowering", "backends", "models", "cli")
LIBRARY = sorted(p for d in LAYERS for p in (ROOT / d).rglob("*.py"))


def test_every_layer_is_known():
    assert LIBRARY
    for path in LIBRARY:
        assert layer_of(module_name(path)) is not None, path


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path: Path):
    mine = layer_of(module_name(path))
    wrong = []
    for line, target in imported_modules(path):
        theirs = layer_of(target)
        if theirs is not None and theirs != mine and theirs not in ALLOWED[mine]:
            wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_the_checker_resolves_relative_imports_to_layers():
    imports = {target for _line, target in imported_modules(ROOT / "ir" / "core" / "graph.py")}
    assert "attnpass.ir.core.registry.get_op" in imports
    assert layer_of("attnpass.ir.core.registry.get_op") == "ir.core"
    assert layer_of("attnpass.passes.infra.manager.PassManager") == "passes"
    assert "passes" not in ALLOWED["lowering"] and "backends" not in ALLOWED["passes"]


def module_of(target: str, modules: set[str]) -> str | None:
    """The library module an imported name lives in: ``attnpass.passes.rewrites.dce.DeadCodeElimination`` ->
    ``attnpass.passes.rewrites.dce``; ``attnpass.passes.analysis.layout_algebra`` (a submodule imported by name) -> itself."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def import_cycles() -> list[set[str]]:
    """The cycles of module imports inside the library (every import: top level, deferred or for type checkers)."""
    import networkx as nx

    modules = {module_name(p) for p in LIBRARY}
    graph = nx.DiGraph()
    for path in LIBRARY:
        me = module_name(path)
        for _line, target in imported_modules(path):
            found = module_of(target, modules)
            if found is not None and found != me and not me.startswith(found + "."):  # a parent package: not a cycle
                graph.add_edge(me, found)
    return [set(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


# The cycles docs/architecture.md names and justifies ("Import cycles"); a new one fails until it is named there too.
KNOWN_CYCLES = [
    {"attnpass.ir.core." + m for m in ("graph", "printer", "serialize", "sharding", "verifier")},
    {"attnpass.ir.frontends.ops", "attnpass.ir.frontends.tracer"},
    {
        "attnpass.passes.infra." + m
        for m in ("base", "instrument", "manager", "pipeline_text", "registry", "reproducer")
    },
]


def test_the_lowering_package_has_no_import_cycle():
    assert not [c for c in import_cycles() if any(m.startswith("attnpass.lowering.") for m in c)]


# Inside passes/: the infrastructure knows no analysis or rewrite, the analyses know no rewrite.
PASSES_ALLOWED = {"infra": set(), "analysis": {"infra"}, "rewrites": {"infra", "analysis"}}


@pytest.mark.parametrize("part", sorted(PASSES_ALLOWED))
def test_passes_folders_import_one_way(part: str):
    modules = {module_name(p) for p in LIBRARY}
    wrong = []
    for path in sorted((ROOT / "passes" / part).rglob("*.py")):
        for line, target in imported_modules(path):
            found = module_of(target, modules) or ""
            theirs = found.split(".")[2] if found.startswith("attnpass.passes.") and found.count(".") >= 3 else None
            if theirs in PASSES_ALLOWED and theirs != part and theirs not in PASSES_ALLOWED[part]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} (passes/{part}) imports {found}")
    assert not wrong, "\n".join(wrong)


def test_the_import_cycles_are_the_named_ones():
    assert sorted(map(sorted, import_cycles())) == sorted(map(sorted, KNOWN_CYCLES))
    page = (ROOT / "docs" / "architecture.md").read_text()
    for cycle in KNOWN_CYCLES:
        for module in cycle:
            assert f"`{module.rsplit('.', 1)[1]}`" in page, f"docs/architecture.md does not name {module}"


def test_every_library_package_is_installed():
    """pyproject.toml lists the packages a plain ``pip install .`` copies: every folder of the library is one."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {module_name(p) for p in LIBRARY if p.name == "__init__.py"}
    assert packages - listed == set(), "add them to [tool.setuptools] packages"
    assert listed - packages == set(), "pyproject.toml lists packages the library does not have"


def test_no_script_edits_sys_path():
    """Examples, benchmarks and tests import what they need as installed or from a path, never by editing
    ``sys.path`` (a script's own folder is on it already when it runs)."""
    scripts = [p for d in ("examples", "benchmarks", "tests", *LAYERS) for p in (ROOT / d).rglob("*.py")]
    edits = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for p in scripts
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr in ("insert", "append", "extend")
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "path"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "sys"
    ]
    assert edits == [], f"sys.path edited at {', '.join(edits)}"
