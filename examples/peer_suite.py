"""A peer library's own tests, run plain and with every model they build optimized, compared test by test.

The peers are the records of ``examples/peers.py`` (``--peer``): mlx-lm (the tests of the installed release's
sdist, fetched with pip) and mlx-vlm (the tests of a git ref of its repository, ``git archive`` from a clone given
with ``--git-dir``: its releases ship no tests). The tests go into a cache folder (default ``.peer/``, git-ignored),
``tests/`` under the peer's folder there, with the results of its runs; a record's stand-in for the hub model its
tests download is made there too (mlx-lm's: :func:`attnpass.models.tiny_lm.save_tiny_lm`'s qwen3, quantized to 4
bits like the hub model). Then runs the record's tests three times with this venv's pytest, offline
(``HF_HUB_OFFLINE``, an empty ``HF_HOME``), each run with ``examples/peer_optimize_plugin.py`` serving the stand-in
(:data:`RUNS`): plain; optimized (every model the tests build under ``optimize(model, min_keys=0)``); checked
(``check=True`` too, the shadow mode, which evaluates each routed call's output and the helper's: arrays a test leaves
lazy are computed). Each test's outcome is read from pytest's JUnit XML: passed, skipped, failed or error, with the
exception names of its failures (one per failing subtest); an outcome that differs from the plain run's is
**changed** (an attnpass bug; there must be none; the exit status is 1 if there is one). Prints, per optimized run,
the totals, the changed tests and the optimize counts (models by class, calls routed, declined by code), then the
tests failing or skipped plain with why (the record's ``why``, diagnosed by hand for its versions, else the rules on
the message), then the test files and tests not run with why (the record's ``left_out`` and ``deselected``). For a
peer whose tests come from a git ref (mlx-vlm: the tests are 0.6.15's, the package 0.7.10's), the tests failing
plain are run once more against the ref's own package source (:data:`REFERENCE`): one that passes there fails here
because of the version gap, which its why says. ``--write`` writes the same as a markdown page (each peer its own: ``make peer-mlx-lm`` writes
docs/peer_suites.md, ``make peer-mlx-vlm`` docs/peer_suites_mlx_vlm.md).

Run: ``.venv/bin/python examples/peer_suite.py [--peer mlx-vlm] [--git-dir DIR] [--write PAGE] [-- TEST ...]``
(``make peer-mlx-lm``, about five minutes on 2 cores; ``make peer-mlx-vlm [MLX_VLM_GIT=DIR]``; TEST: pytest
arguments run in the tests' root, e.g. ``tests/test_models.py``, instead of the record's; ``--reuse`` compares the
last runs' results again).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import io
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
from peers import PEERS, RULES, GitArchive, Peer, Sdist

EXAMPLES = Path(__file__).resolve().parent
ROOT = EXAMPLES.parent
PLUGIN = "peer_optimize_plugin"  # examples/peer_optimize_plugin.py
LIBRARY = ("ir", "passes", "lowering", "backends", "models", "cli")  # the attnpass package's folders
STATUSES = ("passed", "skipped", "failed", "error")
RUNS = {"plain": [], "optimized": ["--attnpass-optimize"], "checked": ["--attnpass-optimize", "--attnpass-check"]}
REFERENCE = "reference"  # the tests failing plain, against the package source of the tests' own ref (git peers)


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
    def load(cls, root: Path, name: str) -> Run:
        """Run ``name``'s results, as :func:`run` left them in the tests' ``root``."""
        return cls(outcomes(root / f"{name}.xml"), json.loads((root / f"{name}-counts.json").read_text()))


def fetch(peer: Peer, cache: Path, git_dir: Path | None) -> Path:
    """The root of ``peer``'s tests under ``cache``, its ``tests/`` unpacked there once (its source's)."""
    root = cache / peer.folder
    if not (root / "tests").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        if isinstance(peer.source, Sdist):
            _from_sdist(peer.source, cache, root)
        else:
            _from_git(peer, git_dir, root)
    (root / "pytest.ini").write_text("[pytest]\n")  # the tests' own rootdir: not attnpass's pytest settings
    return root


def _from_sdist(source: Sdist, cache: Path, root: Path) -> None:
    """``source``'s sdist downloaded into ``cache`` (once), its ``tests/`` unpacked into ``root``."""
    stem = f"{source.distribution.replace('-', '_')}-{source.version}"
    sdist = cache / f"{stem}.tar.gz"
    if not sdist.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"{source.distribution}=={source.version}", "-d", str(cache)],
            check=True,
        )  # fmt: skip
    with tarfile.open(sdist) as archive:
        tests = [m for m in archive.getmembers() if m.name.startswith(f"{stem}/tests/")]
        for member in tests:
            member.name = member.name.removeprefix(f"{stem}/")
        archive.extractall(root, members=tests, filter="data")


def git_clone(peer: Peer, given: Path | None) -> Path:
    """The git clone to archive ``peer``'s tests from: ``given``, else its source's default where that exists."""
    source = peer.source
    assert isinstance(source, GitArchive)
    found = given if given is not None else Path(source.default) if source.default else None
    if found is None or not found.exists():
        where = f"{given} does not exist" if given is not None else f"none at {source.default or 'a default path'}"
        raise SystemExit(
            f"peer_suite: {peer.name}'s tests come from a git clone of {source.url} holding {source.ref} ({where}): "
            f"pass --git-dir DIR (make peer-{peer.name} {source.option}=DIR)"
        )
    return found


def _from_git(peer: Peer, given: Path | None, root: Path) -> None:
    """``peer.source.path`` at its ref of the clone, as ``root/tests`` (``git archive``; a bare clone too)."""
    source, clone = peer.source, git_clone(peer, given)
    assert isinstance(source, GitArchive)
    archive = subprocess.run(
        ["git", "-C", str(clone), "archive", "--format=tar", f"{source.ref}:{source.path}"],
        check=False,
        capture_output=True,
    )
    if archive.returncode:
        raise SystemExit(f"peer_suite: git archive {source.ref}:{source.path} in {clone}: {archive.stderr.decode()}")
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tests:
            tests.extractall(Path(scratch) / "tests", filter="data")
        (Path(scratch) / "tests").rename(root / "tests")


def _source(peer: Peer, given: Path | None, root: Path) -> Path:
    """The folder holding ``peer``'s own package source at its ref (``root/source/<package>``, archived once)."""
    source = peer.source
    assert isinstance(source, GitArchive)
    folder = root / "source"
    if not (folder / source.package).is_dir():
        clone = git_clone(peer, given)
        archive = subprocess.run(
            ["git", "-C", str(clone), "archive", "--format=tar", f"--prefix={source.package}/",
             f"{source.ref}:{source.package}"],
            check=False, capture_output=True,
        )  # fmt: skip
        if archive.returncode:
            raise SystemExit(f"peer_suite: git archive {source.ref}:{source.package}: {archive.stderr.decode()}")
        with tempfile.TemporaryDirectory(dir=root) as scratch, tarfile.open(fileobj=io.BytesIO(archive.stdout)) as t:
            t.extractall(scratch, filter="data")
            folder.mkdir(exist_ok=True)
            (Path(scratch) / source.package).rename(folder / source.package)
    return folder


def reference(peer: Peer, root: Path, given: Path | None, plain: Run) -> Run | None:
    """For a peer whose tests come from a git ref: the tests failing plain, run plain once more against the ref's
    own package source (:data:`REFERENCE`; its folder first on ``PYTHONPATH``); None for the others."""
    if not isinstance(peer.source, GitArchive):
        return None
    failing = [node_id(t) for t, o in plain.outcomes.items() if o.status in ("failed", "error")]
    if not failing:
        return None
    return run(peer, root, None, sorted(set(failing)), REFERENCE, path=_source(peer, given, root))


def node_id(test: str) -> str:
    """The pytest node id of a test id of :func:`outcomes` (``module.Class::name``, ``module (collecting)``)."""
    if test.endswith(" (collecting)"):
        return f"tests/{test.removesuffix(' (collecting)').replace('.', '/')}.py"
    where, name = test.split("::", 1)
    module, _, cls = where.partition(".")
    return f"tests/{module}.py::{cls + '::' if cls else ''}{name}"


def run(peer: Peer, root: Path, model: Path | None, tests: list[str], name: str, path: Path | None = None) -> Run:
    """``tests`` in ``root`` with the venv's pytest, the stand-in ``model`` served, run ``name`` of :data:`RUNS`
    (or :data:`REFERENCE`, plain), ``path`` first on ``PYTHONPATH``."""
    xml, counts = root / f"{name}.xml", root / f"{name}-counts.json"
    home = root.parent / "hf-home"  # empty: no model cached anywhere but the stand-in
    home.mkdir(exist_ok=True)
    xml.unlink(missing_ok=True)
    env = dict(
        os.environ,
        HF_HOME=str(home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(map(str, filter(None, [path, EXAMPLES, os.environ.get("PYTHONPATH")]))),
    )
    command = [
        sys.executable, "-m", "pytest", *tests, "-q", "-p", PLUGIN, "-p", "no:cacheprovider",
        "--continue-on-collection-errors", f"--junitxml={xml}", f"--attnpass-peer={peer.name}",
        *([f"--attnpass-stand-in={model}"] if model is not None else []), f"--attnpass-counts={counts}", *RUNS.get(name, []),
    ]  # fmt: skip
    print(f"== {peer.name} {name}: {' '.join(command[1:])}", flush=True)
    done = subprocess.run(
        command, check=False, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if done.returncode not in (0, 1) or not xml.is_file():  # 1: tests failed; else pytest itself did not finish
        raise SystemExit(f"{name} run: pytest exited {done.returncode}:\n{done.stdout[-3000:]}")
    print(done.stdout.splitlines()[-1], flush=True)
    found = json.loads(counts.read_text())
    counts.write_text(json.dumps({**found, "arguments": tests}, indent=1) + "\n")  # what ran, for the page
    return Run.load(root, name)


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
    """The exception name a JUnit message starts with (``failed on setup with "X: ..."`` too), else its start, its
    object addresses masked (``<X object at 0x…>``: another in each run)."""
    found = re.match(r'(?:failed on \w+ with ")?([\w.]+)(?::|$)', message)
    if found:
        return found.group(1).rsplit(".", 1)[-1]
    return re.sub(r"\b0x[0-9a-fA-F]+\b", "0x…", message.splitlines()[0])[:60] if message else "?"


def why(peer: Peer, test: str, outcome: Outcome, at_ref: Outcome | None = None) -> str:
    """Why a test fails or skips both ways: ``peer.why``, else the first of ``peer.rules`` and :data:`~peers.RULES`
    its message matches. ``at_ref``, the test's outcome against the package source of the tests' own ref (the
    :data:`REFERENCE` run): one that passes there is the version gap, which the rule's reason details; one that
    fails there too fails for the reason its message there gives."""
    if test in peer.why:
        return peer.why[test]
    here = _rule(peer, outcome.message)
    if at_ref is not None and at_ref.status in ("passed", "collected"):
        return f"the version gap: passes against {peer.name} {peer.tests_version}'s own source" + (
            f"; {here}" if here else ""
        )
    if at_ref is not None and at_ref.status in ("failed", "error") and at_ref.errors != outcome.errors:
        there = _rule(peer, at_ref.message) or at_ref.message.splitlines()[0][:100]
        return f"{here or 'the version gap'}; against {peer.tests_version}'s own source it fails further on: {there}"
    return here or f"unexplained: {outcome.message.splitlines()[0][:150] if outcome.message else outcome}"


def _rule(peer: Peer, message: str) -> str | None:
    """The reason of the first of ``peer.rules`` and :data:`~peers.RULES` that ``message`` matches, if any."""
    for pattern, reason in (*peer.rules, *RULES):
        found = re.search(pattern, message)
        if found:
            return reason.format(*found.groups())
    return None


def at_reference(test: str, found: Run) -> Outcome | None:
    """``test``'s outcome in the :data:`REFERENCE` run ``found``; a file that failed to collect plain is
    ``collected`` there when it collects (its tests have outcomes of their own)."""
    if not test.endswith(" (collecting)"):
        return found.outcomes.get(test)
    module = test.removesuffix(" (collecting)")
    if test in found.outcomes:
        return found.outcomes[test]
    return Outcome("collected") if any(t.split("::")[0].split(".")[0] == module for t in found.outcomes) else None


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


def report(peer: Peer, runs: dict[str, Run], at_ref: Run | None, command: str, note: str = "") -> tuple[list[str], int]:
    """The comparisons as markdown lines (header; per optimized run its totals, counts and changed tests; the tests
    failing or skipped plain; the test files left out) and the number of changed outcomes."""
    import mlx.core as mx

    plain = runs["plain"]
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in peer.versions)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=False, capture_output=True, text=True
    )
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--", *LIBRARY], cwd=ROOT, check=False, capture_output=True, text=True
    )
    minutes = ", ".join(f"{name} {run.counts['seconds'] / 60:.1f} min" for name, run in runs.items())
    here = (ROOT / peer.page).parent
    others = ", ".join(
        f"[{other.name}]({os.path.relpath(ROOT / other.page, here)})" for other in PEERS.values() if other != peer
    )
    source, tests = peer.source, f"{peer.name} {peer.tests_version}'s tests"
    if isinstance(source, Sdist):
        where = f"{peer.name} {peer.tests_version}'s `tests/` from its sdist, offline"
        title = f"# {tests}, plain and optimized"
    else:
        where = (
            f"{peer.name}'s `{source.path}/` at `{source.ref}` of its git repository ({source.url}; its releases ship "
            f"no tests), run against the installed {peer.name} {peer.version}: **the tests are {peer.tests_version}'s, "
            f"the package {peer.version}'s**. The tests failing plain because of that gap (a name the package no "
            "longer has, a behaviour it changed) are listed below with why (each test failing plain is run once more "
            f"against {peer.tests_version}'s own source); they fail the same way in every run, so they are not changed "
            "outcomes. Offline"
        )
        title = f"# {tests} against {peer.name} {peer.version}, plain and optimized"
    stand_in = (
        f"the hub model the tests download replaced by a local tiny stand-in ({peer.stand_in.what})"
        if peer.stand_in is not None
        else "no hub model served (no test run downloads one)"
    )
    files = " ".join(f"`{t}`" for t in plain.counts.get("arguments", peer.tests) if not t.startswith("-"))
    classes = " and ".join(f"`{c}`" for c in peer.classes)
    lines = [
        title,
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()} ({minutes}) with {versions}, MLX device "
        f"{mx.default_device()}, Python {platform.python_version()} on {platform.system()} {platform.machine()}, "
        f"attnpass {commit.stdout.strip() or '?'}{' with uncommitted changes' if changed.stdout else ''}; the runner "
        "is `examples/peer_suite.py` with `examples/peer_optimize_plugin.py` and the peers' table "
        "`examples/peers.py`, described in their docstrings. Do not edit by hand: "
        f"`make peer-{peer.name}` regenerates it.{' ' + note if note else ''}"
        + (f" The other peer suites: {others}." if others else ""),
        "",
        f"Every run: {where}, {stand_in}. The tests run: {files}"
        + (" (the other files, and the tests deselected, are listed at the end with why)" if peer.left_out else "")
        + f". The optimized runs optimize every model the tests build (each {classes} class of `{peer.models}`, as "
        "the outermost one under construction returns), every attention call routed (`min_keys=0`); `check=True` "
        f"also compares each routed call's output with {peer.client}, evaluating both (models over "
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
        kinds = ", ".join(f"{n} x `{c}`" for c, n in counts["classes"].items()) or "none"
        lines += [
            "",
            f"## `optimize(model, min_keys=0{', check=True' if counts['check'] else ''})`",
            "",
            (
                f"**{len(pairs)} tests: {len(both['passed'])} pass both ways, "
                f"{len(both['failed']) + len(both['error'])} fail both ways, {len(both['skipped'])} skip both ways, "
                f"{len(found.changed)} outcome changed.**"
            ),
            "",
            (
                f"{counts['optimized']} models optimized ({kinds}){unchecked}, {counts['routed']} attention calls "
                f"routed ({tested} tests routed at least one), declined: {declined}; models whose attention optimize "
                f"cannot route (none of their modules calls {peer.client}), left plain: {unroutable}."
            ),
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
    shown = {**runs, **({f"at {peer.tests_version}'s source": at_ref} if at_ref is not None else {})}
    lines += ["", "## Failing plain", ""]
    if at_ref is not None:
        lines += [
            (
                f"The last column: each test run plain once more against {peer.name} {peer.tests_version}'s own "
                "package source (its folder first on `PYTHONPATH`); one that passes there fails here because of the "
                "version gap."
            ),
            "",
        ]
    lines += [f"| test | {' | '.join(shown)} | why |", "|---|" + "---|" * (len(shown) + 1)]
    for test in failing:
        ref = at_reference(test, at_ref) if at_ref is not None else None
        cells = [str(found.outcomes.get(test, Outcome("absent"))) for found in runs.values()]
        cells += [str(ref or Outcome("absent"))] if at_ref is not None else []
        reason = why(peer, test, plain.outcomes[test], ref)
        lines.append(f"| `{test}` | {' | '.join(cells)} | {_cell(reason)} |")
    lines += ["", "## Skipped plain", "", "| test | why |", "|---|---|"]
    lines += [
        f"| `{t}` | {_cell(why(peer, t, o))} |" for t, o in sorted(plain.outcomes.items()) if o.status == "skipped"
    ]
    if peer.left_out or peer.deselected:
        lines += ["", "## Tests not run", "", "| test file or test | why |", "|---|---|"]
        lines += [f"| `{f}` | {_cell(reason)} |" for f, reason in sorted({**peer.left_out, **peer.deselected}.items())]
    return lines, changes


def _cell(text: str) -> str:
    """``text``'s first line as a table cell: pipes escaped, at most 200 characters."""
    line = text.splitlines()[0] if text else ""
    return (line if len(line) <= 200 else line[:199] + "…").replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="*", help="pytest arguments in the tests' root (default: the record's)")
    parser.add_argument("--peer", choices=sorted(PEERS), default="mlx-lm", help="whose tests (examples/peers.py)")
    parser.add_argument("--git-dir", type=Path, help="the git clone a peer's tests come from (mlx-vlm's)")
    parser.add_argument("--cache", type=Path, default=ROOT / ".peer", help="where the tests and stand-in go")
    parser.add_argument("--write", type=Path, help="write the comparison to this markdown file")
    parser.add_argument("--reuse", action="store_true", help="compare the last runs' results again, running nothing")
    parser.add_argument("--note", default="", help="a sentence for the page's header (how this run was made)")
    options = parser.parse_args(argv)
    peer = PEERS[options.peer]
    installed = importlib.metadata.version(peer.name)
    if installed != peer.version:
        parser.error(
            f"{peer.name} {installed} is installed; examples/peers.py's record is {peer.name} {peer.version}'s"
        )
    root = options.cache.resolve() / peer.folder
    if options.reuse:
        runs = {name: Run.load(root, name) for name in RUNS}
        at_ref = Run.load(root, REFERENCE) if (root / f"{REFERENCE}.xml").is_file() else None
    else:
        root = fetch(peer, options.cache.resolve(), options.git_dir)
        model = peer.stand_in.make(root) if peer.stand_in is not None else None
        tests = options.tests or [*peer.tests, *(f"--deselect={t}" for t in peer.deselected)]
        runs = {name: run(peer, root, model, tests, name) for name in RUNS}
        at_ref = reference(peer, root, options.git_dir, runs["plain"])
    given = sys.argv[1:] if argv is None else argv
    shown = [a for i, a in enumerate(given) if a != "--note" and (i == 0 or given[i - 1] != "--note")]
    lines, changes = report(peer, runs, at_ref, " ".join(["python examples/peer_suite.py", *shown]), options.note)
    print("\n".join(lines))
    if options.write:
        options.write.write_text("\n".join(lines) + "\n")
    return 1 if changes else 0


if __name__ == "__main__":
    raise SystemExit(main())
