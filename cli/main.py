"""attnpass: inspect graphs, run textual pass pipelines, diff, render, lower and export.

Every subcommand has ``--help``. Every failure ends with one line on stderr
(``attnpass: error: ...``) and exit status 2 (usage) or 1, backend errors
included (``--traceback`` shows the Python traceback of an unexpected one);
a crashing pass prints its PassError, the crash reproducer it wrote and the
command that replays it. Warnings are one line too, named by where they come from (``attnpass: warning:
...``; a library's, e.g. mlx-lm's while ``attnpass mlx-lm`` runs its command: ``mlx-lm: warning: ...``). A
command stopped by SIGINT or SIGTERM says so on one line, without ``error``.

Startup stays cheap (``benchmarks/startup.py``): this module imports only the
standard library; a subcommand imports what it needs when it runs
(:mod:`attnpass.cli.commands`), so ``attnpass --help`` loads no numpy,
networkx or backend.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from .launch import ENTRY_POINTS

PIPELINE_HELP = "textual pipeline, e.g. 'dce,head-chunk{budget=16},qsa-gather{pad_multiple=256}' (see: attnpass passes)"
MESH_HELP = "device mesh axes in order, e.g. data=2,model=4"
GRAPH_HELP = "graph file: JSON (Graph.to_json) or the printed text form (print(graph)); - for stdin"
FULL_PATHS_HELP = "show source locations as recorded (default: relative to the working directory or the module)"


class LazyNames:
    """argparse ``choices`` computed only when parsing or help needs them (``names`` imports what it reads)."""

    def __init__(self, names: Callable[[], Iterable[str]]) -> None:
        self.names = names

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.names()))

    def __contains__(self, name: object) -> bool:
        return name in list(self.names())


def _target_names() -> list[str]:
    from attnpass.lowering import available_targets

    return [t.name for t in available_targets()]


def _export_names() -> list[str]:
    from attnpass.lowering import export_formats

    return list(export_formats())


class LazyVersion(argparse.Action):
    """``--version``: reads the installed version only when asked (importlib.metadata is slow to import)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import importlib.metadata

        try:
            version = importlib.metadata.version("attnpass")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        sys.stdout.write(f"{parser.prog} {version}\n")
        parser.exit()


def positive_seconds(text: str) -> float:
    """``--summary-every SECONDS``: a finite number > 0 (argparse's usage error otherwise)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def non_negative(text: str) -> int:
    """``--width N``: an int >= 0 (argparse's usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


def _remark_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--summary", action="store_true", help="one line per pass (applied/declined counts), no remarks")
    sub.add_argument("--remarks-json", metavar="FILE", help="also write every remark, whole, as JSON to FILE")
    sub.add_argument("--full-paths", action="store_true", help=FULL_PATHS_HELP)
    sub.add_argument(
        "--width",
        type=non_negative,
        metavar="N",
        help="wrap remarks at N columns, 0 never (default: the terminal's width, at most 100; no wrapping off a terminal)",
    )


def _pipeline_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("graph", nargs="?", metavar="GRAPH", help=GRAPH_HELP)
    sub.add_argument("--pipeline", "-p", metavar="TEXT", help=PIPELINE_HELP)
    sub.add_argument("--reproducer", metavar="FILE", help="replay a crash reproducer instead of --pipeline/GRAPH")
    sub.add_argument("--fixed-point", action="store_true", help="repeat the pipeline until nothing changes (bounded)")
    sub.add_argument("--mesh", metavar="AXES", help=f"declare the graph's mesh before the pipeline ({MESH_HELP})")
    sub.add_argument(
        "--reproducer-dir",
        metavar="DIR",
        help="where a crashing pass writes attnpass-crash-<hash>.json (default: the system temp directory)",
    )
    _remark_options(sub)


LAUNCH_EPILOG = """\
Everything after COMMAND is {library}'s own command line, passed through untouched
(attnpass {library} COMMAND --help shows its flags); attnpass's options go before COMMAND.
stdout stays {library}'s; at exit (SIGINT and SIGTERM included) attnpass prints one line
per optimized model on stderr: attention calls routed, traces and their time, calls
declined by reason with the bound behind each and the option that moves it. A server
command checks its --host/--port and loads its --model before it listens, and answers
GET /attnpass/summary (JSON; ?full=1: the whole report). Commands: {commands}.

example: attnpass {library} --min-keys 0 generate --model DIR --prompt "hello" --max-tokens 16"""


EXEC_EPILOG = """\
COMMAND is a console script (vllm-mlx, mlx_lm.server, ...) and ARGS its own command line,
untouched: with ATTNPASS_OPTIMIZE=1 (or --optimize) it runs as attnpass LIBRARY COMMAND ARGS
would, the models it loads optimized; unset or 0 (or --no-optimize), COMMAND itself replaces
attnpass's process, plain. A service's command line stays the same either way.

example: ATTNPASS_OPTIMIZE=1 attnpass exec vllm-mlx serve DIR --port 8000"""


HOOK_EPILOG = """\
install writes attnpass_startup.pth to this Python's site-packages: at each interpreter start
of this environment, with ATTNPASS_OPTIMIZE=1 set, a server's unchanged command line (vllm-mlx
serve MODEL ..., mlx_lm.server ...) runs as attnpass LIBRARY COMMAND ... would; its options come
from ATTNPASS_PIPELINE, ATTNPASS_MIN_KEYS, ATTNPASS_STRICT and ATTNPASS_SUMMARY_EVERY. Unset, the
line reads one variable and imports nothing. remove deletes the file; status says whether it is
installed (exit status 0) or not (1).

example: attnpass hook install && ATTNPASS_OPTIMIZE=1 ATTNPASS_MIN_KEYS=0 vllm-mlx serve DIR"""


def _launcher_options(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--pipeline", "-p", metavar="TEXT", help=f"optimize's pipeline (default: the device's); {PIPELINE_HELP}"
    )
    sub.add_argument(
        "--min-keys",
        type=non_negative,
        metavar="N",
        help="route calls over at least N key rows (default: optimize's per-dtype bound on CPU; 0 routes every call)",
    )
    sub.add_argument(
        "--strict",
        action="store_true",
        help="a signature that cannot be compiled, or a model that cannot be optimized, is an error (default: "
        "it runs plain, with a warning)",
    )
    sub.add_argument(
        "--summary",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="at exit, one line per optimized model on stderr (default: on)",
    )
    sub.add_argument(
        "--explain",
        action="store_true",
        help="at exit, optimize's report instead: declines with their bounds, each program's decisions by kind",
    )
    sub.add_argument(
        "--explain-full", action="store_true", help="at exit, optimize's whole report: every signature and remark"
    )
    sub.add_argument(
        "--summary-every",
        type=positive_seconds,
        metavar="SECONDS",
        help="also print the summary line every SECONDS while the command runs, when it changed (a server's log; "
        "default: only at exit)",
    )
    sub.add_argument("entry", metavar="COMMAND", help="the library's command")
    sub.add_argument("entry_args", nargs=argparse.REMAINDER, metavar="ARGS", help="its own command line")


class Parser(argparse.ArgumentParser):
    """argparse's parser; an unknown option given with no command also lists the commands."""

    commands: tuple[str, ...] = ()

    def error(self, message: str):  # type: ignore[override]
        if message.startswith("unrecognized arguments") and self.commands and not self._command_given:
            message += f"; give a COMMAND: one of {', '.join(self.commands)} (attnpass COMMAND --help)"
        super().error(message)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        given = sys.argv[1:] if args is None else list(args)
        self._command_given = bool(set(given) & set(self.commands))
        return super().parse_args(args, namespace)


def build_parser() -> Parser:
    parser = Parser(prog="attnpass", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action=LazyVersion, help="show the version and exit")
    parser.add_argument(
        "--load",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module (name or .py file) that registers passes with @register_pass; repeatable",
    )
    parser.add_argument(
        "--traceback", action="store_true", help="on an unexpected error, show the Python traceback (for bug reports)"
    )
    # not required: argparse would then answer an unknown option before the command with "COMMAND is
    # required" instead of naming it; main() asks for a missing command itself, listing them
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, func: str, help: str) -> argparse.ArgumentParser:
        sub = subs.add_parser(name, help=help, description=help)
        sub.set_defaults(func=func)
        return sub

    sub = add("show", "show", "print a saved graph in the text form")
    sub.add_argument("graph", metavar="GRAPH", help=GRAPH_HELP)
    sub.add_argument("--locs", action="store_true", help="append each node's source location")
    sub.add_argument("--full-paths", action="store_true", help=FULL_PATHS_HELP)

    sub = add("run", "run", "apply a textual pipeline to a saved graph, print remarks, save the result")
    _pipeline_options(sub)
    sub.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="write the result as JSON to OUT, a .json file (an imported graph's weights go beside it, .safetensors) "
        "(default: print its text form)",
    )
    sub.add_argument(
        "--print-after-change", action="store_true", help="print the graph after every pass that changed it"
    )
    sub.add_argument("--timings", action="store_true", help="print a per-pass timing table")
    sub.add_argument("-q", "--quiet", action="store_true", help="print no remarks and no '// wrote' line")
    sub.add_argument(
        "--params",
        metavar="FILE",
        help="weights of an imported graph (safetensors; default: GRAPH's sibling .safetensors); "
        "with -o they are written beside OUT",
    )

    sub = add("explain", "explain", "print every remark of a pipeline (applied and declined), nothing else")
    _pipeline_options(sub)
    sub.add_argument(
        "--device",
        metavar="NAME",
        help="without --pipeline: explain the default pipeline of this device, cpu, metal, gpu or tpu (default: cpu)",
    )

    sub = add("diff", "diff", "unified diff of two graphs' text forms plus added/removed/changed nodes")
    sub.add_argument("before", metavar="A", help="graph file (before): JSON or text form")
    sub.add_argument("after", metavar="B", help="graph file (after): JSON or text form")
    sub.add_argument("-U", "--context", type=int, default=3, metavar="N", help="lines of context (default: 3)")
    sub.add_argument("--exit-code", action="store_true", help="exit with status 1 when the graphs differ")

    sub = add("render", "render_command", "draw a graph (Graphviz dot layout) to SVG, PNG or DOT")
    sub.add_argument("graph", metavar="GRAPH", help=GRAPH_HELP)
    sub.add_argument("-o", "--output", required=True, metavar="FILE", help="FILE.svg, FILE.png or FILE.dot")
    sub.add_argument(
        "--highlight-against", metavar="BEFORE", help="highlight nodes added (orange) or changed (yellow) since BEFORE"
    )

    sub = add("lower", "lower_command", "print the generated source of a graph lowered to a target")
    sub.add_argument("graph", metavar="GRAPH", help=GRAPH_HELP)
    targets = LazyNames(_target_names)
    sub.add_argument("--target", "-t", required=True, choices=targets, metavar="TARGET", help="%(choices)s")
    sub.add_argument("--no-comments", action="store_true", help="omit the comments pointing back to graph nodes")
    sub.add_argument("--mesh", metavar="AXES", help=f"the sharded program over a mesh with these axes ({MESH_HELP})")

    sub = add("export", "export", "export a graph for other compilers: MLX .mlxfn or StableHLO text")
    sub.add_argument("graph", metavar="GRAPH", help=GRAPH_HELP)
    formats = LazyNames(_export_names)
    sub.add_argument("--target", "-t", required=True, choices=formats, metavar="FORMAT", help="%(choices)s")
    sub.add_argument("-o", "--output", metavar="FILE", help="output file (stablehlo: default stdout)")
    sub.add_argument("--mesh", metavar="AXES", help=f"export the sharded program ({MESH_HELP})")

    sub = add("example", "example", "write a built-in example graph as JSON (no NAME: list them)")
    sub.add_argument("name", nargs="?", metavar="NAME", help="example name (attnpass example lists them)")
    sub.add_argument("--layers", type=int, help="number of layers (qwen38-model)")
    sub.add_argument("--q-len", type=int, help="query rows per step")
    sub.add_argument("--n-kv", type=int, help="KV cache length in cells")
    sub.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    sub.add_argument(
        "--full-paths", action="store_true", help="keep source locations as traced (default: module paths)"
    )

    add("passes", "passes", "list the registered passes and their options")
    for library, commands in ENTRY_POINTS.items():
        _launcher_options(add(library, "launch", f"run {library}'s own command line, the models it loads optimized"))
        subs.choices[library].epilog = LAUNCH_EPILOG.format(library=library, commands=", ".join(commands))
        subs.choices[library].formatter_class = argparse.RawDescriptionHelpFormatter
        subs.choices[library].set_defaults(library=library)
    sub = add("exec", "launch", "run a console script's own command line, attnpass on or off by ATTNPASS_OPTIMIZE")
    _launcher_options(sub)
    sub.add_argument(
        "--optimize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="attnpass on or off, whatever ATTNPASS_OPTIMIZE says (default: ATTNPASS_OPTIMIZE, read now; off unset)",
    )
    sub.epilog = EXEC_EPILOG
    sub.formatter_class = argparse.RawDescriptionHelpFormatter
    sub.set_defaults(library="exec")
    sub = add("hook", "hook", "install, remove or show the startup hook: ATTNPASS_OPTIMIZE for unchanged servers")
    sub.add_argument("action", choices=("install", "remove", "status"), help="%(choices)s")
    sub.epilog = HOOK_EPILOG
    sub.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.commands = tuple(subs.choices)
    return parser


def load_plugin(spec: str) -> None:
    """Import a pass plugin given as a module name or a path to a .py file; any failure is an AttnpassError."""
    from attnpass.ir import AttnpassError

    try:
        if spec.endswith(".py"):
            path = Path(spec)
            module_name = f"attnpass_plugin_{path.stem}"  # never shadows an imported module of the same stem
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None or not path.is_file():
                raise AttnpassError(f"--load {spec}: no such Python file")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[module_name]
                raise
        else:
            importlib.import_module(spec)
    except AttnpassError:
        raise
    except ImportError as exc:
        raise AttnpassError(f"--load {spec}: {exc}") from None
    except Exception as exc:  # a syntax error, or the plugin itself failing as it is imported
        raise AttnpassError(f"--load {spec}: {type(exc).__name__}: {exc}") from None


def _fail(message: str, status: int = 1) -> int:
    print(f"attnpass: error: {message}", file=sys.stderr)
    return status


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    text = _first_line(message) if isinstance(message, Warning) else (str(message).strip().splitlines() or [""])[0]
    print(f"{warning_source(category, filename)}: warning: {text}", file=sys.stderr)


def warning_source(category: type, filename: str) -> str:
    """Who a warning is from: ``attnpass`` for its own categories and files, else the top package of the module
    that warned (``mlx_lm/server.py`` -> ``mlx-lm``), else the file's name."""
    if getattr(category, "__module__", "").split(".")[0] == "attnpass":
        return "attnpass"
    from .output import module_path

    module = module_path(filename) if filename else None
    if module is None:
        return os.path.basename(filename or "") or "python"
    return module.split("/")[0].removesuffix(".py").replace("_", "-")


def _run(args: argparse.Namespace) -> int:
    for spec in args.load:
        load_plugin(spec)
    command: Callable[[argparse.Namespace], int] = getattr(importlib.import_module("attnpass.cli.commands"), args.func)
    # a crash reproducer records the loaded modules, and its replay command loads them again
    args.plugin_loads = tuple(str(Path(spec).resolve()) if spec.endswith(".py") else spec for spec in args.load)
    return command(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"give a COMMAND: one of {', '.join(parser.commands)} (attnpass COMMAND --help)")
    shown = warnings.showwarning
    warnings.showwarning = _show_warning  # one line, like the errors
    try:
        return _run(args)
    except BrokenPipeError:  # e.g. `attnpass show big.json | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt as exc:  # Ctrl-C; attnpass mlx-lm's launch.Stopped: how it ends (no error)
        status = getattr(exc, "status", None)
        if status is None:
            return _fail(str(exc) or "interrupted", 130)
        print(f"attnpass: {exc} by {signal.Signals(status - 128).name}", file=sys.stderr)
        return status
    except Exception as exc:
        if args.traceback:
            raise
        return _fail(describe(exc))
    finally:
        warnings.showwarning = shown


def describe(exc: Exception) -> str:
    """The one-line message of a failure (a crashing pass keeps its reproducer lines)."""
    from attnpass.ir import AttnpassError
    from attnpass.passes import PassError

    if isinstance(exc, PassError):  # the whole message: the reproducer and how to replay it
        return str(exc)
    if isinstance(exc, (AttnpassError, ValueError)):
        return _first_line(exc)
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}: {exc.filename}" if exc.filename else _first_line(exc)
    if isinstance(exc, ImportError):
        return f"a backend is missing: {exc}"
    if isinstance(exc, MemoryError):
        return "out of memory"
    return f"{type(exc).__name__}: {_first_line(exc)} (unexpected: rerun with --traceback to see where)"
