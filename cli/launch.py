"""``attnpass mlx-lm|mlx-vlm|vllm-mlx|mlx-openai-server COMMAND ARGS...``: a library's own entry point, its models
optimized.

:func:`run` calls the entry point's ``main()`` (:data:`ENTRY_POINTS`: mlx-lm's ``generate``, ``chat`` and
``server``, mlx-vlm's ``generate`` and ``server``, vllm-mlx's ``serve``, mlx-openai-server's ``launch``) with
``ARGS`` as its command line, untouched, while the loaders it calls (the names its module imported: ``load``,
``sharded_load``, mlx-vlm's ``load_drafter``, vllm-mlx's ``load_model_with_fallback``) are wrapped: every model they
return goes through :func:`attnpass.backends.mlx.optimize` with attnpass's :class:`Options` before the command sees it
(the draft model of ``--draft-model`` too). A model that optimize cannot route runs plain, with one warning
(``strict``: an error). A loader that fails raises an :class:`~attnpass.ir.AttnpassError` naming the command and the
model.

Contract: stdout stays the entry point's; attnpass writes to stderr only. When the command ends (it returns,
fails, or is stopped by SIGINT or SIGTERM: both raise :class:`Stopped`, a ``KeyboardInterrupt``, so that
mlx-lm's server shuts down as on Ctrl-C) the :class:`Session` prints one line per optimized model (a failed
command: per model that ran an attention call), or optimize's report (``explain``); a stopped command then
raises :class:`Stopped` again. An exception of the command is one :class:`~attnpass.ir.AttnpassError` naming
it; attnpass's own options given after the command are named with where they go (:func:`_misplaced`).

mlx-lm's server (:class:`ServerHooks`) checks that it can listen on ``--host``/``--port`` before its generation
thread starts, and listens only once that thread has loaded the command line's model: a used port and a model
that cannot be loaded each end the command with one line, before it listens. While it runs, ``GET
/attnpass/summary`` answers with the summary as JSON, and its generation thread clears its MLX streams when it
ends (:func:`_clearing_streams`). Everything is undone when the command ends: the loaders, the
server's handler and thread function, the signal handlers, ``sys.argv``, and every optimize. The session
holds each model it optimized until then (a server that switches models keeps the earlier ones loaded).

mlx-vlm's server and vllm-mlx's, FastAPI apps run by uvicorn (:class:`AppHooks`): the address and model folder are
checked before mlx-vlm is imported (a model that fails to load past that check is mlx-vlm's own failure: its
and uvicorn's logged tracebacks, status 3), :data:`SUMMARY_PATH` is a route of its app (behind its API key),
the summary is printed when uvicorn has shut down on SIGINT or SIGTERM, and its generation thread is stopped
before the process exits. ``--reload`` (the app served from a new process) is refused. mlx-openai-server creates
its app when it starts (``AppHooks.made_by``) and loads each model in a spawned process (``EntryPoint.spawned``):
the loaders are wrapped there, and that process's session writes its models to a folder the command's session
reads, for the route and the summary (printed after uvicorn's shutdown has ended those processes).

Imports only the standard library: ``attnpass --help`` lists the commands from :data:`ENTRY_POINTS` cheaply.
"""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import io
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

SUMMARY_PATH = "/attnpass/summary"
OPTIMIZE_ENV = "ATTNPASS_OPTIMIZE"  # attnpass exec's switch, read at each use, never written


@dataclass(frozen=True)
class ServerHooks:
    """Where a server command is held to fail before it listens (``"module:name"`` or ``"module:Class.name"``):
    ``run(host, port, provider)`` starts the generation thread and serves (the port is checked before it),
    ``serve(host, port, generator, server_class=...)`` listens (it waits for the first load, and binds through a
    server class whose failure names the address), ``first_load`` is the method that thread calls first to load
    the command line's model."""

    run: str
    serve: str
    first_load: str


@dataclass(frozen=True)
class AppHooks:
    """A server command that serves an ASGI app (FastAPI, Starlette) with uvicorn: ``app`` is where the app is
    (``"module:name"``); :data:`SUMMARY_PATH` is a route added to it, ahead of its own, while the command runs,
    refused as the app refuses a request when ``guard`` (``"module:name"``, a FastAPI dependency: given what it
    declares, the request or a bearer token, it raises the app's HTTP error, e.g. a missing API key) raises. uvicorn handles SIGINT and SIGTERM itself: it
    shuts down, restores the handlers it found (the session's) and raises the signal again, so the session prints
    its summary and the command ends as stopped. ``stop`` (``"module:name"``), called with no arguments when the
    command ends, stops the threads the app started that use MLX: a generation thread left to the interpreter's
    exit holds MLX streams there, and MLX aborts ("terminate called without an active exception"). ``made_by``
    (``"module:name"``): the function the command calls to create the app, by the name its caller looks up
    (mlx-openai-server's ``setup_server``, as ``app.main`` imported it); the route is added to ``app`` when it
    returns."""

    app: str
    guard: str | None = None
    stop: str | None = None
    made_by: str | None = None  # the function that creates ``app`` when the command runs (it is None until then)


@dataclass(frozen=True)
class EntryPoint:
    """A command of a model library: its ``main`` and the loaders it calls (``"module:name"`` each; a loader
    returns the model, or a tuple whose first item is the model), the HTTP handler class, if any, that
    answers :data:`SUMMARY_PATH`, the functions it runs as threads that use MLX (``"module:Class.name"``),
    which then clear their MLX streams when they end (:func:`_clearing_streams`), its server's hooks (an
    ``http.server`` one's, :class:`ServerHooks`, or an ASGI app's, :class:`AppHooks`), its options that name a
    file it reads (checked before it runs, with what makes one), a server's default ``--host`` and ``--port``
    (checked, with its ``--model`` folder, before the library is imported: :func:`_preflight`), and its options
    that attnpass refuses, with why. ``args``: the words its ``main`` reads before ``ARGS`` (a subcommand of
    its own, vllm-mlx's ``serve``); ``model``: where its command line names the model, an option or the position
    of a positional argument (checked only there). ``spawned``: the functions the server runs as the target of a
    spawned process that loads the models (mlx-openai-server's handler process): there the loaders are wrapped
    by a session of that process, whose models the command's session reads (:func:`_spawned`)."""

    main: str
    loaders: tuple[str, ...]
    handler: str | None = None
    threads: tuple[str, ...] = ()
    server: ServerHooks | AppHooks | None = None
    reads: tuple[tuple[str, str], ...] = ()
    address: tuple[str, int] | None = None
    refuses: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = ()
    model: str | int = "--model"
    spawned: tuple[str, ...] = ()


ENTRY_POINTS: dict[str, dict[str, EntryPoint]] = {
    "mlx-lm": {
        "generate": EntryPoint(
            "mlx_lm.generate:main",
            ("mlx_lm.generate:load",),
            reads=(("--prompt-cache-file", "a prompt cache .safetensors file written by mlx_lm.cache_prompt"),),
        ),
        "chat": EntryPoint("mlx_lm.chat:main", ("mlx_lm.chat:load", "mlx_lm.chat:sharded_load")),
        "server": EntryPoint(
            "mlx_lm.server:main",
            ("mlx_lm.server:load", "mlx_lm.server:sharded_load"),
            "mlx_lm.server:APIHandler",
            # the generation thread's loop: 0.31's thread target, called by 0.32's (_run_generate, which logs its error)
            ("mlx_lm.server:ResponseGenerator._generate",),
            ServerHooks(
                "mlx_lm.server:run", "mlx_lm.server:_run_http_server", "mlx_lm.server:ModelProvider.load_default"
            ),
            address=("127.0.0.1", 8080),
        ),
    },
    "mlx-vlm": {
        "generate": EntryPoint(
            "mlx_vlm.generate.dispatch:main",
            ("mlx_vlm.generate.dispatch:load", "mlx_vlm.speculative.drafters:load_drafter"),
        ),
        "server": EntryPoint(  # the generation thread's load; the decision and realtime models' (mlx_vlm.utils:load)
            "mlx_vlm.server.cli:main",
            ("mlx_vlm.server.generation:load", "mlx_vlm.utils:load", "mlx_vlm.speculative.drafters:load_drafter"),
            server=AppHooks(
                "mlx_vlm.server.app:app",
                guard="mlx_vlm.server.app:_require_management_api_key",
                stop="mlx_vlm.server.app:unload_model_sync",  # the generation thread ends, clearing its streams
            ),
            address=("0.0.0.0", 8080),
            refuses=(("--reload", "uvicorn then serves the app from a new process, which attnpass does not reach"),),
        ),
    },
    "vllm-mlx": {
        # its engines' loader, looked up at each load (mlx_lm's load, imported inside it, calls nested: not twice);
        # --mllm's loader and its draft's (mlx_vlm.utils:load, or load_drafter for an MTP one); --specprefill's draft
        "serve": EntryPoint(
            "vllm_mlx.cli:main",
            (
                "vllm_mlx.utils.tokenizer:load_model_with_fallback",
                "mlx_vlm:load",
                "mlx_vlm.utils:load",
                "mlx_vlm.speculative.drafters:load_drafter",
                "mlx_lm:load",
            ),
            server=AppHooks("vllm_mlx.server:app", guard="vllm_mlx.server:verify_api_key"),
            address=("127.0.0.1", 8000),
            args=("serve",),
            model=0,
        ),
    },
    "mlx-openai-server": {
        # each model is loaded in a spawned handler process, by the name its module imported from mlx_lm.utils;
        # a multimodal model's (mlx-vlm 0.4, below the clients extra's) runs plain
        "launch": EntryPoint(
            "app.cli:cli",
            ("app.models.mlx_lm:load",),
            server=AppHooks("app.server:app", made_by="app.main:setup_server"),  # the name start_multi calls
            address=("0.0.0.0", 8000),
            args=("launch",),
            model="--model-path",
            spawned=("app.core.handler_process:_handler_worker",),
        ),
    },
}


@dataclass(frozen=True)
class Options:
    """attnpass's options: ``optimize``'s (``pipeline`` text, ``min_keys``, ``strict``), and what the session prints
    at the end: one line per model (``summary``), optimize's report (``explain``; ``explain_full``: its whole
    form, every signature and remark), or nothing; ``summary_every``: also print the summary every so many
    seconds while the command runs (when it changed), as a server's log line."""

    pipeline: str | None = None
    min_keys: int | None = None
    strict: bool = False
    summary: bool = True
    explain: bool = False
    explain_full: bool = False
    summary_every: float | None = None


LAUNCHER_OPTIONS = {  # attnpass's options of `attnpass mlx-lm|mlx-vlm` -> whether each takes a value
    "--pipeline": True, "-p": True, "--min-keys": True, "--strict": False, "--summary": False, "--no-summary": False,
    "--explain": False, "--explain-full": False, "--summary-every": True,
}  # fmt: skip


class Stopped(KeyboardInterrupt):
    """The command was stopped by a signal: ``status`` is 128 + its number (the shell's convention)."""

    def __init__(self, signum: int) -> None:
        super().__init__("interrupted" if signum == signal.SIGINT else "terminated")
        self.status = 128 + signum


class Session:
    """The models one command loaded, each with its :class:`~attnpass.backends.mlx.OptimizedModel`.

    Thread-safe: mlx-lm's server loads its model in its generation thread while HTTP threads read the summary.
    """

    def __init__(self, label: str, options: Options, remote: Path | None = None) -> None:
        self.label = label
        self.options = options
        self.remote = remote  # where spawned processes' sessions write their models (:meth:`publishing`)
        self._models: list[tuple[str, Any]] = []  # (what the loader was given, the OptimizedModel)
        self._lock = threading.Lock()
        self._loading = threading.local()  # .active: a wrapped loader runs in this thread

    def wrap(self, loader: Callable[..., Any]) -> Callable[..., Any]:
        """``loader``, its model optimized before it is returned. A wrapped loader that another one calls (vllm-mlx's
        loader calls mlx-lm's ``load``) is left to it: its model is the outer one's, its error the outer one's to
        handle (vllm-mlx retries a ``ValueError`` of ``load`` another way)."""

        @functools.wraps(loader)
        def loading(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._loading, "active", False):
                return loader(*args, **kwargs)
            source = str(args[0] if args else next(iter(kwargs.values()), "?"))
            self._loading.active = True
            try:
                loaded = loader(*args, **kwargs)
            except Exception as exc:
                raise _load_error(self.label, source, exc) from exc
            finally:
                self._loading.active = False
            self.optimize(source, loaded[0] if isinstance(loaded, tuple) else loaded)
            return loaded

        return loading

    def optimize(self, source: str, model: Any) -> None:
        """Optimize ``model`` (loaded from ``source``); one that cannot be routed warns (``strict``: raises)."""
        from attnpass.backends.mlx import optimize
        from attnpass.ir import AttnpassError

        options = self.options
        try:
            optimized = optimize(model, options.pipeline, strict=options.strict, min_keys=options.min_keys)
        except (TypeError, ValueError) as exc:
            if options.strict:
                raise AttnpassError(f"{self.label}: {source} cannot be optimized (--strict): {exc}") from None
            warnings.warn(f"{self.label}: {source} runs plain, not optimized: {exc}", stacklevel=2)
            return
        with self._lock:
            self._models.append((source, optimized))

    def models(self) -> list[tuple[str, Any]]:
        with self._lock:
            return list(self._models)

    def spawned(self) -> list[dict[str, Any]]:
        """The models that spawned processes' sessions optimized (:meth:`as_json`'s form, with ``report_full``), as
        they last wrote them to :attr:`remote`."""
        found = []
        for path in sorted(self.remote.glob("*.json")) if self.remote is not None else ():
            try:
                found += json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # gone or being replaced: os.replace makes each write whole
        return found

    def lines(self) -> list[str]:
        """One line per optimized model: its calls routed, traces and calls declined by reason."""
        local = [summary_line(source, optimized) for source, optimized in self.models()]
        return [f"attnpass: {line}" for line in local + [model["summary"] for model in self.spawned()]]

    def report(self, full: bool = False, models: list[tuple[str, Any]] | None = None) -> str:
        """optimize's report (``OptimizedModel.explain``; ``full``: its whole form) of every model (or of
        ``models``), in turn."""
        out = io.StringIO()
        for source, optimized in self.models() if models is None else models:
            print(f"attnpass: {source}:", file=out)
            optimized.explain(file=out, full=full)
        return _as_options(out.getvalue())

    def as_json(self, full: bool = False) -> dict[str, Any]:
        """What ``GET /attnpass/summary`` answers: per model its counts, its summary line and optimize's report
        (``full``, ``?full=1``: the whole form); then the spawned processes' models."""
        spawned = [{**m, "report": m["report_full" if full else "report"]} for m in self.spawned()]
        for m in spawned:
            del m["report_full"]
        return {"command": self.label, "models": self._as_json(full) + spawned}

    def _as_json(self, full: bool) -> list[dict[str, Any]]:
        models = []
        for source, optimized in self.models():
            report = io.StringIO()
            optimized.explain(file=report, full=full)
            models.append(
                {"model": source, "class": optimized.model.__class__.__name__, "routed": optimized.routed,
                 "traces": optimized.traces, "trace_seconds": round(optimized.trace_seconds, 3),
                 "declined": dict(optimized.declined), "summary": summary_line(source, optimized),
                 "report": report.getvalue()}
            )  # fmt: skip
        return models

    @contextmanager
    def publishing(self, path: Path, seconds: float = 0.25) -> Iterator[None]:
        """While the block runs, this session's models (:meth:`as_json`'s, with ``report_full``) written to
        ``path`` whenever their counts change, checked every ``seconds``, and once more when it ends: how a spawned
        process's session reaches the command's (:meth:`spawned`)."""

        def write() -> None:
            models = [{**m, "report_full": f["report"]} for m, f in zip(self._as_json(False), self._as_json(True))]
            partial = path.with_suffix(".part")
            partial.write_text(json.dumps(models))
            os.replace(partial, path)

        def counts() -> list:
            return [(o.routed, o.traces, dict(o.declined)) for _, o in self.models()]

        try:
            with _on_change(seconds, counts, lambda _: write(), "attnpass-publish"):
                yield
        finally:
            write()

    def restore(self) -> None:
        """Undo every optimize (the models' classes, the patched clients)."""
        for _, optimized in self.models():
            optimized.restore()

    def print(self, file: TextIO, *, failed: bool = False) -> None:
        """What the options ask for at the end of the command; after a failure (``failed``) only the models that
        ran an attention call are reported (a model loaded before the failure ran nothing to report)."""
        models, spawned = self.models(), self.spawned()
        if failed:
            models = [(source, o) for source, o in models if o.routed or sum(dict(o.declined).values())]
            spawned = [m for m in spawned if m["routed"] or sum(m["declined"].values())]
        full = self.options.explain_full
        lines = [summary_line(source, optimized) for source, optimized in models] + [m["summary"] for m in spawned]
        if (models or spawned) and (self.options.explain or full):
            file.write(self.report(full, models))
            file.writelines(
                _as_options(f"attnpass: {m['model']}:\n{m['report_full' if full else 'report']}") for m in spawned
            )
        elif self.options.summary:
            file.writelines(f"attnpass: {line}\n" for line in lines)
        file.flush()

    @contextmanager
    def every(self, seconds: float | None, file: TextIO) -> Iterator[None]:
        """While the block runs, print :meth:`lines` to ``file`` every ``seconds`` when they changed (a server's
        periodic log line); None prints nothing."""
        if seconds is None:
            yield
            return

        def report(lines: list[str]) -> None:
            file.write("".join(f"{line}\n" for line in lines))
            file.flush()

        with _on_change(seconds, lambda: self.lines() or None, report, "attnpass-summary"):
            yield


@contextmanager
def _on_change(seconds: float, read: Callable[[], Any], act: Callable[[Any], None], name: str) -> Iterator[None]:
    """While the block runs, a thread named ``name`` calls ``read()`` every ``seconds`` and ``act(value)`` when
    the value is not None and differs from the last one acted on."""
    stop, last = threading.Event(), [None]

    def watch() -> None:
        while not stop.wait(seconds):
            value = read()
            if value is not None and value != last[0]:
                act(value)
                last[0] = value

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _as_options(report: str) -> str:
    """optimize's report with its Python hints said as this command's options (``--min-keys``, ``--explain-full``)."""
    return report.replace("optimize(min_keys=N)", "--min-keys N").replace("explain(full=True)", "--explain-full")


def summary_line(source: str, optimized: Any) -> str:
    """``optimize(Model) SOURCE: routed N attention call(s), T trace(s) in S s; declined: n x reason (its bound;
    the option that moves it), ...``: the trace time is in the command's own timings (mlx-lm's prompt tok/s)."""
    declined = Counter(dict(optimized.declined))  # a copy: the server's generation thread may be counting
    reasons = []
    for reason, n in declined.most_common():
        bound = optimized.decline_bound(reason)
        reasons.append(f"{n} x {reason}" + (f" ({bound}; --min-keys 0 routes them)" if bound else ""))
    name = optimized.model.__class__.__name__
    return (
        f"optimize({name}) {source}: routed {optimized.routed} attention call(s), {optimized.traces} trace(s) in "
        f"{optimized.trace_seconds:.2f} s (counted in the command's timings); declined: {', '.join(reasons) or 'none'}"
    )


def run(library: str, command: str, argv: Sequence[str], options: Options, *, err: TextIO | None = None) -> int:
    """Run ``library``'s ``command`` with the command line ``argv`` and its models optimized; its exit status.

    The session prints to ``err`` (stderr). Raises :class:`Stopped` after the summary when a signal stopped it.
    """
    from attnpass.ir.core.arguments import ArgumentError

    commands = ENTRY_POINTS.get(library, {})
    if command not in commands:
        known = ", ".join(commands) or f"none ({library!r} is not one of {', '.join(ENTRY_POINTS)})"
        raise ArgumentError(f"{library}: no command {command!r}; its commands: {known}")
    entry = commands[command]
    label = f"{library} {command}"
    if options.summary_every is not None and not options.summary_every > 0:
        raise ArgumentError(f"--summary-every must be a number of seconds > 0, got {options.summary_every!r}")
    if options.pipeline is not None:
        from attnpass.passes import parse_pipeline

        parse_pipeline(options.pipeline)  # a mistake in it is one line now, not an error inside mlx-lm's load
    for option, why in entry.refuses:  # the command line first: wrong whether or not the server is installed
        if option in argv or any(token.startswith(option + "=") for token in argv):
            raise ArgumentError(f"{label}: attnpass cannot run it with {option}: {why}; leave {option} out")
    _check_installed(label, library, entry)
    _check_reads(label, entry, argv)
    if entry.address is not None:
        _preflight(label, argv, *entry.address, model=entry.model)
    remote = Path(tempfile.mkdtemp(prefix="attnpass-")) if entry.spawned else None
    session = Session(label, options, remote)
    main = _resolve(entry.main)
    patches = [(owner, name, session.wrap(getattr(owner, name))) for owner, name in map(_owner, entry.loaders)]
    patches.append((argparse.ArgumentParser, "error", _misplaced(label, library, command, argv)))
    if entry.handler is not None:
        handler = _resolve(entry.handler)
        patches.append((handler, "do_GET", _summary_endpoint(session, handler.do_GET)))
    for target in entry.threads:
        owner, name = _owner(target)
        patches.append((owner, name, _clearing_streams(getattr(owner, name))))
    for target in entry.spawned:
        owner, name = _owner(target)
        patches.append(
            (owner, name, functools.partial(_spawned, _Child(library, command, options, str(remote)), target))
        )
    routes: list[tuple[Any, Any]] = []
    if isinstance(entry.server, ServerHooks):
        patches += _server_patches(label, entry.server)
    elif isinstance(entry.server, AppHooks) and entry.server.made_by is not None:
        owner, name = _owner(entry.server.made_by)
        patches.append((owner, name, _making(session, entry.server, getattr(owner, name), routes)))
    elif isinstance(entry.server, AppHooks):
        routes.append((_resolve(entry.server.app), _summary_route(session, entry.server)))
    stopped: list[int] = []
    status, failed = 1, True  # when a signal stops main(), or it fails
    out = err if err is not None else sys.stderr
    try:
        with (
            _patched(patches),
            _routed(routes),
            _stopping(stopped),
            _argv([f"attnpass {library}" if entry.args else f"attnpass {label}", *entry.args, *argv]),
            session.every(options.summary_every, out),
        ):
            status = _status(label, main)
            failed = False
    finally:
        try:
            if isinstance(entry.server, AppHooks) and entry.server.stop is not None:
                _resolve(entry.server.stop)()  # its threads end before the summary is read
        finally:
            session.print(out, failed=failed and not stopped)
            session.restore()
            if remote is not None:
                shutil.rmtree(remote, ignore_errors=True)
    if stopped:  # the command caught the interrupt (mlx-lm's server shuts down): report it
        raise Stopped(stopped[0])
    return status


def exec_script(
    script: str, argv: Sequence[str], options: Options, optimize: bool | None = None, *, err: TextIO | None = None
) -> int:
    """``attnpass exec SCRIPT ARGS...``: the console script ``SCRIPT``'s own command line, unchanged, with attnpass
    on or off by a switch: ``optimize`` (``--optimize``/``--no-optimize``) when given, else :data:`OPTIMIZE_ENV`
    read now (off when unset). On, it is :func:`run` of the :data:`ENTRY_POINTS` row whose ``main`` is the
    script's (and whose ``args`` begin ``ARGS``); off, ``SCRIPT`` itself replaces this process (``os.execvp``),
    attnpass not in it. vllm-mlx loads no plugin of its own: an unchanged ``vllm-mlx serve ...`` is reached by the
    startup hook (:mod:`attnpass.cli.startup`), which runs the same row."""
    import os

    from attnpass.ir.core.switches import env_switch

    out = err if err is not None else sys.stderr
    on, source = env_switch(OPTIMIZE_ENV, optimize, default=False, subject="attnpass")
    if not on:
        print(f"attnpass: {source}: {script} runs plain", file=out, flush=True)
        os.execvp(script, [script, *argv])
    library, command, rest = _console_command(script, argv)
    return run(library, command, rest, options, err=err)


def _console_command(script: str, argv: Sequence[str]) -> tuple[str, str, list[str]]:
    """``(library, command, its ARGS)``: the :data:`ENTRY_POINTS` row that console script ``script`` runs."""
    from importlib.metadata import entry_points

    from attnpass.ir.core.arguments import ArgumentError

    name = Path(script).name
    found = [e.value for e in entry_points(group="console_scripts") if e.name == name]
    known = ", ".join(f"{lib} {cmd}" for lib, cmds in ENTRY_POINTS.items() for cmd in cmds)
    if not found:
        raise ArgumentError(f"exec: {name!r} is no console script installed beside attnpass; it runs: {known}")
    for library, commands in ENTRY_POINTS.items():
        for command, entry in commands.items():
            if entry.main == found[0].replace(" ", "") and tuple(argv[: len(entry.args)]) == entry.args:
                return library, command, list(argv[len(entry.args) :])
    given = " ".join([name, *argv[:1]])
    raise ArgumentError(f"exec: {given} ({found[0]}) is none of attnpass's commands: {known}")


def _status(label: str, main: Callable[[], Any]) -> int:
    """``main()``'s exit status: 0 when it returns, the code of a ``SystemExit`` it raises (argparse's). An
    exception raised in the library's own code is raised as one :class:`~attnpass.ir.AttnpassError` naming the
    command (the library's error, not an unexpected one of attnpass's; the original is its ``__cause__``); one
    raised in attnpass's code (its innermost frame) stays what it is."""
    from attnpass.ir import AttnpassError

    try:
        main()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except (AttnpassError, BrokenPipeError):
        raise
    except Exception as exc:
        innermost = exc.__traceback__
        while innermost is not None and innermost.tb_next is not None:
            innermost = innermost.tb_next
        if innermost is not None and innermost.tb_frame.f_globals.get("__name__", "").startswith("attnpass."):
            raise
        text = str(exc).strip().splitlines()
        raise AttnpassError(f"{label} failed: {type(exc).__name__}: {text[0] if text else 'no message'}") from exc
    return 0


def _check_installed(label: str, library: str, entry: EntryPoint) -> None:
    """The package of ``entry.main`` is installed here, or one line naming the pip command that installs it (each
    row's library is its pip name)."""
    from importlib.util import find_spec

    from attnpass.ir import AttnpassError

    if find_spec(entry.main.split(".")[0].split(":")[0]) is None:
        raise AttnpassError(f"{label}: {library} is not installed here: {sys.executable} -m pip install {library}")


def _check_reads(label: str, entry: EntryPoint, argv: Sequence[str]) -> None:
    """Each of ``entry``'s options naming a file it reads, when given, must name an existing file."""
    from attnpass.ir import AttnpassError

    for option, what in entry.reads:
        for value in _values(argv, option):
            if not Path(value).is_file():
                found = "it is a directory" if Path(value).is_dir() else "no such file"
                raise AttnpassError(f"{label}: {option} {value!r}: {found}; give {what}")


def _values(argv: Sequence[str], option: str) -> list[str]:
    """The values ``option`` is given in ``argv`` (``--option VALUE`` or ``--option=VALUE``)."""
    found = []
    for i, token in enumerate(argv):
        if token == option and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif token.startswith(option + "="):
            found.append(token[len(option) + 1 :])
    return found


def _misplaced(label: str, library: str, command: str, argv: Sequence[str]) -> Callable[..., Any]:
    """argparse's ``ArgumentParser.error`` while the command parses ``argv``: when the library's parser does not
    know one of attnpass's own options given after the command (:data:`LAUNCHER_OPTIONS`), one line says where
    it goes instead of the library's usage; any other error is argparse's."""
    original = argparse.ArgumentParser.error

    def error(parser: argparse.ArgumentParser, message: str) -> Any:
        prefix = "unrecognized arguments: "
        unknown = message[len(prefix) :].split() if message.startswith(prefix) else []
        ours = [t for t in unknown if t.split("=")[0] in LAUNCHER_OPTIONS and t.split("=")[0] != "-p"]
        if not ours:
            return original(parser, message)
        from attnpass.ir.core.arguments import ArgumentError

        moved: list[str] = []
        for option in ours:
            moved.append(option)
            name = option.split("=")[0]
            if LAUNCHER_OPTIONS[name] and "=" not in option and option in argv:
                at = list(argv).index(option)
                moved += list(argv[at + 1 : at + 2])
        names = ", ".join(dict.fromkeys(o.split("=")[0] for o in ours))
        raise ArgumentError(
            f"{label}: {names} is an option of attnpass, not of {label}: give it before the command, as in "
            f"attnpass {library} {' '.join(moved)} {command} ..."
        )

    return error


def _server_patches(label: str, hooks: ServerHooks) -> list[tuple[Any, str, Any]]:
    """The patches that make a server fail before it listens: its address checked before its generation thread
    starts (``run``), the command line's model loaded before it listens (``first_load``, ``serve``)."""
    loaded = threading.Event()
    failure: list[BaseException] = []
    run_owner, run_name = _owner(hooks.run)
    serve_owner, serve_name = _owner(hooks.serve)
    load_owner, load_name = _owner(hooks.first_load)
    run, serve, first_load = (getattr(o, n) for o, n in ((run_owner, run_name), (serve_owner, serve_name),
                                                         (load_owner, load_name)))  # fmt: skip

    @functools.wraps(run)
    def running(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        _check_address(label, host, port)
        return run(host, port, *args, **kwargs)

    @functools.wraps(first_load)
    def loading(*args: Any, **kwargs: Any) -> Any:
        try:
            return first_load(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001  (the thread goes on without a model: serving() raises it)
            failure.append(exc)
            return None
        finally:
            loaded.set()

    @functools.wraps(serve)
    def serving(host: str, port: int, generator: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            thread = getattr(generator, "_generation_thread", None)
            while not loaded.wait(0.1):  # a timed wait: SIGINT and SIGTERM stop it
                if thread is not None and not thread.is_alive():
                    break
            if failure:
                raise failure[0]
            kwargs["server_class"] = _listening(label, host, port, kwargs.get("server_class"))
            return serve(host, port, generator, *args, **kwargs)
        except BaseException:
            generator.stop_and_join()
            raise

    return [(run_owner, run_name, running), (serve_owner, serve_name, serving), (load_owner, load_name, loading)]


def _preflight(label: str, argv: Sequence[str], host: str, port: int, model: str | int = "--model") -> None:
    """A server's address and local model folder checked before the library is imported (mlx-lm and mlx-vlm
    import transformers and torch: seconds): the same one-line errors :func:`_check_address` and the first load
    give, within a second. The server's own defaults (``host``, ``port``) when a flag is absent; a value the
    server's own parser would refuse is left to it. ``model``: the option naming the model, or the position of the
    positional argument that does (a model given elsewhere is left to the server)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--host", default=host)
    parser.add_argument("--port", default=str(port))
    if isinstance(model, str):
        parser.add_argument(model, dest="model", default=None)
    known, _ = parser.parse_known_args(list(argv))
    try:
        port = int(known.port)
    except ValueError:
        return
    _check_address(label, known.host, port)
    source = getattr(known, "model", None)
    if isinstance(model, int) and model < len(argv) and not argv[model].startswith("-"):
        source = argv[model]
    if source is not None:
        path = Path(source)
        if path.is_dir() and not (path / "config.json").is_file():
            raise _load_error(label, source, FileNotFoundError(f"{path / 'config.json'}"))


def _check_address(label: str, host: str, port: int) -> None:
    """``host``:``port`` can be listened on (bound as ``http.server`` binds, with ``SO_REUSEADDR``), or one
    :class:`~attnpass.ir.AttnpassError` naming it."""
    from attnpass.ir import AttnpassError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]  # fmt: skip
    except (OSError, OverflowError, UnicodeError) as exc:
        raise AttnpassError(f"{label}: cannot listen on {host}:{port}: --host {host!r}: {_reason(exc)}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except (OSError, OverflowError) as exc:
            raise AttnpassError(_listen_error(label, host, port, exc)) from None


def _listening(label: str, host: str, port: int, server_class: type | None) -> type:
    """``server_class`` (http.server's ``ThreadingHTTPServer`` when None) whose failure to bind is one
    :class:`~attnpass.ir.AttnpassError` naming the address (the port may be taken after :func:`_check_address`)."""
    from http.server import ThreadingHTTPServer

    from attnpass.ir import AttnpassError

    base: Any = server_class or ThreadingHTTPServer

    def server_bind(self: Any) -> None:
        try:
            base.server_bind(self)
        except (OSError, OverflowError) as exc:
            raise AttnpassError(_listen_error(label, host, port, exc)) from None

    return type(base.__name__, (base,), {"server_bind": server_bind})


def _listen_error(label: str, host: str, port: int, exc: BaseException) -> str:
    hints = {
        errno.EADDRINUSE: f"another process listens on port {port}: give --port a free one",
        errno.EACCES: "ports below 1024 need privileges: give --port 1024 or above",
        errno.EADDRNOTAVAIL: f"{host} is no address of this machine: give --host one of its own, e.g. 127.0.0.1",
    }
    hint = hints.get(getattr(exc, "errno", None), "--port must be 0 to 65535" if isinstance(exc, OverflowError) else "")
    return f"{label}: cannot listen on {host}:{port}: {_reason(exc)}" + (f" ({hint})" if hint else "")


def _reason(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text[:1].lower() + text[1:]


def _load_error(label: str, source: str, exc: Exception) -> Exception:
    from attnpass.ir import AttnpassError

    text = str(exc).strip().splitlines()
    first = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    path = Path(source)
    if path.is_dir() and not (path / "config.json").is_file():
        return AttnpassError(
            f"{label}: cannot load {source!r}: the folder has no config.json; a model folder holds config.json, "
            f"its *.safetensors weights and its tokenizer files (as {label.split()[0].replace('-', '_')}.convert "
            "writes them)"
        )
    where = "" if path.exists() else " (no such local path, so it was read as a Hugging Face repo id)"
    return AttnpassError(f"{label}: cannot load {source!r}{where}: {first}")


def _resolve(dotted: str) -> Any:
    owner, name = _owner(dotted)
    return getattr(owner, name)


def _owner(dotted: str) -> tuple[Any, str]:
    """``"module:name"`` -> (the imported module, name); ``"module:Class.name"`` -> (the class, name)."""
    module, name = dotted.split(":")
    owner: Any = importlib.import_module(module)
    *classes, name = name.split(".")
    for cls in classes:
        owner = getattr(owner, cls)
    return owner, name


@contextmanager
def _patched(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@contextmanager
def _stopping(stopped: list[int]) -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`Stopped` and are recorded in ``stopped`` (main thread only: elsewhere
    Python cannot install handlers, and SIGTERM keeps its default)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        stopped.append(signum)
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except Stopped:
        pass  # recorded: run() raises it again after the summary
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def _clearing_streams(target: Callable[..., Any]) -> Callable[..., Any]:
    """``target`` (a thread's function), then ``mx.clear_streams()`` in that thread when it ends.

    MLX tears a thread's streams down when the thread exits, or at process exit; a server's generation thread
    that leaves them to process exit makes MLX abort there now and then ("terminate called without an active
    exception", status -6: plain mlx-lm's server too, after Ctrl-C). MLX's ``clear_streams`` is the cleanup it
    asks threads for.
    """

    @functools.wraps(target)
    def clearing(*args: Any, **kwargs: Any) -> Any:
        try:
            return target(*args, **kwargs)
        finally:
            import mlx.core as mx

            mx.clear_streams()

    return clearing


@dataclass(frozen=True)
class _Child:
    """What a spawned process needs to wrap its loaders (:func:`_spawned`): the row, the options, and the folder
    the command's session reads its models from. Picklable: ``spawn`` sends it to the new process."""

    library: str
    command: str
    options: Options
    folder: str


def _spawned(child: _Child, target: str, *args: Any, **kwargs: Any) -> Any:
    """A spawned process's target in place of ``target`` (``"module:name"``, imported here unpatched): ``target``
    run with the row's loaders wrapped by a session of this process, which writes its models to the command's
    folder (:meth:`Session.publishing`, one file per process) while it runs and when it ends."""
    entry = ENTRY_POINTS[child.library][child.command]
    session = Session(f"{child.library} {child.command}", child.options)
    patches = [(owner, name, session.wrap(getattr(owner, name))) for owner, name in map(_owner, entry.loaders)]
    try:
        with _patched(patches), session.publishing(Path(child.folder) / f"{os.getpid()}.json"):
            return _resolve(target)(*args, **kwargs)
    finally:
        session.restore()


def _making(
    session: Session, hooks: AppHooks, make: Callable[..., Any], routes: list[tuple[Any, Any]]
) -> Callable[..., Any]:
    """``make`` (``hooks.made_by``), then :data:`SUMMARY_PATH` added to the app it created (``hooks.app``) and to
    ``routes``, which :func:`_routed` removes when the command ends."""

    @functools.wraps(make)
    def making(*args: Any, **kwargs: Any) -> Any:
        made = make(*args, **kwargs)
        route = (_resolve(hooks.app), _summary_route(session, hooks))
        route[0].router.routes.insert(0, route[1])
        routes.append(route)
        return made

    return making


def _summary_endpoint(session: Session, do_get: Callable[[Any], None]) -> Callable[[Any], None]:
    """The handler's ``do_GET``, answering :data:`SUMMARY_PATH` with :meth:`Session.as_json` (``?full=1``: the
    reports' whole form)."""

    @functools.wraps(do_get)
    def answering(handler: Any) -> None:
        path, _, query = handler.path.partition("?")
        if path != SUMMARY_PATH:
            return do_get(handler)
        full = "full=1" in query.split("&") or "full=true" in query.split("&")
        body = json.dumps(session.as_json(full)).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return answering


def _summary_route(session: Session, hooks: AppHooks) -> Any:
    """The FastAPI app's route answering :data:`SUMMARY_PATH` with :meth:`Session.as_json` (``?full=1``: the
    reports' whole form), behind ``hooks.guard`` as a dependency of the route (FastAPI gives it what it declares: the
    request, a bearer token). A plain function: FastAPI runs it in its thread pool, off the event loop."""
    from fastapi import Depends
    from fastapi.responses import JSONResponse
    from fastapi.routing import APIRoute

    def summary(full: str = "") -> Any:
        return JSONResponse(session.as_json(full in ("1", "true")))

    guards = [Depends(_resolve(hooks.guard))] if hooks.guard is not None else []
    return APIRoute(SUMMARY_PATH, summary, methods=["GET"], name="attnpass_summary", dependencies=guards,
                    response_model=None, include_in_schema=False)  # fmt: skip


@contextmanager
def _routed(routes: list[tuple[Any, Any]]) -> Iterator[None]:
    """Each ``(app, route)``'s route ahead of the app's own routes while the block runs."""
    for app, route in routes:
        app.router.routes.insert(0, route)
    try:
        yield
    finally:
        for app, route in routes:
            app.router.routes.remove(route)


__all__ = [
    "ENTRY_POINTS", "LAUNCHER_OPTIONS", "OPTIMIZE_ENV", "SUMMARY_PATH", "AppHooks", "EntryPoint", "Options",
    "ServerHooks", "Session", "Stopped", "exec_script", "run", "summary_line",
]  # fmt: skip
