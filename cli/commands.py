"""The subcommands of ``attnpass``: each takes the parsed arguments and prints to stdout.

Graph files are the JSON of ``Graph.to_json()`` or the printed text form
(``print(graph)``, read back with ``parse_graph``); ``-`` reads standard input.
The weights of an imported graph (``ImportedGraph.save``) are read from
``--params`` or the graph file's sibling ``.safetensors`` and written beside
``run -o OUT``. Errors are raised as exceptions and turned into one-line
messages by :func:`attnpass.cli.main.main`. Each command imports the layers it
needs when it runs: lowering only to lower, a backend only to run or export a program.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from attnpass.ir import AttnpassError, Graph, GraphFormatError, PrintSettings, format_graph, parse_graph
from attnpass.ir.core.serialize import MAX_JSON_BYTES

from . import output


def load_graph(path: str) -> Graph:
    """A graph from a JSON (or printed text) file, or from stdin for ``-``; at most MAX_JSON_BYTES are read."""
    if path == "-":
        data = sys.stdin.buffer.read(MAX_JSON_BYTES + 1) if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    else:
        with open(path, "rb") as f:
            data = f.read(MAX_JSON_BYTES + 1)
    try:
        text = data if isinstance(data, str) else data.decode("utf-8")
        if len(text) > MAX_JSON_BYTES:
            raise GraphFormatError(f"more than the {MAX_JSON_BYTES} bytes a graph file may hold")
        return Graph.from_json(text) if text.lstrip().startswith("{") else parse_graph(text)
    except UnicodeDecodeError as exc:
        raise GraphFormatError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except AttnpassError as exc:
        raise type(exc)(f"{path}: {exc}") from None


def save_graph(graph: Graph, path: str) -> None:
    Path(path).write_text(graph.to_json(indent=1) + "\n")


def show(args: argparse.Namespace) -> int:
    graph = load_graph(args.graph)
    if args.locs:
        graph = output.relocate(graph, output.path_style(args.full_paths))
    print(format_graph(graph, PrintSettings(show_locs=args.locs)))
    return 0


def _run_pipeline(args: argparse.Namespace, instrumentations: list, default: list | None = None):
    """Load the graph (or the reproducer) and run the pipeline with the requested instrumentation; ``default``:
    the passes to run when no ``--pipeline`` is given (None: it is required)."""
    import tempfile

    from attnpass.ir.core.types import printable
    from attnpass.passes import PassManager, load_reproducer, parse_pipeline

    if args.reproducer is not None:
        if args.pipeline is not None or args.graph is not None or args.mesh is not None:
            raise AttnpassError("--reproducer replays a saved crash: give neither --pipeline, --mesh nor GRAPH")
        rep = load_reproducer(args.reproducer)
        after = ", ".join(map(printable, rep.after)) or "none"
        print(f"// replaying {args.reproducer}: pipeline {rep.pipeline!r} (ran after: {after})")
        passes, graph, reproducer_dir = rep.passes, rep.graph, None
    else:
        if args.graph is None or (args.pipeline is None and default is None):
            raise AttnpassError("give --pipeline TEXT and a GRAPH file (or --reproducer FILE)")
        if args.pipeline is not None and not args.pipeline.strip():  # running no pass is never what `run` is for
            raise AttnpassError("--pipeline is empty: name at least one pass, e.g. -p dce (see: attnpass passes)")
        passes = parse_pipeline(args.pipeline) if args.pipeline is not None else default
        graph = load_graph(args.graph)
        reproducer_dir = args.reproducer_dir or tempfile.gettempdir()
        if args.mesh is not None:
            axes = _mesh_axes(args.mesh)
            try:
                graph.set_mesh(axes)
            except AttnpassError as exc:
                raise type(exc)(f"--mesh: {exc}") from None
    manager = PassManager(
        passes,
        fixed_point=args.fixed_point,
        instrumentations=instrumentations,
        reproducer_dir=reproducer_dir,
        plugin_loads=args.plugin_loads,
    )
    return graph, manager.run(graph)


def _print_remarks(args: argparse.Namespace, remarks, *, summary_after: bool = False) -> None:
    """Every remark (wrapped on a terminal), or with ``--summary`` one line per pass; ``--quiet`` prints nothing.

    ``--remarks-json FILE`` gets every remark, whole, in any case.
    """
    paths = output.path_style(args.full_paths)
    if args.remarks_json:
        Path(args.remarks_json).write_text(output.remarks_json(remarks, paths))
    if getattr(args, "quiet", False):
        return
    if not args.summary:
        width = output.terminal_width() if args.width is None else args.width
        for remark in remarks:
            print(output.format_remark(remark, paths, width))
    if args.summary or summary_after:
        for line in output.summary_lines(remarks):
            print(line)


def _read_weights(args: argparse.Namespace, graph: Graph) -> dict[str, Any]:
    """The weights of an imported graph: ``--params FILE`` or the GRAPH file's sibling ``.safetensors``."""
    from attnpass.ir.frontends.weights import load_weights, require_weights_file, weight_inputs

    if args.graph is None:  # a reproducer carries no weights
        if args.params is not None:
            raise AttnpassError(f"--params {args.params}: a reproducer carries no weights; give --params with GRAPH")
        return {}
    if args.params is not None and not weight_inputs(graph):
        raise AttnpassError(
            f"--params {args.params}: graph {graph.name} ({args.graph}) has no weight inputs to read it into (an "
            "imported graph's weights are inputs with a path); leave --params out for this graph"
        )
    file = require_weights_file(graph, args.graph, args.params)
    return load_weights(graph, file) if file is not None else {}


def run(args: argparse.Namespace) -> int:
    from attnpass.ir.frontends.weights import save_weights, weight_inputs, weights_file
    from attnpass.passes import PassTimings, PrintAfterChange

    _check_outputs(args)
    timings = PassTimings()
    hooks: list = [PrintAfterChange()] if args.print_after_change else []
    graph, result = _run_pipeline(args, hooks + [timings] if args.timings else hooks)
    weights = _read_weights(args, graph)
    _print_remarks(args, result.remarks)
    if args.timings:
        print(timings.table())
    if args.output:
        save_graph(result.graph, args.output)
        if not args.quiet:
            status = "changed" if result.changed else "unchanged"
            print(f"// wrote {args.output}: {status}, {len(graph)} -> {len(result.graph)} nodes")
        if weight_inputs(result.graph):
            written = save_weights(result.graph, weights, weights_file(args.output))
            if not args.quiet:
                print(f"// wrote {written}: {len(weight_inputs(result.graph))} weights")
    else:
        print(result.graph)
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """The files ``run``/``explain`` write (``-o`` JSON with its ``.safetensors`` beside it, ``--remarks-json``),
    checked before any pass runs."""
    if getattr(args, "output", None) is not None:
        _writable(args.output, (".json",))
    if args.remarks_json is not None:
        _writable(args.remarks_json)


def _default_pipeline(args: argparse.Namespace) -> list | None:
    """``explain`` without ``--pipeline``: the default pipeline of ``--device`` (cpu), announced on one line."""
    from attnpass.ir.core.arguments import require_choice
    from attnpass.passes import default_pipeline, format_pipeline
    from attnpass.passes.analysis.devices import DEVICES

    if args.pipeline is not None or args.reproducer is not None:
        if args.device is not None:
            raise AttnpassError("--device picks the default pipeline: give it without --pipeline or --reproducer")
        return None
    device = require_choice("attnpass explain", "--device", args.device or "cpu", list(DEVICES))
    passes = default_pipeline(device)
    print(f"// pipeline: the default for device {device} (default_pipeline({device!r})): {format_pipeline(passes)}")
    return passes


def explain(args: argparse.Namespace) -> int:
    _check_outputs(args)
    _, result = _run_pipeline(args, [], _default_pipeline(args))
    _print_remarks(args, result.remarks, summary_after=True)
    return 0


def diff(args: argparse.Namespace) -> int:
    from attnpass.ir import diff_graphs

    result = diff_graphs(load_graph(args.before), load_graph(args.after))
    text = result.unified((args.before, args.after), args.context)
    if text:
        print(text)
    print(result.summary())
    return 1 if args.exit_code and not result.identical else 0


def render_command(args: argparse.Namespace) -> int:
    from attnpass.ir import render

    against = load_graph(args.highlight_against) if args.highlight_against else None
    path = render(load_graph(args.graph), args.output, against=against)
    print(f"// wrote {path}")
    return 0


def _mesh_axes(text: str) -> dict[str, int]:
    """``--mesh data=2,model=4`` as mesh axes, name -> size in order."""
    from attnpass.ir.core.sharding import parse_mesh

    try:
        axes = parse_mesh(text)
    except AttnpassError as exc:
        raise type(exc)(f"--mesh: {exc}") from None
    if not axes:
        raise AttnpassError("--mesh is empty: name the mesh axes with their sizes, e.g. --mesh model=8")
    return axes


def lower_command(args: argparse.Namespace) -> int:
    """The generated source only: the program is not compiled, so the backend is not imported."""
    from attnpass.lowering import get_target, sharded_lowering
    from attnpass.lowering.codegen import generate
    from attnpass.lowering.sharding import check_mesh_axes

    graph, target = load_graph(args.graph), get_target(args.target)
    spmd = None
    if args.mesh is not None:  # the sharded source: the axes must fit the graph's mesh; no devices needed
        spmd = sharded_lowering(target, "--mesh")
        check_mesh_axes(graph, _mesh_axes(args.mesh))
    print(generate(graph, target, comments=not args.no_comments, spmd=spmd).text.rstrip("\n"))
    return 0


def _writable(path: str, suffixes: tuple[str, ...] = ()) -> Path:
    """``path``, checked before any work is done: a known suffix (one of ``suffixes``, when given), not a
    directory, in an existing directory this process may write to (a late error would waste the run)."""
    from attnpass.ir.core.types import printable

    out, shown = Path(path), printable(str(path))
    if suffixes and out.suffix not in suffixes:
        given = f"suffix {printable(out.suffix)!r}" if out.suffix else "no suffix"
        raise AttnpassError(f"cannot write {shown}: {given}; valid: {', '.join(suffixes)}")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise AttnpassError(f"cannot write {shown}: no directory {printable(str(parent))}")
    if out.is_dir():
        raise AttnpassError(f"cannot write {shown}: it is a directory")
    if not os.access(parent, os.W_OK):
        raise AttnpassError(f"cannot write {shown}: directory {printable(str(parent))} is not writable")
    return out


def export(args: argparse.Namespace) -> int:
    from attnpass.lowering import export_formats, lower, sharded_lowering

    graph = load_graph(args.graph)
    target = export_formats()[args.target]
    axes, spmd = (None, None) if args.mesh is None else (_mesh_axes(args.mesh), sharded_lowering(target, "--mesh"))
    spec = target.export
    if spec.suffix and not args.output:
        raise AttnpassError(f"--target {spec.format} writes a binary {spec.suffix} file: give -o FILE{spec.suffix}")
    out = _writable(args.output) if args.output else None
    try:
        mesh = None if spmd is None else spmd.make_mesh(axes)  # abstract when there are fewer devices
        program = lower(graph, target.name, mesh=mesh)
        if spec.suffix:
            print(f"// wrote {spec.function(program, out)} (load it with {spec.loader})")
            return 0
        text = spec.function(program)
    except (AttnpassError, ImportError, OSError):
        raise
    except Exception as exc:  # the backend's own failure (MLX raises RuntimeError, JAX XlaRuntimeError, ...)
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise AttnpassError(f"export to {spec.format} failed in the backend: {type(exc).__name__}: {reason}") from None
    if out is not None:
        out.write_text(text)
        print(f"// wrote {args.output}")
    else:
        print(text.rstrip("\n"))
    return 0


def example(args: argparse.Namespace) -> int:
    from attnpass.models import EXAMPLES, build_example

    if args.name is None:
        for name, ex in EXAMPLES.items():
            options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in ex.options.items())
            print(f"{name}  ({options})\n    {ex.summary}\n    try: --pipeline '{ex.pipeline}'")
        return 0
    options = {k: getattr(args, k) for k in ("layers", "q_len", "n_kv") if getattr(args, k) is not None}
    graph = build_example(args.name, **options)
    if not args.full_paths:  # no install path in the file: the module's own path
        graph = output.relocate(graph, lambda file: output.module_path(file) or file)
    text = graph.to_json(indent=1) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def first_sentence(doc: str) -> str:
    """A docstring's first sentence, whole (up to the first ``.`` that ends a word), on one line."""
    text = " ".join(doc.strip().split("\n\n", 1)[0].split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


PROMISE = (
    "the name of a graph input holding each row's selected key indices, which the caller promises distinct per row, "
    "or none: proven from the graph"
)
OPTION_HELP: dict[tuple[str, str], str] = {
    # (pass, option) -> what it does and what is valid; "{choices}" is filled by option_choices(); an option of
    # every pass with an on/off switch is under ("*", name)
    ("*", "enabled"): "true runs the pass, false declines every candidate; none: the environment variable {env_var} "
    "decides when the pass runs (off when false/off/no/0)",
    ("block-sparse", "device"): "the device whose tile size (query rows per tile) is used: one of {choices}",
    ("block-sparse", "block_q"): "query rows per tile, an int >= 1; none: the device's",
    ("canonicalize", "fold"): "which ops of constants fold: one of {choices} (exact: only the ops every target "
    "computes bit for bit as the reference does; reference: transcendental ops too)",
    ("decompose-sdpa", "device"): "the device whose strategy is taken (fused call, or GQA-folded matmul/softmax): "
    "one of {choices}",
    ("decompose-sdpa", "max_q_len"): "the most query rows of a call it decomposes (decode-shaped), an int >= 1",
    ("decompose-sdpa", "target"): "the backend the program is lowered to (mlx on cpu: the fused call's own rounding): "
    "one of {choices}, or none",
    ("decompose-sdpa", "widen_quantized"): "true computes a half-float quantized_sdpa on CPU in float32 (faster "
    "there, not the model's bits); false keeps its dtype",
    ("dsa-gather", "tile_bytes"): "gathered K/V bytes per tile of query rows, an int >= 0; 0 gathers all rows at once",
    ("dsa-gather", "selection_input"): PROMISE,
    ("dsa-gather", "rows_have_keys"): "true promises that every query row selects at least one key",
    (
        "head-chunk",
        "budget",
    ): "the most q_len * query heads a subcall may have (the fused kernel's budget), an int >= 1",
    ("mla-absorb", "crossover_factor"): "attend in the latent form below this factor times the model's crossover "
    "depth, a finite number > 0",
    ("mla-absorb", "selection_input"): PROMISE,
    ("mla-absorb", "rows_have_keys"): "true promises that every query row selects at least one key",
    ("qsa-gather", "max_rows"): "the most query rows of a decode-shaped call (more: a prefill, see prefill_tile), an "
    "int >= 1",
    ("qsa-gather", "min_depth_factor"): "gather only when the cache holds at least this many times the gathered "
    "cells, a number",
    ("qsa-gather", "pad_multiple"): "the gathered cells are padded to a multiple of this, an int >= 1",
    ("qsa-gather", "selection_input"): "the name of a graph input holding the indexer's selected blocks, or none: "
    "the graph's qsa_select",
    ("qsa-gather", "prefill_tile"): "query rows per gathered tile of a prefill, an int >= 0; 0 keeps a prefill masked",
    ("qsa-pool-cache", "max_rows"): "the most query rows of a call it rewrites, an int >= 1",
    ("qsa-pool-cache", "store"): "what the resident cache holds: one of {choices} (keys: the block keys, pooled only "
    "for the newest block; pooled: the pooled keys)",
    ("raise-attention", "canonicalize"): "true canonicalizes the graph first (layout chains, constants); false "
    "raises the graph as it is",
    ("shard-attention", "heads"): "the mesh axis the KV heads (with their query heads) are sharded over, or none",
    ("shard-attention", "batch"): "the mesh axis the streams are sharded over, or none",
    ("shard-attention", "seq"): "the mesh axis the keys are sharded over (combined by log-sum-exp), or none; at least "
    "one of heads, batch, seq is given",
    ("split-kv", "shards"): "the number of key shards, combined exactly by log-sum-exp, an int >= 2",
}


def option_choices(pass_name: str, option: str) -> list[str] | None:
    """The values a text option of a built-in pass may take, read from the pass's own table; None when any
    value of its type is valid."""
    if option == "device" and pass_name in ("block-sparse", "decompose-sdpa"):
        from attnpass.passes.analysis.devices import DEVICES

        return list(DEVICES)
    if (pass_name, option) == ("decompose-sdpa", "target"):
        from attnpass.passes.rewrites.decompose_sdpa import TARGETS

        return list(TARGETS)
    if (pass_name, option) == ("canonicalize", "fold"):
        from attnpass.passes.rewrites.canonicalize import FOLD_MODES

        return list(FOLD_MODES)
    if (pass_name, option) == ("qsa-pool-cache", "store"):
        from attnpass.passes.rewrites.qsa_pool_cache import STORES

        return list(STORES)
    return None


def option_help(cls: type, option: str) -> str | None:
    """What ``cls``'s ``option`` does and what is valid (:data:`OPTION_HELP`), None when it has no entry."""
    text = OPTION_HELP.get((cls.name, option)) or OPTION_HELP.get(("*", option))
    if text is None:
        return None
    choices = option_choices(cls.name, option) or []
    return text.format(choices=", ".join(choices), env_var=getattr(cls, "env_var", None) or "of the pass")


def passes(args: argparse.Namespace) -> int:
    """Every registered pass: its class, its docstring's first sentence, and its options with their type, default,
    what each does and what is valid."""
    from attnpass.passes import PipelineError, available_passes, get_pass
    from attnpass.passes.infra.pipeline_text import pass_options

    for name in available_passes():
        try:
            cls = get_pass(name)
        except PipelineError as exc:  # a broken plugin must not hide the others
            print(f"{name}  (not loadable: {exc})")
            continue
        summary = first_sentence(cls.__doc__ or "")
        print(f"{name}  ({cls.__module__}.{cls.__qualname__})\n    {summary}")
        for option in pass_options(cls):
            print(f"    option {option}")
            described = option_help(cls, option.name) if option.kinds else None
            if described is not None:
                print(f"        {described}")
    return 0


__all__ = [
    "diff", "example", "explain", "export", "load_graph", "lower_command", "passes", "render_command", "run",
    "save_graph", "show",
]  # fmt: skip


def launch(args: argparse.Namespace) -> int:
    """``attnpass mlx-lm|mlx-vlm COMMAND ARGS...``: the library's own command, the models it loads optimized."""
    from .launch import Options, run

    options = Options(
        args.pipeline, args.min_keys, args.strict, args.summary, args.explain, args.explain_full, args.summary_every
    )
    if args.library == "exec":
        from dataclasses import replace

        from .launch import exec_script
        from .main import build_parser
        from .startup import env_options

        # the switch's option variables (ATTNPASS_MIN_KEYS, ...), as the startup hook reads them; given options win
        given = build_parser().parse_args(["exec", *env_options(), args.entry])
        options = replace(
            options,
            pipeline=options.pipeline if options.pipeline is not None else given.pipeline,
            min_keys=options.min_keys if options.min_keys is not None else given.min_keys,
            strict=options.strict or given.strict,
            summary_every=options.summary_every if options.summary_every is not None else given.summary_every,
        )
        return exec_script(args.entry, args.entry_args, options, args.optimize)
    return run(args.library, args.entry, args.entry_args, options)


def hook(args: argparse.Namespace) -> int:
    """``attnpass hook install|remove|status``: the startup hook's file in this Python's site-packages
    (:mod:`attnpass.cli.hook`); status exits 1 when it is not installed."""
    from . import hook as startup_hook

    if args.action == "status":
        installed, line = startup_hook.status()
        print(line)
        return 0 if installed else 1
    print(startup_hook.install() if args.action == "install" else startup_hook.remove())
    return 0
