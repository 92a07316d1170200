"""attnpass: inspect graphs, run textual pass pipelines, diff, render, lower and export.

Every subcommand has ``--help``. A usage mistake or bad input ends with one
line on stderr (``attnpass: error: ...``) and exit status 2 (usage) or 1;
a crashing pass prints its PassError, the crash reproducer it wrote and the
command that replays it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from attnpass.ir import AttnpassError
from attnpass.lowering import available_targets, export_formats
from attnpass.models import EXAMPLES
from attnpass.passes import PassError

from . import commands

PIPELINE_HELP = "textual pipeline, e.g. 'dce,head-chunk{budget=16},qsa-gather{pad_multiple=256}' (see: attnpass passes)"
MESH_HELP = "device mesh axes in order, e.g. data=2,model=4"


def _version() -> str:
    try:
        return importlib.metadata.version("attnpass")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _pipeline_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("graph", nargs="?", metavar="GRAPH", help="graph JSON file (from Graph.to_json); - for stdin")
    sub.add_argument("--pipeline", "-p", metavar="TEXT", help=PIPELINE_HELP)
    sub.add_argument("--reproducer", metavar="FILE", help="replay a crash reproducer instead of --pipeline/GRAPH")
    sub.add_argument("--fixed-point", action="store_true", help="repeat the pipeline until nothing changes (bounded)")
    sub.add_argument("--mesh", metavar="AXES", help=f"declare the graph's mesh before the pipeline ({MESH_HELP})")
    sub.add_argument(
        "--reproducer-dir",
        metavar="DIR",
        default=tempfile.gettempdir(),
        help="where a crashing pass writes attnpass-crash-<hash>.json (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnpass", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--load",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module (name or .py file) that registers passes with @register_pass; repeatable",
    )
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        sub = subs.add_parser(name, help=help, description=help)
        sub.set_defaults(func=func)
        return sub

    sub = add("show", commands.show, "print a saved graph in the text form")
    sub.add_argument("graph", metavar="GRAPH", help="graph JSON file; - for stdin")
    sub.add_argument("--locs", action="store_true", help="append each node's source location")

    sub = add("run", commands.run, "apply a textual pipeline to a saved graph, print remarks, save the result")
    _pipeline_options(sub)
    sub.add_argument("-o", "--output", metavar="OUT", help="write the result as JSON (default: print its text form)")
    sub.add_argument(
        "--print-after-change", action="store_true", help="print the graph after every pass that changed it"
    )
    sub.add_argument("--timings", action="store_true", help="print a per-pass timing table")

    sub = add("explain", commands.explain, "print every remark of a pipeline (applied and declined), nothing else")
    _pipeline_options(sub)

    sub = add("diff", commands.diff, "unified diff of two graphs' text forms plus added/removed/changed nodes")
    sub.add_argument("before", metavar="A", help="graph JSON file (before)")
    sub.add_argument("after", metavar="B", help="graph JSON file (after)")
    sub.add_argument("-U", "--context", type=int, default=3, metavar="N", help="lines of context (default: 3)")
    sub.add_argument("--exit-code", action="store_true", help="exit with status 1 when the graphs differ")

    sub = add("render", commands.render_command, "draw a graph (Graphviz dot layout) to SVG, PNG or DOT")
    sub.add_argument("graph", metavar="GRAPH", help="graph JSON file; - for stdin")
    sub.add_argument("-o", "--output", required=True, metavar="FILE", help="FILE.svg, FILE.png or FILE.dot")
    sub.add_argument(
        "--highlight-against", metavar="BEFORE", help="highlight nodes added (orange) or changed (yellow) since BEFORE"
    )

    sub = add("lower", commands.lower_command, "print the generated source of a graph lowered to a target")
    sub.add_argument("graph", metavar="GRAPH", help="graph JSON file; - for stdin")
    targets = [t.name for t in available_targets()]
    sub.add_argument("--target", "-t", required=True, choices=targets, help="lowering target")
    sub.add_argument("--no-comments", action="store_true", help="omit the comments pointing back to graph nodes")
    sub.add_argument("--mesh", metavar="AXES", help=f"the sharded program over a mesh with these axes ({MESH_HELP})")

    sub = add("export", commands.export, "export a graph for other compilers: MLX .mlxfn or StableHLO text")
    sub.add_argument("graph", metavar="GRAPH", help="graph JSON file; - for stdin")
    sub.add_argument("--target", "-t", required=True, choices=list(export_formats()), help="export format")
    sub.add_argument("-o", "--output", metavar="FILE", help="output file (stablehlo: default stdout)")
    sub.add_argument("--mesh", metavar="AXES", help=f"export the sharded program ({MESH_HELP})")

    sub = add("example", commands.example, "write a built-in example graph as JSON (no NAME: list them)")
    sub.add_argument("name", nargs="?", metavar="NAME", help=", ".join(EXAMPLES))
    sub.add_argument("--layers", type=int, help="number of layers (qwen38-model)")
    sub.add_argument("--q-len", type=int, help="query rows per step")
    sub.add_argument("--n-kv", type=int, help="KV cache length in cells")
    sub.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")

    add("passes", commands.passes, "list the registered passes and their options")
    return parser


def load_plugin(spec: str) -> None:
    """Import a pass plugin given as a module name or a path to a .py file."""
    if spec.endswith(".py"):
        path = Path(spec)
        module_name = f"attnpass_plugin_{path.stem}"  # never shadows an imported module of the same stem
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        if module_spec is None or module_spec.loader is None or not path.is_file():
            raise AttnpassError(f"--load {spec}: no such Python file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        module_spec.loader.exec_module(module)
    else:
        try:
            importlib.import_module(spec)
        except ImportError as exc:
            raise AttnpassError(f"--load {spec}: {exc}") from None


def _fail(message: str, status: int = 1) -> int:
    print(f"attnpass: error: {message}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for spec in args.load:
            load_plugin(spec)
        return args.func(args)
    except PassError as exc:  # a crashing pass: the whole message, with the reproducer and how to replay it
        return _fail(str(exc))
    except (AttnpassError, ValueError) as exc:
        return _fail(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    except BrokenPipeError:  # e.g. `attnpass show big.json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        return _fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc))
    except ImportError as exc:
        return _fail(f"a backend is missing: {exc}")
