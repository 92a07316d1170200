"""The dtype sweep: every model family of the installed mlx-lm in float16, bfloat16 and float32, over the traced
programs' bounds, plain and under ``optimize(model, min_keys=0, check=True)``, one row per family and dtype.

The families and their tiny configurations are the mlx-lm sweep's (``examples/mlx_lm_sweep.py``: ``families()``,
``tiny_args``), each model built by the model zoo's ``mlx_model`` (seeded) in float32 and cast to the dtype, its
MoE experts run under the zoo's ``bf16_gather_mm`` (MLX's CPU GatherMM is float32 only). Three steps, each run on
the plain model and then under one ``optimize(model, min_keys=0, check=True)`` (:data:`STEPS`):

- ``cache``: an 80-token prompt on ``make_prompt_cache(model)`` (a KVCache prefill of more than 64 rows), then 2
  one-token decode steps on that cache;
- ``no cache``: the same prompt as ``model(tokens)``;
- ``rotating``: the prompt on ``make_prompt_cache(model, max_kv_size=32)`` (a rotating cache's multi-row step),
  then 2 decode steps; ``n/a`` where the family makes its own cache (mlx-lm then ignores ``max_kv_size``).

A family and dtype ends **handled** (every step ran, no ``CheckError``, every output's raw bits the plain model's;
for a call routed to a program documented within a bound, MLA's and DSA's latent form, within that bound, said as
``within``), **declined** (the plain model itself cannot run a step here, or ``optimize`` raises ``ValueError``
because no module calls mlx-lm's helper: the reason, quoted) or **failed** (an exception under ``optimize`` that
the plain model does not raise, a ``CheckError``, different bits, a timeout or crash of its process), with the
calls routed and declined by code over its three steps. Each family runs in its own process, each step under the
sweep's ``CASE_TIMEOUT``.

Run: ``.venv/bin/python examples/mlx_lm_dtypes.py [--jobs N] [--write docs/mlx_lm_dtypes.md] [FAMILY ...]``
(``make zoo-dtypes``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

if "mlx_lm_sweep" not in sys.modules:  # the sweep, loaded by path as a registered module (no sys.path edit)
    _spec = importlib.util.spec_from_file_location("mlx_lm_sweep", Path(__file__).with_name("mlx_lm_sweep.py"))
    sys.modules["mlx_lm_sweep"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["mlx_lm_sweep"])
sweep = sys.modules["mlx_lm_sweep"]
zoo = sweep.zoo

DTYPES = ("float16", "bfloat16", "float32")
STEPS = ("cache", "no cache", "rotating")
PROMPT, DECODES, WINDOW = 80, 2, 32  # prompt tokens (over the traced programs' 64 rows); decode steps; max_kv_size
TOKENS = np.random.default_rng(0).integers(0, zoo.VOCAB, PROMPT + DECODES).astype(np.int32)
STATUSES = ("handled", "declined", "failed")

Record = dict[str, Any]  # family, dtype, status, reason, steps {step: cell}, routed, declined {code: calls}


def build(family: str, dtype: str) -> Any:
    """The tiny ``family`` model in ``dtype``: the zoo's float32 model (seeded, not the cached instance), cast."""
    import mlx.core as mx

    model = zoo.mlx_model.__wrapped__(family, "f32", sweep.tiny_args)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def rotates(model: Any) -> bool:
    """Whether ``make_prompt_cache(model, max_kv_size=...)`` gives rotating caches (the family has no ``make_cache``
    of its own, which mlx-lm would call instead)."""
    return not hasattr(model, "make_cache")


def run_step(model: Any, step: str) -> list[Any]:
    """The evaluated outputs of ``step`` (:data:`STEPS`): the prompt's, then each decode step's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.array(TOKENS[None, :PROMPT])
    with zoo.bf16_gather_mm():
        if step == "no cache":
            outputs = [model(prompt)]
        else:
            cache = make_prompt_cache(model, max_kv_size=WINDOW if step == "rotating" else None)
            outputs = [model(prompt, cache=cache)]
            outputs += [model(mx.array(TOKENS[None, i : i + 1]), cache=cache) for i in range(PROMPT, len(TOKENS))]
        leaves = [leaf for _, leaf in tree_flatten(outputs)]
        mx.eval(leaves)
    return leaves


def bound(opt: Any) -> dict[str, float]:
    """The loosest numerics (dtype -> absolute bound) of the programs that ran a routed call of ``opt``."""
    from attnpass.backends.mlx.check import EXACT, loosest
    from attnpass.backends.mlx.programs import PROGRAMS

    used = [PROGRAMS[n].numerics for n, f in opt.programs.items() if any(s.compiled for s in f.specializations)]
    return functools.reduce(loosest, used, EXACT)


def compare(got: list[Any], plain: list[Any], numerics: dict[str, float]) -> tuple[str, str]:
    """``(cell, failure)``: ``identical`` when every output's raw bits are the plain model's, ``within B (max D)``
    when some differ but all lie within ``numerics``' bound B for their dtype (D: the largest difference), else
    ``**FAIL**`` with the first difference."""
    import mlx.core as mx

    from attnpass.backends.mlx.check import EXACT, difference

    if len(got) != len(plain):
        return "**FAIL**", f"{len(got)} outputs where the plain model gives {len(plain)}"
    differing = [i for i, (a, b) in enumerate(zip(got, plain)) if difference(a, b, EXACT) is not None]
    if not differing:
        return "identical", ""
    for i in differing:
        beyond = difference(got[i], plain[i], numerics)
        if beyond is not None:
            return "**FAIL**", f"output {i}: {beyond}"
    worst = max(mx.max(mx.abs(got[i].astype(mx.float32) - plain[i].astype(mx.float32))).item() for i in differing)
    dtype = str(plain[differing[0]].dtype).removeprefix("mlx.core.")
    return f"within {numerics[dtype]:g} (max {worst:.2g})", ""


def run_dtype(family: str, dtype: str) -> Record:
    """``family`` in ``dtype``: every step plain, then under ``optimize(model, min_keys=0, check=True)``."""
    from attnpass.backends.mlx import optimize

    record: Record = dict(family=family, dtype=dtype, status="", reason="", steps={}, routed=0, declined={})
    cells, reasons = record["steps"], {"failed": [], "declined": []}
    try:
        model = build(family, dtype)
    except Exception as exc:  # noqa: BLE001
        return {**record, "status": "failed", "reason": f"config: {sweep._failure(exc)}"}
    plain = {}
    for step in STEPS:
        if step == "rotating" and not rotates(model):
            cells[step] = "n/a"
            continue
        try:
            with sweep.time_box(sweep.CASE_TIMEOUT):
                plain[step] = run_step(model, step)
        except Exception as exc:  # noqa: BLE001  (the plain model cannot run it here: nothing to compare with)
            cells[step] = "plain raises"
            reasons["declined"].append((step, f"plain: {sweep._failure(exc)}"))
    try:
        opt = optimize(model, min_keys=0, check=True)
    except ValueError as exc:  # no module calls mlx-lm's helper: nothing to route, said by name
        reasons["declined"].insert(0, ("optimize", sweep._short(exc, 400)))
        opt = None
    if opt is not None:
        with opt:
            for step, expected in plain.items():
                try:
                    with sweep.time_box(sweep.CASE_TIMEOUT):
                        got = run_step(model, step)
                except Exception as exc:  # noqa: BLE001  (a CheckError included)
                    cells[step] = "**FAIL**"
                    reasons["failed"].append((step, _raised(exc)))
                    continue
                cells[step], failure = compare(got, expected, bound(opt))
                if failure:
                    reasons["failed"].append((step, failure))
        record.update(routed=opt.routed, declined=dict(opt.declined))
    status = next((s for s in ("failed", "declined") if reasons[s]), "handled")
    return {**record, "status": status, "reason": _joined(reasons.get(status, []))}


def _joined(reasons: list[tuple[str, str]]) -> str:
    """``(step, reason)`` pairs as one text, each reason once after its steps: ``cache, no cache: X; rotating: Y``."""
    steps: dict[str, list[str]] = {}
    for step, reason in reasons:
        steps.setdefault(reason, []).append(step)
    return "; ".join(f"{', '.join(names)}: {reason}" for reason, names in steps.items())


def _raised(exc: BaseException) -> str:
    """An exception under ``optimize``: a ``CheckError`` whole (layer, cache, program, signature, difference),
    another as the sweep says it."""
    from attnpass.backends.mlx.check import CheckError

    return f"CheckError: {exc}" if isinstance(exc, CheckError) else sweep._failure(exc)


def run_family(family: str, emit: Callable[[Record], None] = lambda record: None) -> list[Record]:
    """Every dtype of ``family``, each record also given to ``emit`` as it completes."""
    records = []
    for dtype in DTYPES:
        records.append(run_dtype(family, dtype))
        emit(records[-1])
    return records


def family_in_process(family: str) -> list[Record]:
    """:func:`run_family` in a fresh process, killed after every step's time box is spent; a dtype it did not
    report (a timeout, a crash) is failed with how the process ended."""
    budget = sweep.CASE_TIMEOUT * 2 * len(STEPS) * len(DTYPES) + 30
    command = [sys.executable, "-X", "faulthandler", __file__, "--child", family]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=budget)
        out, ended = done.stdout, sweep._ending(done.returncode, done.stderr)
    except subprocess.TimeoutExpired as exc:
        out, ended = sweep._text(exc.stdout), f"timeout (over {budget} s)"
    found = {r["dtype"]: r for r in map(json.loads, (line for line in out.splitlines() if line.startswith("{")))}
    lost = dict(status="failed", reason=f"process ended: {ended}", steps={}, routed=0, declined={})
    return [found.get(dtype, dict(family=family, dtype=dtype, **lost)) for dtype in DTYPES]


# ----------------------------------------------------------------------------- the table


def table(records: list[Record], command: str, seconds: float, loads: tuple[float, float], note: str = "") -> str:
    """The docs page: counts per dtype, one row per family and dtype."""
    import mlx.core as mx
    import mlx_lm

    counts = {d: {s: sum(r["dtype"] == d and r["status"] == s for r in records) for s in STATUSES} for d in DTYPES}
    totals = "; ".join(f"{d}: {', '.join(f'{n} {s}' for s, n in c.items())}" for d, c in counts.items())
    families = len({r["family"] for r in records})
    head = ["family", "dtype", "status", *STEPS, "routed", "declined by code", "reason"]
    lines = [
        "# mlx-lm families in float16, bfloat16 and float32",
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()} ({seconds / 60:.0f} min; load average "
        f"{loads[0]:.1f} at the start, {loads[1]:.1f} at the end, on {os.cpu_count()} cores shared with other "
        f"runs) with mlx-lm {mlx_lm.__version__} and MLX {mx.__version__}, on MLX's CPU. The check is "
        "`examples/mlx_lm_dtypes.py`, described in its docstring; the families and their tiny configurations are "
        "the [mlx-lm sweep](mlx_lm_families.md)'s. Do not edit by hand: `make zoo-dtypes` regenerates it."
        f"{' ' + note if note else ''}",
        "",
        f"**{families} families x 3 dtypes. {totals}.**",
        "",
        f"Each family is built in each dtype (seeded) and run plain, then under `optimize(model, min_keys=0, "
        f"check=True)`: `cache`, a prompt of {PROMPT} tokens on `make_prompt_cache(model)` then {DECODES} one-token "
        f"decode steps; `no cache`, the prompt as `model(tokens)`; `rotating`, the prompt on "
        f"`make_prompt_cache(model, max_kv_size={WINDOW})` then {DECODES} decode steps. Step cells: `identical` "
        "(every output's raw bits the plain model's), `within B (max D)` (bits differ, by at most D, within the "
        "bound B stated by a program that ran a routed call: MLA's and DSA's latent form, docs/dropin.md \"MLA "
        'models"), `n/a` (the family makes its own cache: mlx-lm ignores `max_kv_size`), `plain raises` (the '
        "plain model cannot run it here), `**FAIL**` (an exception under `optimize` only, a `CheckError`, other "
        "bits), `-` (not run under `optimize`). `routed`: attention calls that ran an attnpass program over the "
        "three steps; `declined by code`: the others (each ran mlx-lm's helper). `reason`: the failures, else "
        "what was declined.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in records:
        declined = ", ".join(f"{code} {n}" for code, n in sorted(r["declined"].items()))
        reason = r["reason"] if len(r["reason"]) <= 400 else r["reason"][:399] + "…"
        cells = [r["steps"].get(step, "-") for step in STEPS]
        row = [f"`{r['family']}`", r["dtype"], r["status"], *cells, str(r["routed"]), declined, sweep._escape(reason)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def committed(path: Path) -> dict[tuple[str, str], str]:
    """``(family, dtype)`` -> status, read from a generated table."""
    statuses = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `") and len(cells) > 3:
            statuses[cells[0].strip("`"), cells[1]] = cells[2]
    return statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="these families only (default: every family)")
    parser.add_argument("--write", type=Path, help="write the table to this markdown file")
    parser.add_argument("--jobs", type=int, default=1, help="families run at once (default 1)")
    parser.add_argument("--note", default="", help="a sentence for the table's header (how this run was made)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        run_family(options.child, lambda record: print(json.dumps(record), flush=True))
        return 0
    found, _skipped = sweep.families()
    unknown = sorted(set(options.only) - set(found))
    if unknown:
        parser.error(f"not a family of the installed mlx-lm: {', '.join(unknown)}")
    selected = [f for f in found if not options.only or f in options.only]
    start, load = time.monotonic(), os.getloadavg()[0]
    records = []
    with concurrent.futures.ThreadPoolExecutor(options.jobs) as pool:  # each family is its own process
        for done in pool.map(family_in_process, selected):
            records += done
            for r in done:
                routed = f"{r['routed']}/{sum(r['declined'].values())}"
                print(
                    f"{r['family']:<28} {r['dtype']:<9} {r['status']:<9} {routed:>7}  {r['reason'][:100]}", flush=True
                )
    if options.write:
        given = sys.argv[1:] if argv is None else argv
        shown = [a for i, a in enumerate(given) if a != "--note" and (i == 0 or given[i - 1] != "--note")]
        command = " ".join(["python examples/mlx_lm_dtypes.py", *shown])
        loads = (load, os.getloadavg()[0])
        options.write.write_text(table(records, command, time.monotonic() - start, loads, options.note))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
