"""What ``attnpass hook install``'s ``.pth`` line imports at interpreter start when ``ATTNPASS_OPTIMIZE`` is set
(:mod:`attnpass.cli.hook`): a server's unchanged command line (``vllm-mlx serve MODEL ...``) runs as attnpass's
command of its :data:`~attnpass.cli.launch.ENTRY_POINTS` row would (``attnpass vllm-mlx serve MODEL ...``).

The ``.pth`` line calls :func:`start` once per process: when ``ATTNPASS_OPTIMIZE`` is on (read now, never written)
and the program being run, ``sys.argv[0]``, is a console script whose function is a row's ``main``, a finder on
``sys.meta_path`` waits for that function's module to be imported and replaces the function there. The console
script then calls the replacement, which puts the original back (the row's :func:`~attnpass.cli.launch.run`
resolves it) and runs ``attnpass LIBRARY [OPTIONS] COMMAND ARGS`` (:func:`attnpass.cli.main.main`: its summary,
its errors and its exit status). ``OPTIONS`` come from :data:`ENV_OPTIONS`. A command line whose words match no
row's (``vllm-mlx bench``) runs plain, with one line saying so. Any other program, and any program when the switch
is off, is left alone, with only :mod:`attnpass.cli`'s standard-library modules imported (the ``.pth`` line imports
none of them when the switch is unset). Nothing raises here: a failure is one warning line on stderr, and the
program runs plain.

A console script is a file of a few lines that pip writes (``from vllm_mlx.cli import main`` ...
``sys.exit(main())``): its import line is read (at most :data:`SCRIPT_BYTES`), so no package metadata is scanned.
``python -m MODULE`` is not covered: the module then runs as ``__main__``, whose ``main`` cannot be replaced before
it is called.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .launch import ENTRY_POINTS, OPTIMIZE_ENV  # the package imported it already (attnpass.cli.main's table)

# attnpass's launcher options, given by environment variables (read at start, never written): option -> variable
ENV_OPTIONS = {
    "--pipeline": "ATTNPASS_PIPELINE",
    "--min-keys": "ATTNPASS_MIN_KEYS",
    "--strict": "ATTNPASS_STRICT",
    "--summary-every": "ATTNPASS_SUMMARY_EVERY",
}
SCRIPT_BYTES = 4096  # a console script is shorter; a longer file is no console script
_IMPORT = re.compile(r"^from ([A-Za-z_][\w.]*) import ([A-Za-z_]\w*)\s*$", re.MULTILINE)


def script_target(path: str) -> str | None:
    """``"module:name"``, the function the console script at ``path`` calls (the ``from MODULE import NAME`` line
    of the file pip writes), or None when ``path`` is no such script."""
    try:
        with open(path, "rb") as file:
            head = file.read(SCRIPT_BYTES + 1)
    except OSError:
        return None
    if len(head) > SCRIPT_BYTES or not head.startswith(b"#!"):
        return None
    try:
        text = head.decode()
    except UnicodeDecodeError:
        return None
    found = _IMPORT.findall(text)
    if len(found) != 1 or "sys.exit(" not in text:
        return None
    return ":".join(found[0])


def env_options(environ: dict[str, str] | None = None) -> list[str]:
    """The launcher options :data:`ENV_OPTIONS`' variables give, as command-line words (``--min-keys 0``); a
    variable unset or empty gives none. ``ATTNPASS_STRICT`` is a switch (1/on/yes/true, 0/off/no/false).
    A value the option refuses raises ``ValueError`` naming the variable and what is valid."""
    environ = os.environ if environ is None else environ
    words: list[str] = []
    for option, variable in ENV_OPTIONS.items():
        raw = environ.get(variable, "").strip()
        if not raw:
            continue
        if option == "--strict":
            on = _switch(raw)
            if on is None:
                raise ValueError(f"{variable}={raw!r}: give 1/on/yes/true or 0/off/no/false")
            words += [option] if on else []
            continue
        if option == "--min-keys" and not (raw.isdigit()):
            raise ValueError(f"{variable}={raw!r}: give an int >= 0 (the fewest key rows a routed call has)")
        if option == "--summary-every":
            try:
                seconds = float(raw)
            except ValueError:
                seconds = float("nan")
            if not seconds > 0:
                raise ValueError(f"{variable}={raw!r}: give a number of seconds > 0")
        words += [option, raw]
    return words


def start(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> bool:
    """Install the finder when the switch is on and ``argv[0]`` (default ``sys.argv``) is a console script of an
    :data:`~attnpass.cli.launch.ENTRY_POINTS` row's ``main``; whether it did. Never raises: a failure is one
    warning line on stderr."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    raw = environ.get(OPTIMIZE_ENV, "").strip()
    program = os.path.basename(argv[0]) if argv else ""
    try:
        if not raw or not argv:
            return False
        target = script_target(argv[0])
        if target is None:
            return False
        rows = [(lib, cmd, entry.args) for lib, cmds in ENTRY_POINTS.items() for cmd, entry in cmds.items()
                if entry.main == target]  # fmt: skip
        if not rows:
            return False
        on = _switch(raw)
        if on is None:
            _warn(f"{OPTIMIZE_ENV}={raw!r} is not a recognised value (1/on/yes/true or 0/off/no/false): {program} "
                  "runs plain")  # fmt: skip
            return False
        if not on:
            return False
        options = env_options(environ)
        module, name = target.split(":")
        finder = _Replacing(module, name, functools.partial(_replacement, rows=rows, options=options, program=program))
        if module in sys.modules:
            finder.replace(sys.modules[module])
        else:
            sys.meta_path.insert(0, finder)
        return True
    except Exception as exc:  # noqa: BLE001  (interpreter start: the program runs plain)
        _warn(f"{OPTIMIZE_ENV}: {program} runs plain: {type(exc).__name__}: {exc}")
        return False


class _Replacing:
    """A ``sys.meta_path`` finder for one module: it finds it as the finders after it do, and once the module has
    run, replaces its function ``name`` by ``make(module, original, name)``; then it leaves ``sys.meta_path``."""

    def __init__(self, module: str, name: str, make: Callable[..., Callable[..., Any]]) -> None:
        self.module, self.name, self.make = module, name, make

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        """The module's spec as the other finders find it, its loader's ``exec_module`` then replacing; None for
        any other module."""
        if fullname != self.module:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            self.replace(module)

        spec.loader.exec_module = exec_module  # this spec's loader only (one per module found)
        return spec

    def replace(self, module: Any) -> None:
        """Replace the function in ``module``, which has run; a failure is one warning line (it runs plain)."""
        try:
            original = getattr(module, self.name)
            setattr(module, self.name, self.make(module, original, self.name))
        except Exception as exc:  # noqa: BLE001
            _warn(f"{OPTIMIZE_ENV}: {self.module}:{self.name} runs plain: {type(exc).__name__}: {exc}")


def _replacement(
    module: Any, original: Callable[..., Any], name: str, *, rows: list, options: list[str], program: str
) -> Callable[..., Any]:
    """The console script's function: the row whose words begin the command line, run by attnpass's command line
    (the original put back first: the row's ``run`` resolves it); no row's words: the original, plain."""

    # ``name``: the module's attribute (a click command, mlx-openai-server's ``cli``, has no ``__name__``)
    @functools.wraps(original)
    def main(*args: Any, **kwargs: Any) -> Any:
        setattr(module, name, original)
        words = sys.argv[1:]
        for library, command, row_args in rows:
            if not args and not kwargs and tuple(words[: len(row_args)]) == tuple(row_args):
                from .main import main as attnpass

                return attnpass([library, *options, command, *words[len(row_args) :]])
        known = ", ".join(" ".join([program, *row_args]) for _, _, row_args in rows)
        _warn(f"{OPTIMIZE_ENV}: {' '.join([program, *words[:1]])} is none of attnpass's commands ({known}): it runs "
              "plain")  # fmt: skip
        return original(*args, **kwargs)

    return main


def _switch(raw: str) -> bool | None:
    """A switch's value: True (1/on/yes/true), False (0/off/no/false), any case; else None (as
    :func:`attnpass.ir.core.switches.parse_switch`, without importing the IR at interpreter start)."""
    value = raw.strip().lower()
    return True if value in ("1", "on", "yes", "true") else False if value in ("0", "off", "no", "false") else None


def _warn(message: str) -> None:
    with contextlib.suppress(Exception):  # no stderr (a daemon's): nothing to say it on
        print(f"attnpass: warning: {message}", file=sys.stderr, flush=True)


__all__ = ["ENV_OPTIONS", "OPTIMIZE_ENV", "SCRIPT_BYTES", "env_options", "script_target", "start"]
