"""Benchmark: how long the ``attnpass`` command takes to start, and what each command imports.

    .venv/bin/python benchmarks/startup.py              # fastest of 10 warm runs per command
    .venv/bin/python benchmarks/startup.py --repeat 30

Each command runs in a fresh interpreter (``python -m attnpass.cli ...``,
what the ``attnpass`` script does), after one untimed warm-up run, so the
numbers are warm starts: the OS file cache holds the modules. The fastest run
is shown (single runs on a shared machine vary by far more than the
differences measured here); ``python -c pass`` is the floor no command can go
below. The target is ``attnpass --help`` under 150 ms warm, which leaves it
to the interpreter, argparse and our own parser (``attnpass.cli.main``
imports only the standard library). The last column lists the heavy
third-party modules the command imported: ``--help`` imports none, ``lower``
prints the generated source without importing its backend.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("numpy", "networkx", "jax", "mlx", "ml_dtypes")
PROBE = """
import runpy, sys
sys.argv = ["attnpass", *sys.argv[1:]]
try:
    runpy.run_module("attnpass.cli", run_name="__main__")
except SystemExit:
    pass
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(%r))
print("IMPORTED", ",".join(heavy) or "-", file=sys.stderr)
""" % (HEAVY,)


def fastest(argv: list[str], repeat: int) -> float:
    """Best wall seconds of ``argv`` over ``repeat`` runs, after one warm-up run."""
    subprocess.run(argv, capture_output=True, check=False)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=False)
        best = min(best, time.perf_counter() - start)
    return best


def imported(args: list[str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True)
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("IMPORTED ")]
    return lines[-1].split(" ", 1)[1] if lines else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="timed runs per command (default: 10)")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        graph = str(Path(tmp) / "g.json")
        subprocess.run([sys.executable, "-m", "attnpass.cli", "example", "qwen38-verify", "-o", graph], check=True)
        commands = {
            "python -c pass": None,
            "attnpass --help": ["--help"],
            "attnpass --version": ["--version"],
            "attnpass show g.json": ["show", graph],
            "attnpass lower -t jax g.json": ["lower", "-t", "jax", graph],
            "attnpass lower -t mlx g.json": ["lower", "-t", "mlx", graph],
        }
        print(f"{'command':<32} {'fastest ms':>10}  heavy imports")
        for label, args in commands.items():
            argv = [sys.executable, "-c", "pass"] if args is None else [sys.executable, "-m", "attnpass.cli", *args]
            ms = fastest(argv, options.repeat) * 1e3
            print(f"{label:<32} {ms:>10.1f}  {'-' if args is None else imported(args)}")


if __name__ == "__main__":
    main()
