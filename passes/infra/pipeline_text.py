"""Textual pipelines: ``dce,head-chunk{budget=16},qsa-gather{pad_multiple=256,min_depth_factor=2}``.

Grammar: passes separated by ``,``; each is a registered name
(:mod:`attnpass.passes.infra.registry`) optionally followed by ``{key=value,...}``.
Keys are the pass's dataclass fields; values are converted from the field's
type: ``int``, ``float``, ``bool`` (true/false, on/off, yes/no, 1/0, any
case), ``str``, and any of them ``| None`` (``none``). Whitespace around
names, keys and values is ignored; an empty text is an error (the empty
pipeline is the empty list, ``[]``).
``parse_pipeline(format_pipeline(passes)) == passes`` for registered passes.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Iterable, Mapping, Sequence

from attnpass.ir.core.arguments import argument_error
from attnpass.ir.core.switches import parse_switch

from .base import Pass
from .registry import PipelineError, available_passes, get_pass

_SCALARS = (bool, int, float, str)
_RESERVED = frozenset("{},=")


@dataclasses.dataclass(frozen=True)
class PassOption:
    """One textual option of a pass: the dataclass field's name, type and default."""

    name: str
    annotation: Any
    default: Any

    @property
    def kinds(self) -> tuple[type, ...]:
        """The scalar types a value may take (``type(None)`` included when optional); empty if not settable."""
        args = typing.get_args(self.annotation) if _is_union(self.annotation) else (self.annotation,)
        settable = all(a in _SCALARS or a is type(None) for a in args)
        return tuple(args) if settable else ()

    def __str__(self) -> str:
        if not self.kinds:
            return f"{self.name} (not settable from text)"
        type_text = " | ".join("None" if k is type(None) else k.__name__ for k in self.kinds)
        return f"{self.name}: {type_text} = {format_value(self.default)}"


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def pass_options(cls: type[Pass]) -> list[PassOption]:
    """The options of a pass class, in field order."""
    hints = typing.get_type_hints(cls)
    options = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        options.append(PassOption(f.name, hints[f.name], default))
    return options


def convert_value(text: str, option: PassOption) -> Any:
    """``text`` as a value of ``option``'s type; raises PipelineError naming what was expected."""
    kinds = option.kinds
    if not kinds:
        raise PipelineError(f"option {option.name} has type {option.annotation!r}, which a textual pipeline cannot set")
    low = text.strip().lower()
    if type(None) in kinds and low == "none":
        return None
    for kind in (bool, int, float, str):
        if kind not in kinds:
            continue
        if kind is bool and (on := parse_switch(text)) is not None:
            return on
        if kind is int:
            try:
                return int(text, 10)
            except ValueError:
                pass
        if kind is float:
            try:
                return float(text)
            except ValueError:
                pass
        if kind is str and text and not _RESERVED & set(text):
            return text
    expected = " or ".join("none" if k is type(None) else k.__name__ for k in kinds)
    raise PipelineError(f"option {option.name}: expected {expected}, got {text!r}")


def format_value(value: Any) -> str:
    """The text form of an option value (the inverse of :func:`convert_value`)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str) and value and not _RESERVED & set(value):
        return value
    raise PipelineError(f"the value {value!r} has no text form in a pipeline")


def _make(name: str, options_text: str | None) -> Pass:
    cls = get_pass(name)
    options = {o.name: o for o in pass_options(cls)}
    values: dict[str, Any] = {}
    items = options_text.split(",") if options_text and options_text.strip() else []
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise PipelineError(f"pass {name}: malformed option {item.strip()!r}; expected key=value")
        if key not in options:
            listed = "; ".join(str(o) for o in options.values()) or "none"
            raise PipelineError(f"pass {name} has no option {key!r}; its options: {listed}")
        if key in values:
            raise PipelineError(f"pass {name}: option {key} given twice")
        try:
            values[key] = convert_value(raw.strip(), options[key])
        except PipelineError as exc:
            raise PipelineError(f"pass {name}: {exc}") from None
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise PipelineError(f"pass {name}: {exc}") from None


def parse_pipeline(pipeline: str | Iterable[str | Pass]) -> list[Pass]:
    """The passes of a pipeline, constructed with their options: its text (``"head-chunk{budget=16},dce"``) or
    a sequence of pass texts and Pass objects (``["head-chunk", DeadCodeElimination()]``), in order.

    Raises PipelineError for a bad text (an empty one too: the empty pipeline is ``[]``), ArgumentError for
    anything else."""
    return pipeline_passes(pipeline, "parse_pipeline")


def pipeline_passes(pipeline: str | Iterable[str | Pass], where: str) -> list[Pass]:
    """:func:`parse_pipeline` for the entry point ``where`` (``PassManager``), which its errors name."""
    if isinstance(pipeline, str):
        return _parse_text(pipeline, "the pipeline")
    valid = "pipeline text ('head-chunk,dce') or a sequence of pass names and Pass objects"
    if isinstance(pipeline, (bytes, Mapping)) or not isinstance(pipeline, Iterable):
        hint = "a single pass goes in a list: [pass]" if isinstance(pipeline, Pass) else ""
        raise argument_error(where, "the pipeline", pipeline, valid, hint)
    passes: list[Pass] = []
    for i, item in enumerate(pipeline):
        if isinstance(item, Pass):
            passes.append(item)
        elif isinstance(item, str):
            passes += _parse_text(item, f"pipeline item {i}")
        else:
            raise argument_error(where, f"pipeline item {i}", item, "a pass name (or text) or a Pass")
    return passes


def _parse_text(text: str, what: str) -> list[Pass]:
    """The passes of one pipeline text; ``what`` (``the pipeline``) names it when it is empty."""
    if not text.strip():
        raise PipelineError(
            f"{what} is the empty text {text!r}; give pass names separated by ',' ('raise-attention,dce'; "
            f"available passes: {', '.join(available_passes())}), or the empty list [] for no passes"
        )
    passes: list[Pass] = []
    i, n = 0, len(text)
    while i < n:
        j = i
        while j < n and text[j] not in "{,":
            j += 1
        name = text[i:j].strip()
        if not name:
            raise PipelineError(f"pipeline {text!r}: empty pass name at offset {i}")
        options_text = None
        if j < n and text[j] == "{":
            close = text.find("}", j)
            if close < 0:
                raise PipelineError(f"pipeline {text!r}: '{{' at offset {j} is never closed")
            options_text, j = text[j + 1 : close], close + 1
            while j < n and text[j].isspace():
                j += 1
            if j < n and text[j] != ",":
                raise PipelineError(f"pipeline {text!r}: expected ',' after the options of {name} at offset {j}")
        passes.append(_make(name, options_text))
        i = j + 1
        if j < n and i >= n:
            raise PipelineError(f"pipeline {text!r}: trailing ','")
    return passes


def format_pipeline(passes: Sequence[Pass], *, include_defaults: bool = False) -> str:
    """The text form of ``passes``: options that differ from their defaults (all settable ones if asked)."""
    items = []
    for p in passes:
        parts = []
        for option in pass_options(type(p)):
            value = getattr(p, option.name)
            is_default = value == option.default and isinstance(value, bool) == isinstance(option.default, bool)
            if is_default and not (include_defaults and option.kinds):
                continue
            parts.append(f"{option.name}={format_value(value)}")
        items.append(p.name + (f"{{{','.join(parts)}}}" if parts else ""))
    return ",".join(items)


__all__ = ["PassOption", "convert_value", "format_pipeline", "format_value", "parse_pipeline", "pass_options"]
