"""Remarks as data: every reason code the passes give is in their table (:data:`attnpass.passes.REASONS`), every
code the mlx router gives in its own or the passes' (``ROUTER_REASONS``, backends/mlx/reasons.py), every code of
each table is given somewhere, and a remark's fields reach its text and the JSON the CLI writes."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

import attnpass.passes
from attnpass.cli.output import remarks_json
from attnpass.ir import SourceLoc, TensorSpec, ops, trace
from attnpass.passes import REASONS, PassManager, Remark, Remarks

PASSES_DIR = Path(attnpass.passes.__file__).parent
# the router's declines (backends/mlx) take their codes from its table or the passes'; read as source, without mlx
ROUTER_DIR = Path(importlib.util.find_spec("attnpass.backends").submodule_search_locations[0]) / "mlx"


def _router_reasons() -> dict[str, str]:
    """backends/mlx/reasons.py's table, loaded from its file (importing the package would import MLX)."""
    spec = importlib.util.spec_from_file_location("attnpass_router_reasons", ROUTER_DIR / "reasons.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ROUTER_REASONS


ROUTER_REASONS = _router_reasons()
DECLINES = ("Decline", "_kept")  # the record of a failed precondition, and the helpers that wrap it
SINKS = ("applied", "declined", "analysis")  # the Remarks methods


def _modules(*roots: Path) -> dict[str, ast.Module]:
    return {
        str(p.relative_to(root.parent)): ast.parse(p.read_text())
        for root in roots or (PASSES_DIR, ROUTER_DIR)
        for p in sorted(root.rglob("*.py"))
    }


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _code_of(call: ast.Call) -> ast.expr | None:
    """The reason argument of a Decline (first) or a Remarks call (``reason=``); None when there is none."""
    if _name(call) in DECLINES:
        return call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "reason"), None)
    return next((k.value for k in call.keywords if k.arg == "reason"), None)


def _is_table(node: ast.AST) -> bool:
    names = ("REASONS", "ROUTER_REASONS")
    return isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names


def test_every_code_a_pass_gives_is_in_the_table():
    """A Decline's reason and a remark's ``reason=`` are literal codes of the table, or a decline's code passed on."""
    bad, seen = [], 0
    for path, module in _modules().items():
        table = REASONS if path.startswith(PASSES_DIR.name) else REASONS | ROUTER_REASONS
        for call in (n for n in ast.walk(module) if isinstance(n, ast.Call)):
            name = _name(call)
            if name not in DECLINES + SINKS or (name in SINKS and not isinstance(call.func, ast.Attribute)):
                continue
            if name in DECLINES and call.args and isinstance(call.args[0], ast.Name):
                continue  # the definition of a helper's pass-through (def _kept(reason, why): Decline(reason, ...))
            code = _code_of(call)
            where = f"{path}:{call.lineno}"
            if code is None:
                if name in ("Decline", "_kept", "declined"):
                    bad.append(f"{where}: {name} without a reason code")
                continue
            seen += 1
            if isinstance(code, ast.Attribute) and code.attr == "reason":
                continue  # a nested decline's code, passed on unchanged
            if not (isinstance(code, ast.Constant) and code.value in table):
                bad.append(f"{where}: {ast.unparse(code)} is not a code of REASONS (or, in the router, ROUTER_REASONS)")
    assert not bad, "\n".join(bad)
    assert seen > 100  # the scan found the passes' declines


def _literals(modules: dict[str, ast.Module]) -> set[str]:
    """Every string constant of ``modules`` outside the reason tables themselves."""
    literals: set[str] = set()
    for module in modules.values():
        skip = {id(n) for stmt in module.body if _is_table(stmt) for n in ast.walk(stmt)}
        literals |= {
            n.value for n in ast.walk(module) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            if id(n) not in skip
        }  # fmt: skip
    return literals


def test_every_code_in_the_tables_is_given_somewhere():
    assert sorted(set(REASONS) - _literals(_modules())) == []
    assert sorted(set(ROUTER_REASONS) - _literals(_modules(ROUTER_DIR))) == []
    assert not set(REASONS) & set(ROUTER_REASONS)  # one table per code


def test_codes_are_snake_case_and_a_remark_refuses_prose_as_its_code():
    assert all(code.replace("_", "").isalpha() and code.islower() for code in REASONS | ROUTER_REASONS)
    with pytest.raises(ValueError, match="reason must be a snake_case code, got 'too hot'"):
        Remark("p", "declined", "x", "too hot", "the message")
    with pytest.raises(TypeError):
        Remarks("p").declined("x", "a decline needs its code")  # reason= is required


def test_the_text_form_shows_the_rule_and_the_code_only_where_they_add_something():
    loc = SourceLoc("m.py", 3, "f")
    assert str(Remark("p", "applied", "n", "applied", "did it", loc)) == "[p] applied n: did it (m.py:3 in f)"
    assert str(Remark("p", "applied", "n", "applied", "did it", rule="r")) == "[p] applied n (r): did it"
    assert str(Remark("p", "declined", "n", "not_causal", "why", rule="p")) == "[p] declined n (not_causal): why"
    assert str(Remark("p", "declined", None, "busy", "why", rule="r")) == "[p] declined (r, busy): why"


def test_remarks_json_writes_every_field():
    graph = trace(lambda x: ops.exp(x) * 0.0 + ops.exp(x), TensorSpec((2, 3)))
    result = PassManager([attnpass.passes.RaiseAttention()]).run(graph)
    rows = json.loads(remarks_json(result.remarks, lambda f: f))
    assert len(rows) == len(result.remarks) > 1
    for row, r in zip(rows, result.remarks):
        loc = None if r.loc is None else {"file": r.loc.file, "line": r.loc.line, "function": r.loc.function}
        assert row == {
            "pass": r.pass_name, "rule": r.rule, "kind": r.kind, "node": r.node, "reason": r.reason,
            "message": r.message, "data": json.loads(json.dumps(dict(r.data))), "loc": loc,
        }  # fmt: skip
    assert {row["reason"] for row in rows} <= set(REASONS)
    assert any(row["rule"] not in (None, row["pass"]) for row in rows)  # a multi-rule pass names its rules


def test_remark_data_takes_snake_case_names_and_json_figures_only():
    r = Remark("p", "applied", "n", "applied", "2 rows", data={"rows": 2, "spans": [(0, 2), (2, 4)]})
    assert r.data == {"rows": 2, "spans": ((0, 2), (2, 4))}  # lists frozen to tuples
    assert hash(r) == hash(Remark("p", "applied", "n", "applied", "2 rows"))  # data is not hashed
    with pytest.raises(ValueError, match="data names must be snake_case, got 'Rows'"):
        Remark("p", "applied", "n", "applied", "m", data={"Rows": 2})
    with pytest.raises(ValueError, match="data 'shape' is TensorSpec, not a JSON scalar"):
        Remark("p", "applied", "n", "applied", "m", data={"shape": TensorSpec((2,))})


def test_the_claims_audit_fails_on_a_wrong_figure():
    from dataclasses import replace

    from tests.passes.claims import check_remarks

    graph = trace(lambda x, unused: ops.exp(x), TensorSpec((2, 3)), TensorSpec((4,)))
    result = attnpass.passes.DeadCodeElimination()(graph)
    (remark,) = [r for r in result.remarks if r.node == "unused"]
    assert remark.data["bytes"] == 16 and check_remarks(graph, result.graph, [remark]) == 1
    wrong = replace(remark, data={**remark.data, "bytes": 8})
    with pytest.raises(AssertionError, match="does not hold"):
        check_remarks(graph, result.graph, [wrong])
