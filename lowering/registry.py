"""The target registry: names -> :class:`Target`, for ``lower``, artifacts, the backends and the CLI.

The registry imports no target: the built-in ones are registered by
:mod:`attnpass.lowering` when the package is imported (the numpy reference
first), as :mod:`attnpass.passes` registers the built-in passes. Adding a
target is one folder (emitters, runtime modules, a ``Target``; see
:mod:`attnpass.lowering.target`) and one :func:`register_target` call.
"""

from __future__ import annotations

from .errors import LoweringError
from .sharding import Spmd
from .target import Target

_REGISTRY: dict[str, Target] = {}


def register_target(target: Target) -> Target:
    """Make ``target`` available under its name; another target under a taken name is an error."""
    if not target.name.isidentifier():
        raise LoweringError(f"register_target: target name {target.name!r} is not an identifier")
    if _REGISTRY.setdefault(target.name, target) is not target:
        raise LoweringError(f"register_target: the name {target.name!r} is taken by another target")
    return target


def get_target(name: str) -> Target:
    """The target called ``name``; LoweringError naming the valid targets otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise LoweringError(f"unknown target {name!r}; valid targets: {', '.join(_REGISTRY)}") from None


def available_targets() -> tuple[Target, ...]:
    """The registered targets, in registration order."""
    return tuple(_REGISTRY.values())


def sharded_lowering(target: Target, asked_by: str) -> Spmd:
    """``target``'s sharded lowering; LoweringError naming ``asked_by`` and the targets that have one otherwise."""
    if target.spmd is None:
        having = ", ".join(t.name for t in _REGISTRY.values() if t.spmd is not None) or "none"
        raise LoweringError(f"{asked_by}: target {target.name!r} has no sharded lowering; targets with one: {having}")
    return target.spmd


def export_formats() -> dict[str, Target]:
    """Export format name (``attnpass export --target``) -> the target whose programs it exports."""
    return {t.export.format: t for t in _REGISTRY.values() if t.export is not None}


__all__ = ["available_targets", "export_formats", "get_target", "register_target", "sharded_lowering"]
