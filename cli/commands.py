"""The subcommands of ``attnpass``: each takes the parsed arguments and prints to stdout.

Graph files are the JSON of ``Graph.to_json()`` (the printed text form is
accepted too); ``-`` reads standard input. Errors are raised as exceptions
and turned into one-line messages by :func:`attnpass.cli.main.main`.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from attnpass.ir import AttnpassError, Graph, PrintSettings, diff_graphs, format_graph, parse_graph, render
from attnpass.ir.core.sharding import parse_mesh
from attnpass.lowering import Target, export_formats, get_target, lower
from attnpass.models import EXAMPLES, build_example
from attnpass.passes import (
    Instrumentation,
    PassManager,
    PassResult,
    PassTimings,
    PipelineError,
    PrintAfterChange,
    available_passes,
    get_pass,
    load_reproducer,
    parse_pipeline,
)
from attnpass.passes.pipeline import pass_options


def load_graph(path: str) -> Graph:
    """A graph from a JSON (or printed text) file, or from stdin for ``-``."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    try:
        return Graph.from_json(text) if text.lstrip().startswith("{") else parse_graph(text)
    except AttnpassError as exc:
        raise type(exc)(f"{path}: {exc}") from None


def save_graph(graph: Graph, path: str) -> None:
    Path(path).write_text(graph.to_json(indent=1) + "\n")


def show(args: argparse.Namespace) -> int:
    print(format_graph(load_graph(args.graph), PrintSettings(show_locs=args.locs)))
    return 0


def _run_pipeline(args: argparse.Namespace, instrumentations: list[Instrumentation]) -> tuple[Graph, PassResult]:
    """Load the graph (or the reproducer) and run the pipeline with the requested instrumentation."""
    if args.reproducer is not None:
        if args.pipeline is not None or args.graph is not None or args.mesh is not None:
            raise AttnpassError("--reproducer replays a saved crash: give neither --pipeline, --mesh nor GRAPH")
        rep = load_reproducer(args.reproducer)
        after = ", ".join(rep.after) or "none"
        print(f"// replaying {args.reproducer}: pipeline {rep.pipeline!r} (ran after: {after})")
        passes, graph, reproducer_dir = rep.passes, rep.graph, None
    else:
        if args.pipeline is None or args.graph is None:
            raise AttnpassError("give --pipeline TEXT and a GRAPH file (or --reproducer FILE)")
        passes, graph, reproducer_dir = parse_pipeline(args.pipeline), load_graph(args.graph), args.reproducer_dir
        if args.mesh is not None:
            graph.set_mesh(parse_mesh(args.mesh))
    manager = PassManager(
        passes, fixed_point=args.fixed_point, instrumentations=instrumentations, reproducer_dir=reproducer_dir
    )
    return graph, manager.run(graph)


def run(args: argparse.Namespace) -> int:
    timings = PassTimings()
    hooks: list[Instrumentation] = [PrintAfterChange()] if args.print_after_change else []
    graph, result = _run_pipeline(args, hooks + [timings] if args.timings else hooks)
    for remark in result.remarks:
        print(remark)
    if args.timings:
        print(timings.table())
    if args.output:
        save_graph(result.graph, args.output)
        status = "changed" if result.changed else "unchanged"
        print(f"// wrote {args.output}: {status}, {len(graph)} -> {len(result.graph)} nodes")
    else:
        print(result.graph)
    return 0


def explain(args: argparse.Namespace) -> int:
    _, result = _run_pipeline(args, [])
    for remark in result.remarks:
        print(remark)
    counts = Counter((r.pass_name, r.kind) for r in result.remarks)
    for name in dict.fromkeys(r.pass_name for r in result.remarks):
        print(f"// {name}: {counts[name, 'applied']} applied, {counts[name, 'declined']} declined")
    return 0


def diff(args: argparse.Namespace) -> int:
    result = diff_graphs(load_graph(args.before), load_graph(args.after))
    text = result.unified((args.before, args.after), args.context)
    if text:
        print(text)
    print(result.summary())
    return 1 if args.exit_code and not result.identical else 0


def render_command(args: argparse.Namespace) -> int:
    against = load_graph(args.highlight_against) if args.highlight_against else None
    path = render(load_graph(args.graph), args.output, against=against)
    print(f"// wrote {path}")
    return 0


def _mesh(target: Target, axes: str | None) -> object:
    """The target's mesh for ``--mesh AXES`` (None without the option)."""
    if axes is None:
        return None
    if target.spmd is None:
        raise AttnpassError(f"--mesh: target {target.name!r} has no sharded lowering")
    return target.spmd.make_mesh(parse_mesh(axes))


def lower_command(args: argparse.Namespace) -> int:
    mesh = _mesh(get_target(args.target), args.mesh)
    print(lower(load_graph(args.graph), args.target, comments=not args.no_comments, mesh=mesh).source.rstrip("\n"))
    return 0


def export(args: argparse.Namespace) -> int:
    target = export_formats()[args.target]
    program = lower(load_graph(args.graph), target.name, mesh=_mesh(target, args.mesh))
    spec = target.export
    if spec.suffix:
        if not args.output:
            raise AttnpassError(f"--target {spec.format} writes a binary {spec.suffix} file: give -o FILE{spec.suffix}")
        path = spec.function(program, args.output)
        print(f"// wrote {path} (load it with {spec.loader})")
        return 0
    text = spec.function(program)
    if args.output:
        Path(args.output).write_text(text)
        print(f"// wrote {args.output}")
    else:
        print(text.rstrip("\n"))
    return 0


def example(args: argparse.Namespace) -> int:
    if args.name is None:
        for name, ex in EXAMPLES.items():
            options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in ex.options.items())
            print(f"{name}  ({options})\n    {ex.summary}\n    try: --pipeline '{ex.pipeline}'")
        return 0
    options = {k: getattr(args, k) for k in ("layers", "q_len", "n_kv") if getattr(args, k) is not None}
    text = build_example(args.name, **options).to_json(indent=1) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def passes(args: argparse.Namespace) -> int:
    for name in available_passes():
        try:
            cls = get_pass(name)
        except PipelineError as exc:  # a broken plugin must not hide the others
            print(f"{name}  (not loadable: {exc})")
            continue
        summary = (cls.__doc__ or "").strip().split("\n", 1)[0]
        print(f"{name}  ({cls.__module__}.{cls.__qualname__})\n    {summary}")
        for option in pass_options(cls):
            print(f"    option {option}")
    return 0


__all__ = [
    "diff", "example", "explain", "export", "load_graph", "lower_command", "passes", "render_command", "run",
    "save_graph", "show",
]  # fmt: skip
