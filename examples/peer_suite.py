"""mlx-lm's own tests, run plain and with every model they build optimized, compared test by test.

Fetches the sdist of mlx-lm :data:`VERSION` (the installed one: its tests test the installed package) with pip into
a cache folder (default ``.peer/``, git-ignored) and unpacks its ``tests/`` only. Makes the local stand-in for the
hub model the tests download (``peer_optimize_plugin.STAND_IN_REPOS``): :func:`attnpass.models.tiny_lm.save_tiny_lm`'s
qwen3 (the family nearest the hub model's qwen2), quantized to 4 bits like the hub model by mlx-lm's ``convert``.
Then runs the tests three times with this venv's pytest, offline (``HF_HUB_OFFLINE``, an empty ``HF_HOME``), each
run with ``examples/peer_optimize_plugin.py`` serving the stand-in (:data:`RUNS`): plain; optimized (every model the
tests build under ``optimize(model, min_keys=0)``); checked (``check=True`` too, the shadow mode, which evaluates
each routed call's output and the helper's: arrays a test leaves lazy are computed). Each test's outcome is read
from pytest's JUnit XML: passed, skipped, failed or error, with the exception names of its failures (one per
failing subtest); an outcome that differs from the plain run's is **changed** (an attnpass bug; there must be none;
the exit status is 1 if there is one). Prints, per optimized run, the totals, the changed tests and the optimize
counts (models, calls routed, declined by code), then the tests failing or skipped plain with why (:data:`WHY`,
diagnosed by hand for this version, else :data:`RULES` on the message); ``--write`` writes the same as a markdown
page.

Run: ``.venv/bin/python examples/peer_suite.py [--write docs/peer_suites.md] [-- TEST ...]`` (``make peer-mlx-lm``;
about five minutes on 2 cores; TEST: pytest arguments run in the sdist's root, e.g.
``tests/test_models.py``; ``--reuse`` compares the last runs' results again).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from peer_optimize_plugin import CHECK_MAX_PARAMETERS  # examples/, this script's folder

VERSION = "0.32.2"
EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent
PLUGIN = "peer_optimize_plugin"  # examples/peer_optimize_plugin.py
LIBRARY = ("ir", "passes", "lowering", "backends", "models", "cli")  # the attnpass package's folders
STATUSES = ("passed", "skipped", "failed", "error")
VERSIONS = ("mlx", "mlx-lm", "transformers", "pytest")
RUNS = {"plain": [], "optimized": ["--attnpass-optimize"], "checked": ["--attnpass-optimize", "--attnpass-check"]}

# Why a test fails or skips plain, from its message: (pattern, reason); a group 1 fills {0}.
RULES: tuple[tuple[str, str], ...] = (
    (r"OfflineModeIsEnabled|LocalEntryNotFoundError|couldn't connect to 'https://huggingface\.co'"
     r"|locate the file on the Hub", "needs the network: a Hugging Face hub download"),
    (r"No Metal back-end|Metal backend|GPU only|only supported on Metal", "needs Metal (MLX's GPU backend)"),
    (r"No module named '([\w.]+)'", "needs {0}, not installed"),
    (r"requires ([\w-]+)", "needs {0}, not installed"),
)  # fmt: skip
STAND_IN = "asserts what only the hub model gives (the stand-in is a tiny qwen3 with a word-level tokenizer)"
# Why, for mlx-lm 0.32.2's tests whose message does not say it (diagnosed by hand; plain runs, no attnpass).
WHY: dict[str, str] = {
    **{f"test_losses.TestLosses::test_{n}": "asserts can_run_metal(): needs Metal (MLX's GPU backend)"
       for n in ("kl_div_loss", "js_div_loss", "kl_div_loss_vjp", "js_div_loss_vjp")},
    **{f"test_models.TestModels::test_gated_delta{s}": "gated_delta_kernel is None without Metal: needs Metal"
       for s in ("", "_masked")},
    "test_generate.TestGenerate::test_batch_matches_single": f"{STAND_IN}: its prompts' lengths",
    "test_generate.TestGenerate::test_generate_with_logit_bias": f"{STAND_IN}: its text",
    "test_generate.TestGenerate::test_stream_generate_input_embeddings": f"{STAND_IN}: its text",
    "test_generate.TestGenerate::test_stream_generate_input_embeddings_prefill": f"{STAND_IN}: its text",
    "test_tokenizers.TestTokenizers::test_naive_detokenizer_holds_back_partial_characters": f"{STAND_IN}: its tokens",
    "test_tokenizers.TestTokenizers::test_tokenizers":
        f"{STAND_IN}: its detokenizer class; the other five tokenizers need the network",
    "test_utils.TestUtils::test_load": f"{STAND_IN}: a Qwen2Model",
    "test_server.TestServer::test_handle_models": "lists the models of the hub cache, empty in these runs",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One test's result in one run: its status, the exception names of its failures, the first message."""

    status: str
    errors: tuple[str, ...] = ()
    message: str = ""

    def __str__(self) -> str:
        return self.status if not self.errors else f"{self.status} ({', '.join(self.errors)})"


@dataclasses.dataclass
class Run:
    """One pytest run: each test's outcome, the plugin's counts (its seconds among them)."""

    outcomes: dict[str, Outcome]
    counts: dict[str, Any]

    @classmethod
    def load(cls, cache: Path, name: str) -> Run:
        """Run ``name``'s results, as :func:`run` left them in ``cache``."""
        return cls(outcomes(cache / f"{name}.xml"), json.loads((cache / f"{name}-counts.json").read_text()))


def fetch(cache: Path) -> Path:
    """The unpacked ``tests/`` of mlx-lm :data:`VERSION`'s sdist under ``cache`` (downloaded once), its root."""
    root = cache / f"mlx_lm-{VERSION}"
    if not (root / "tests").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"mlx-lm=={VERSION}", "-d", str(cache)],
            check=True,
        )  # fmt: skip
        with tarfile.open(cache / f"mlx_lm-{VERSION}.tar.gz") as sdist:
            tests = [m for m in sdist.getmembers() if m.name.startswith(f"{root.name}/tests/")]
            sdist.extractall(cache, members=tests, filter="data")
    (root / "pytest.ini").write_text("[pytest]\n")  # the tests' own rootdir: not attnpass's pytest settings
    return root


def stand_in(cache: Path) -> Path:
    """The local stand-in for the hub model (made once): a tiny qwen3 in bfloat16, quantized to 4 bits."""
    path = cache / "stand-in"
    if not (path / "config.json").is_file():
        from mlx_lm import convert

        from attnpass.models.tiny_lm import save_tiny_lm

        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            tiny = save_tiny_lm(Path(scratch) / "tiny", "qwen3")
            convert(str(tiny), mlx_path=str(Path(scratch) / "quantized"), quantize=True, q_bits=4, q_group_size=64)
            (Path(scratch) / "quantized").rename(path)
    return path


def run(root: Path, model: Path, tests: list[str], name: str) -> Run:
    """The tests under ``root`` with the venv's pytest, the stand-in served, run ``name`` of :data:`RUNS`."""
    xml, counts = root.parent / f"{name}.xml", root.parent / f"{name}-counts.json"
    home = root.parent / "hf-home"  # empty: no model cached anywhere but the stand-in
    home.mkdir(exist_ok=True)
    xml.unlink(missing_ok=True)
    env = dict(
        os.environ,
        HF_HOME=str(home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(EXAMPLES), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    command = [
        sys.executable, "-m", "pytest", *tests, "-q", "-p", PLUGIN, "-p", "no:cacheprovider",
        "--continue-on-collection-errors", f"--junitxml={xml}", f"--attnpass-stand-in={model}",
        f"--attnpass-counts={counts}", *RUNS[name],
    ]  # fmt: skip
    print(f"== {name}: {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode not in (0, 1) or not xml.is_file():  # 1: tests failed; else pytest itself did not finish
        raise SystemExit(f"{name} run: pytest exited {done.returncode}:\n{done.stdout[-3000:]}")
    print(done.stdout.splitlines()[-1], flush=True)
    return Run.load(root.parent, name)


def outcomes(xml: Path) -> dict[str, Outcome]:
    """Test id (``module.Class::name``) -> its outcome, from pytest's JUnit XML."""
    found = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        module, name = case.get("classname", ""), case.get("name", "")
        test = f"{module.removeprefix('tests.')}::{name}" if module else f"{name.removeprefix('tests.')} (collecting)"
        kinds = [c for c in case if c.tag in ("failure", "error", "skipped")]
        status = "passed"
        for child in kinds:
            status = max(status, {"failure": "failed"}.get(child.tag, child.tag), key=STATUSES.index)
        failures = [c for c in kinds if c.tag != "skipped"]
        message = _message(kinds[0]) if kinds else ""
        found[test] = Outcome(status, tuple(sorted(_exception(_message(c)) for c in failures)), message)
    return found


def _message(child: ET.Element) -> str:
    """A failure's message; a collection failure's is the traceback's last line."""
    message = child.get("message") or ""
    if message == "collection failure" and child.text:
        message = child.text.strip().splitlines()[-1].removeprefix("E").strip()
    return message


def _exception(message: str) -> str:
    """The exception name a JUnit message starts with (``failed on setup with "X: ..."`` too), else its start."""
    found = re.match(r'(?:failed on \w+ with ")?([\w.]+)(?::|$)', message)
    return found.group(1).rsplit(".", 1)[-1] if found else message.splitlines()[0][:60] if message else "?"


def why(test: str, outcome: Outcome) -> str:
    """Why a test fails or skips both ways: :data:`WHY`, else the first of :data:`RULES` its message matches."""
    if test in WHY:
        return WHY[test]
    for pattern, reason in RULES:
        found = re.search(pattern, outcome.message)
        if found:
            return reason.format(*found.groups())
    return f"unexplained: {outcome.message.splitlines()[0][:150] if outcome.message else outcome}"


@dataclasses.dataclass
class Comparison:
    """Each test's (plain, optimized) outcomes; the changed tests; the others by their shared status."""

    pairs: dict[str, tuple[Outcome, Outcome]]
    changed: list[str]
    both: dict[str, list[str]]


def compare(plain: Run, optimized: Run) -> Comparison:
    """Test by test: changed where the status or the failures' exception names differ (a test absent from a run
    too)."""
    missing = Outcome("absent")
    tests = sorted(plain.outcomes.keys() | optimized.outcomes.keys())
    pairs = {t: (plain.outcomes.get(t, missing), optimized.outcomes.get(t, missing)) for t in tests}
    changed = [t for t, (a, b) in pairs.items() if (a.status, a.errors) != (b.status, b.errors)]
    both = {s: [t for t in tests if t not in changed and pairs[t][0].status == s] for s in STATUSES}
    return Comparison(pairs, changed, both)


def report(runs: dict[str, Run], command: str, note: str = "") -> tuple[list[str], int]:
    """The comparisons as markdown lines (header; per optimized run its totals, counts and changed tests; the tests
    failing or skipped plain) and the number of changed outcomes."""
    import mlx.core as mx

    plain = runs["plain"]
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in VERSIONS)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    changed = subprocess.run(["git", "status", "--porcelain", "--", *LIBRARY], cwd=ROOT, capture_output=True, text=True)
    minutes = ", ".join(f"{name} {run.counts['seconds'] / 60:.1f} min" for name, run in runs.items())
    lines = [
        f"# mlx-lm {VERSION}'s tests, plain and optimized",
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()} ({minutes}) with {versions}, MLX device "
        f"{mx.default_device()}, Python {platform.python_version()} on {platform.system()} {platform.machine()}, "
        f"attnpass {commit.stdout.strip() or '?'}{' with uncommitted changes' if changed.stdout else ''}; the runner "
        "is `examples/peer_suite.py` with `examples/peer_optimize_plugin.py`, described in their docstrings. Do not "
        "edit by hand: "
        f"`make peer-mlx-lm` regenerates it.{' ' + note if note else ''}",
        "",
        f"Every run: mlx-lm {VERSION}'s `tests/` from its sdist, offline, the hub model the tests download replaced "
        "by a local tiny stand-in (attnpass's `save_tiny_lm` qwen3, quantized to 4 bits). The optimized runs "
        "optimize every model the tests build, every attention call routed (`min_keys=0`); `check=True` also "
        "compares each routed call's output with mlx-lm's helper, evaluating both (models over "
        f"{CHECK_MAX_PARAMETERS:,} parameters, which the tests build in full size and never evaluate, are optimized "
        "without it). An outcome is the status with the exception names of the failures (each failing subtest's).",
    ]
    changes = 0
    compared = {name: compare(plain, found) for name, found in runs.items() if name != "plain"}
    for name, found in compared.items():
        counts, pairs, both = runs[name].counts, found.pairs, found.both
        changes += len(found.changed)
        tested = sum(1 for c in counts["tests"].values() if c["routed"])
        declined = ", ".join(f"{n} x {code}" for code, n in counts["declined"].items()) or "none"
        unroutable = ", ".join(f"{n} x `{m}`" for m, n in counts["unroutable"].items()) or "none"
        unchecked = f", {counts['unchecked']} of them without check" if counts["check"] else ""
        lines += [
            "",
            f"## `optimize(model, min_keys=0{', check=True' if counts['check'] else ''})`",
            "",
            f"**{len(pairs)} tests: {len(both['passed'])} pass both ways, "
            f"{len(both['failed']) + len(both['error'])} fail both ways, {len(both['skipped'])} skip both ways, "
            f"{len(found.changed)} outcome changed.**",
            "",
            f"{counts['optimized']} models optimized{unchecked}, {counts['routed']} attention calls routed ({tested} "
            f"tests routed at least one), declined: {declined}; models whose attention optimize cannot route (none "
            f"of their modules calls mlx-lm's helper), left plain: {unroutable}.",
            "",
        ]
        if found.changed:
            lines += ["| outcome changed | plain | optimized | optimized message |", "|---|---|---|---|"]
            lines += [
                f"| `{t}` | {pairs[t][0]} | {pairs[t][1]} | {_cell(pairs[t][1].message)} |" for t in found.changed
            ]
        else:
            lines.append("No outcome changed.")
    failing = [t for t, o in sorted(plain.outcomes.items()) if o.status in ("failed", "error")]
    lines += ["", "## Failing plain", "", f"| test | {' | '.join(runs)} | why |", "|---|" + "---|" * (len(runs) + 1)]
    for test in failing:
        shown = [str(run.outcomes.get(test, Outcome("absent"))) for run in runs.values()]
        lines.append(f"| `{test}` | {' | '.join(shown)} | {_cell(why(test, plain.outcomes[test]))} |")
    lines += ["", "## Skipped plain", "", "| test | why |", "|---|---|"]
    lines += [f"| `{t}` | {_cell(why(t, o))} |" for t, o in sorted(plain.outcomes.items()) if o.status == "skipped"]
    return lines, changes


def _cell(text: str) -> str:
    """``text``'s first line as a table cell: pipes escaped, at most 200 characters."""
    line = text.splitlines()[0] if text else ""
    return (line if len(line) <= 200 else line[:199] + "…").replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="*", default=["tests"], help="pytest arguments, in the sdist's root (tests)")
    parser.add_argument("--cache", type=Path, default=ROOT / ".peer", help="where the sdist and stand-in go")
    parser.add_argument("--write", type=Path, help="write the comparison to this markdown file")
    parser.add_argument("--reuse", action="store_true", help="compare the last runs' results again, running nothing")
    parser.add_argument("--note", default="", help="a sentence for the page's header (how this run was made)")
    options = parser.parse_args(argv)
    installed = importlib.metadata.version("mlx-lm")
    if installed != VERSION:
        parser.error(f"mlx-lm {installed} is installed; these are mlx-lm {VERSION}'s tests")
    cache = options.cache.resolve()
    if options.reuse:
        runs = {name: Run.load(cache, name) for name in RUNS}
    else:
        cache.mkdir(parents=True, exist_ok=True)
        root, model = fetch(cache), stand_in(cache)
        runs = {name: run(root, model, options.tests, name) for name in RUNS}
    given = sys.argv[1:] if argv is None else argv
    shown = [a for i, a in enumerate(given) if a != "--note" and (i == 0 or given[i - 1] != "--note")]
    lines, changes = report(runs, " ".join(["python examples/peer_suite.py", *shown]), options.note)
    print("\n".join(lines))
    if options.write:
        options.write.write_text("\n".join(lines) + "\n")
    return 1 if changes else 0


if __name__ == "__main__":
    raise SystemExit(main())
