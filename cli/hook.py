"""``attnpass hook install|remove|status``: the startup hook that lets ``ATTNPASS_OPTIMIZE`` turn attnpass on for a
server's unchanged command line (``vllm-mlx serve MODEL ...``) in one Python environment.

``install`` writes :data:`PTH_NAME` to the running interpreter's ``purelib`` (``sysconfig``; a venv's
site-packages). Python's ``site`` runs a ``.pth`` line that begins with ``import`` at every interpreter start of
that environment; :data:`PTH_LINE` reads ``ATTNPASS_OPTIMIZE`` and, only when it is set, imports
:mod:`attnpass.cli.startup` and calls its ``start`` (which acts only for a console script of an
:data:`~attnpass.cli.launch.ENTRY_POINTS` row, and only when the switch is on). Unset, the line costs one
environment lookup and imports nothing of attnpass. An attnpass that cannot be imported any more (uninstalled, the
``.pth`` left behind) is one warning line on stderr when the switch is set, and the program runs plain. ``remove``
deletes the file; ``status`` says whether it is there and current.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

from .launch import ENTRY_POINTS, OPTIMIZE_ENV

PTH_NAME = "attnpass_startup.pth"
# one line: site executes it (it begins with "import"; a venv's site-packages may be read twice, as lib and lib64);
# a failed import is one warning line, and is not tried again (the module's entry None)
PTH_LINE = (
    f'import os, sys; os.environ.get("{OPTIMIZE_ENV}", "").strip() and "attnpass.cli.startup" not in sys.modules and '
    'exec("try:\\n import attnpass.cli.startup as s\\n s.start()\\nexcept Exception as e:\\n '
    f'sys.modules[\\"attnpass.cli.startup\\"] = None\\n print(f\\"attnpass: warning: {OPTIMIZE_ENV}: the startup '
    "hook failed ({type(e).__name__}: {e}); "
    'this program runs plain\\", file=sys.stderr)")\n'
)


def hook_path(site: str | Path | None = None) -> Path:
    """Where the hook's file is: ``site`` (default: this interpreter's purelib, ``sysconfig.get_paths()``)."""
    return Path(sysconfig.get_paths()["purelib"] if site is None else site) / PTH_NAME


def install(site: str | Path | None = None) -> str:
    """Write the hook's file (:func:`hook_path`); the line that says what was done. An unwritable folder raises
    ``OSError``."""
    path = hook_path(site)
    if path.is_file() and path.read_text() == PTH_LINE:
        return f"attnpass: the startup hook is already installed: {path}"
    path.write_text(PTH_LINE)
    return (
        f"attnpass: installed the startup hook: {path}; in {sys.prefix}, {OPTIMIZE_ENV}=1 now runs these commands "
        f"as attnpass's: {_commands()}"
    )


def remove(site: str | Path | None = None) -> str:
    """Delete the hook's file (:func:`hook_path`), if there; the line that says what was done."""
    path = hook_path(site)
    if not path.exists():
        return f"attnpass: no startup hook to remove: {path} does not exist"
    path.unlink()
    return f"attnpass: removed the startup hook: {path}"


def status(site: str | Path | None = None) -> tuple[bool, str]:
    """``(installed and current, the line that says so)``: the file there with :data:`PTH_LINE`, and whether
    ``ATTNPASS_OPTIMIZE`` turns it on in this environment now."""
    path = hook_path(site)
    if not path.is_file():
        return False, f"attnpass: the startup hook is not installed ({path} does not exist): attnpass hook install"
    if path.read_text() != PTH_LINE:
        return False, f"attnpass: {path} is not this attnpass's startup hook: attnpass hook install rewrites it"
    import os

    from attnpass.ir.core.switches import parse_switch

    raw = os.environ.get(OPTIMIZE_ENV)
    now = (
        "unset"
        if raw is None
        else f"={raw.strip()}" + {True: " (on)", False: " (off)", None: " (not a switch value)"}[parse_switch(raw)]
    )
    return True, f"attnpass: the startup hook is installed: {path}; {OPTIMIZE_ENV} is {now} here; {_commands()}"


def _commands() -> str:
    return ", ".join(f"{lib} {cmd}" for lib, cmds in ENTRY_POINTS.items() for cmd in cmds)


__all__ = ["PTH_LINE", "PTH_NAME", "hook_path", "install", "remove", "status"]
