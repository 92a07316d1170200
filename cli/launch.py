"""``attnpass mlx-lm|mlx-vlm COMMAND ARGS...``: a model library's own entry point, the models it loads optimized.

:func:`run` calls the entry point's ``main()`` (:data:`ENTRY_POINTS`: mlx-lm's ``generate``, ``chat`` and
``server``, mlx-vlm's ``generate``) with ``ARGS`` as its command line, untouched, while the loaders it calls
(the names its module imported: ``load``, ``sharded_load``, mlx-vlm's ``load_drafter``) are wrapped: every
model they return goes through :func:`attnpass.backends.mlx.optimize` with attnpass's :class:`Options`
before the command sees it (the draft model of ``--draft-model`` too). A model that optimize cannot route
runs plain, with one warning (``strict``: an error). A loader that fails raises an
:class:`~attnpass.ir.AttnpassError` naming the command and the model.

Contract: stdout stays the entry point's; attnpass writes to stderr only. When the command ends (it returns,
fails, or is stopped by SIGINT or SIGTERM: both raise :class:`Stopped`, a ``KeyboardInterrupt``, so that
mlx-lm's server shuts down as on Ctrl-C) the :class:`Session` prints one line per optimized model, or
optimize's whole report (``explain``); a stopped command then raises :class:`Stopped` again. While mlx-lm's
server runs, ``GET /attnpass/summary`` answers with the same as JSON, and its generation thread clears its MLX
streams when it ends (:func:`_clearing_streams`). Everything is undone when the command ends: the loaders, the
server's handler and thread function, the signal handlers, ``sys.argv``, and every optimize. The session
holds each model it optimized until then (a server that switches models keeps the earlier ones loaded).

Imports only the standard library: ``attnpass --help`` lists the commands from :data:`ENTRY_POINTS` cheaply.
"""

from __future__ import annotations

import functools
import importlib
import io
import json
import signal
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

SUMMARY_PATH = "/attnpass/summary"


@dataclass(frozen=True)
class EntryPoint:
    """A command of a model library: its ``main`` and the loaders it calls (``"module:name"`` each; a loader
    returns the model, or a tuple whose first item is the model), the HTTP handler class, if any, that
    answers :data:`SUMMARY_PATH`, and the functions it runs as threads that use MLX (``"module:Class.name"``),
    which then clear their MLX streams when they end (:func:`_clearing_streams`)."""

    main: str
    loaders: tuple[str, ...]
    handler: str | None = None
    threads: tuple[str, ...] = ()


ENTRY_POINTS: dict[str, dict[str, EntryPoint]] = {
    "mlx-lm": {
        "generate": EntryPoint("mlx_lm.generate:main", ("mlx_lm.generate:load",)),
        "chat": EntryPoint("mlx_lm.chat:main", ("mlx_lm.chat:load", "mlx_lm.chat:sharded_load")),
        "server": EntryPoint(
            "mlx_lm.server:main",
            ("mlx_lm.server:load", "mlx_lm.server:sharded_load"),
            "mlx_lm.server:APIHandler",
            ("mlx_lm.server:ResponseGenerator._run_generate",),
        ),
    },
    "mlx-vlm": {
        "generate": EntryPoint(
            "mlx_vlm.generate.dispatch:main",
            ("mlx_vlm.generate.dispatch:load", "mlx_vlm.speculative.drafters:load_drafter"),
        ),
    },
}


@dataclass(frozen=True)
class Options:
    """attnpass's options: ``optimize``'s (``pipeline`` text, ``min_keys``, ``strict``), and what the session prints
    at the end: one line per model (``summary``), optimize's whole report (``explain``), or nothing."""

    pipeline: str | None = None
    min_keys: int | None = None
    strict: bool = False
    summary: bool = True
    explain: bool = False


class Stopped(KeyboardInterrupt):
    """The command was stopped by a signal: ``status`` is 128 + its number (the shell's convention)."""

    def __init__(self, signum: int) -> None:
        super().__init__("interrupted" if signum == signal.SIGINT else "terminated")
        self.status = 128 + signum


class Session:
    """The models one command loaded, each with its :class:`~attnpass.backends.mlx.OptimizedModel`.

    Thread-safe: mlx-lm's server loads its model in its generation thread while HTTP threads read the summary.
    """

    def __init__(self, label: str, options: Options) -> None:
        self.label = label
        self.options = options
        self._models: list[tuple[str, Any]] = []  # (what the loader was given, the OptimizedModel)
        self._lock = threading.Lock()

    def wrap(self, loader: Callable[..., Any]) -> Callable[..., Any]:
        """``loader``, its model optimized before it is returned."""

        @functools.wraps(loader)
        def loading(*args: Any, **kwargs: Any) -> Any:
            source = str(args[0] if args else next(iter(kwargs.values()), "?"))
            try:
                loaded = loader(*args, **kwargs)
            except Exception as exc:
                raise _load_error(self.label, source, exc) from exc
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

    def lines(self) -> list[str]:
        """One line per optimized model: its calls routed, traces and calls declined by reason."""
        return [f"attnpass: {summary_line(source, optimized)}" for source, optimized in self.models()]

    def report(self) -> str:
        """optimize's whole report (``OptimizedModel.explain``) of every model, one after the other."""
        out = io.StringIO()
        for source, optimized in self.models():
            print(f"attnpass: {source}:", file=out)
            optimized.explain(file=out)
        return out.getvalue()

    def as_json(self) -> dict[str, Any]:
        """What ``GET /attnpass/summary`` answers: per model its counts and optimize's report."""
        models = []
        for source, optimized in self.models():
            report = io.StringIO()
            optimized.explain(file=report)
            models.append(
                {"model": source, "class": optimized.model.__class__.__name__, "routed": optimized.routed,
                 "traces": optimized.traces, "declined": dict(optimized.declined), "report": report.getvalue()}
            )  # fmt: skip
        return {"command": self.label, "models": models}

    def restore(self) -> None:
        """Undo every optimize (the models' classes, the patched clients)."""
        for _, optimized in self.models():
            optimized.restore()

    def print(self, file: TextIO) -> None:
        """What the options ask for at the end of the command."""
        if self.options.explain:
            file.write(self.report())
        elif self.options.summary:
            for line in self.lines():
                print(line, file=file)
        file.flush()


def summary_line(source: str, optimized: Any) -> str:
    """``optimize(Model) SOURCE: routed N attention call(s), T trace(s); declined: n x reason, ...``."""
    declined = Counter(dict(optimized.declined))  # a copy: the server's generation thread may be counting
    reasons = ", ".join(f"{n} x {reason}" for reason, n in declined.most_common()) or "none"
    name = optimized.model.__class__.__name__
    return (
        f"optimize({name}) {source}: routed {optimized.routed} attention call(s), {optimized.traces} trace(s); "
        f"declined: {reasons}"
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
    if options.pipeline is not None:
        from attnpass.passes import parse_pipeline

        parse_pipeline(options.pipeline)  # a mistake in it is one line now, not an error inside mlx-lm's load
    session = Session(f"{library} {command}", options)
    main = _resolve(entry.main)
    patches = [(owner, name, session.wrap(getattr(owner, name))) for owner, name in map(_owner, entry.loaders)]
    if entry.handler is not None:
        handler = _resolve(entry.handler)
        patches.append((handler, "do_GET", _summary_endpoint(session, handler.do_GET)))
    for target in entry.threads:
        owner, name = _owner(target)
        patches.append((owner, name, _clearing_streams(getattr(owner, name))))
    stopped: list[int] = []
    status = 1  # when a signal stops main()
    try:
        with _patched(patches), _stopping(stopped), _argv([f"attnpass {library} {command}", *argv]):
            status = _status(main)
    finally:
        session.print(err if err is not None else sys.stderr)
        session.restore()
    if stopped:  # the command caught the interrupt (mlx-lm's server shuts down): report it
        raise Stopped(stopped[0])
    return status


def _status(main: Callable[[], Any]) -> int:
    """``main()``'s exit status: 0 when it returns, the code of a ``SystemExit`` it raises (argparse's)."""
    try:
        main()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def _load_error(label: str, source: str, exc: Exception) -> Exception:
    from attnpass.ir import AttnpassError

    text = str(exc).strip().splitlines()
    first = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    where = "" if Path(source).exists() else " (no such local path, so it was read as a Hugging Face repo id)"
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


def _summary_endpoint(session: Session, do_get: Callable[[Any], None]) -> Callable[[Any], None]:
    """The handler's ``do_GET``, answering :data:`SUMMARY_PATH` with :meth:`Session.as_json`."""

    @functools.wraps(do_get)
    def answering(handler: Any) -> None:
        if handler.path.split("?")[0] != SUMMARY_PATH:
            return do_get(handler)
        body = json.dumps(session.as_json()).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    return answering


__all__ = ["ENTRY_POINTS", "SUMMARY_PATH", "EntryPoint", "Options", "Session", "Stopped", "run", "summary_line"]
