"""The op registry: each op is a small declarative record with one pure shape rule.

An :class:`OpDef` declares its operands (:class:`Operand` records: :func:`operand`, :func:`opt_operand`,
:func:`var_operand`), its typed attributes and an ``infer`` rule
``infer(operand_types, **attrs) -> TensorType`` that raises :class:`ShapeError`
quoting the operands and the offending attribute. Graphs, the verifier, the
tracer and JSON loading all go through :func:`get_op`, so an op that is not
registered cannot enter a graph. Third parties may :func:`register` more ops.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .types import DType, ShapeError, TensorType, short_repr

AttrValue = Any  # int | float | bool | str | None | DType | tuple[AttrValue, ...]

_REQUIRED = object()


@dataclass(frozen=True)
class AttrSpec:
    """An attribute's validator (normalizes or raises ``ValueError``) and default; ``quiet``: the printer
    leaves it out while it has its default (an opt-in variant, so older graphs print as before)."""

    kind: str
    check: Callable[[Any], AttrValue]
    default: Any = _REQUIRED
    quiet: bool = False

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


INT_RANGE = 2**63  # attribute ints lie in [-2**63, 2**63): what a backend's int64 takes


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"expected an int, got {short_repr(v)}")
    if not -INT_RANGE <= v < INT_RANGE:
        raise ValueError(f"int {short_repr(v)} is out of range (int64)")
    return int(v)


def _ints(v: Any) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)):
        raise ValueError(f"expected a tuple of ints, got {short_repr(v)}")
    return tuple(_int(x) for x in v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected a bool, got {short_repr(v)}")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"expected a number, got {short_repr(v)}")
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"number {short_repr(v)} is out of the float range") from None
    return math.nan if math.isnan(f) else f  # one NaN object, so equal graphs compare equal


def _optional_float(v: Any) -> float | None:
    if v is None:
        return None
    f = _float(v)
    if not math.isfinite(f):
        raise ValueError(f"expected a finite number or None, got {short_repr(v)}")
    return f


def _scalars(v: Any) -> tuple[int | float | bool, ...]:
    if not isinstance(v, (tuple, list)):
        raise ValueError(f"expected a flat tuple of numbers, got {type(v).__name__}")
    for x in v:
        if not isinstance(x, (int, float, bool)):
            raise ValueError(f"expected numbers, got {short_repr(x)}")
        if isinstance(x, int) and not isinstance(x, bool):
            _int(x)  # the int64 range
    # One NaN object: containers compare NaN by identity, so round-tripped graphs stay equal.
    return tuple(math.nan if isinstance(x, float) and math.isnan(x) else x for x in v)


def _optional_str(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise ValueError(f"expected a string or None, got {v!r}")
    return v


def _choice(*options: str) -> Callable[[Any], str]:
    def check(v: Any) -> str:
        if v not in options:
            raise ValueError(f"expected one of {', '.join(map(repr, options))}, got {short_repr(v)}")
        return v

    return check


def _dtype(v: Any) -> DType:
    try:
        return DType.parse(v)
    except ShapeError as exc:
        raise ValueError(str(exc)) from None


def attr(kind: str, default: Any = _REQUIRED, *, quiet: bool = False) -> AttrSpec:
    """Build an attribute spec. Kinds: int, ints, bool, float, float?, str?, scalars, dtype, or ``choice:a|b``."""
    if kind.startswith("choice:"):
        return AttrSpec(kind, _choice(*kind[len("choice:") :].split("|")), default, quiet)
    checks = {
        "int": _int,
        "ints": _ints,
        "bool": _bool,
        "float": _float,
        "float?": _optional_float,
        "str?": _optional_str,
        "scalars": _scalars,
        "dtype": _dtype,
    }
    return AttrSpec(kind, checks[kind], default, quiet)


@dataclass(frozen=True)
class Operand:
    """One declared operand of an op (xDSL's ``operand_def``): its name, and whether a node may leave it out
    (``optional``, read as None when absent) or takes one or more values in its place (``variadic``).
    Build it with :func:`operand`, :func:`opt_operand` or :func:`var_operand`; it prints as it is written in
    messages: ``q``, ``mask?``, ``*xs``."""

    name: str
    optional: bool = False
    variadic: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"operand {self.name!r}: the name is not an identifier (say optional=True, not 'name?')")
        if self.optional and self.variadic:
            raise ValueError(f"operand {self.name}: optional or variadic, not both")

    def __str__(self) -> str:
        return f"*{self.name}" if self.variadic else f"{self.name}?" if self.optional else self.name


def operand(name: str) -> Operand:
    """A required operand: every node of the op has it."""
    return Operand(name)


def opt_operand(name: str) -> Operand:
    """An optional operand (xDSL's ``opt_operand_def``): a node has it or not, and says which by name."""
    return Operand(name, optional=True)


def var_operand(name: str) -> Operand:
    """A variadic operand (the op's last): one or more values, read by position."""
    return Operand(name, variadic=True)


@dataclass(frozen=True)
class OpDef:
    """One op: its operands (:class:`Operand` records, required ones first, then optional ones or one variadic
    one), attributes, shape rule.

    Optional operands are named, as xDSL's ``opt_operand_def``: a node records which it has
    (``Node.optionals``, in this record's order) and its inputs hold the required operands, then those.
    The shape rule gets one entry per declared operand, None for an absent optional one.
    """

    name: str
    operands: tuple[Operand, ...]
    infer: Callable[..., TensorType]
    attrs: Mapping[str, AttrSpec] = field(default_factory=dict)
    family: str = "misc"
    doc: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "operands", tuple(self.operands))
        loose = [o for o in self.operands if not isinstance(o, Operand)]
        if loose:
            raise TypeError(
                f"op {self.name}: operand {loose[0]!r} is not an Operand; declare operands with operand(name), "
                "opt_operand(name) or var_operand(name)"
            )
        kinds = ["*" if o.variadic else "?" if o.optional else "" for o in self.operands]
        names = [o.name for o in self.operands]
        if "*" in kinds[:-1] or ("*" in kinds and "?" in kinds) or kinds != sorted(kinds, key=bool):
            raise ValueError(
                f"op {self.name}: operands {self.signature}: required ones first, then optional "
                "ones (opt_operand) or one variadic (var_operand) last"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"op {self.name}: operands {', '.join(names)}: each name once")

    @property
    def variadic(self) -> bool:
        return bool(self.operands) and self.operands[-1].variadic

    @functools.cached_property
    def operand_names(self) -> tuple[str, ...]:
        """Every declared operand's name."""
        return tuple(o.name for o in self.operands)

    @functools.cached_property
    def required(self) -> tuple[str, ...]:
        """The names of the operands every node has (the variadic one aside)."""
        return tuple(o.name for o in self.operands if not o.optional and not o.variadic)

    @functools.cached_property
    def optional(self) -> tuple[str, ...]:
        """The names of the optional operands, in declared order."""
        return tuple(o.name for o in self.operands if o.optional)

    @property
    def signature(self) -> str:
        """The operands as messages write them: ``q, k, v, mask?, sinks?``."""
        return ", ".join(map(str, self.operands))

    def check_operands(self, n: int, optionals: Sequence[str] = ()) -> None:
        """Raise ShapeError unless ``n`` inputs are the required operands then the named ``optionals``."""
        optionals = tuple(optionals)
        unknown = [o for o in optionals if o not in self.optional]
        if unknown:
            valid = ", ".join(self.optional) or "none"
            raise ShapeError(
                f"{self.name}: unknown optional operand {short_repr(unknown[0])}; optional operands: {valid}"
            )
        if optionals != tuple(o for o in self.optional if o in optionals) or len(set(optionals)) != len(optionals):
            raise ShapeError(
                f"{self.name}: optional operands {', '.join(optionals)} must each appear once, in the op's order "
                f"({', '.join(self.optional)})"
            )
        want = len(self.required) + len(optionals)
        if (n >= max(want, 1)) if self.variadic else n == want:
            return
        names = ", ".join(self.required + optionals + ((str(self.operands[-1]),) if self.variadic else ()))
        count = f"at least {max(want, 1)}" if self.variadic else str(want)
        absent = [o + "?" for o in self.optional if o not in optionals]
        hint = (
            f"; optional operands ({', '.join(absent)}) are given by name, not by position"
            if absent and n > want
            else ""
        )
        raise ShapeError(f"{self.name}: expected {count} operand(s) ({names}), got {n}{hint}")

    def bind(self, values: Sequence[Any], optionals: Sequence[str] = ()) -> dict[str, Any]:
        """Operand name -> value for ``values`` (a node's inputs, or what stands for them: types, arrays,
        emitted names) given its ``optionals``; None for an absent optional operand. Not for variadic ops."""
        if self.variadic:
            raise ShapeError(f"{self.name}: a variadic op's operands ({self.signature}) are read by position")
        self.check_operands(len(values), optionals)
        named = dict(zip(self.required + tuple(optionals), values))
        return {name: named.get(name) for name in self.operand_names}

    def arrange(self, named: Mapping[str, Any]) -> tuple[tuple[Any, ...], tuple[str, ...]]:
        """The inverse of :meth:`bind`: ``(inputs, optionals)`` from operand name -> value (None or left out:
        an absent optional operand)."""
        unknown = [k for k in named if k not in self.operand_names or self.variadic]
        if unknown:
            raise ShapeError(f"{self.name}: unknown operand {short_repr(unknown[0])}; operands: {self.signature}")
        missing = [r for r in self.required if named.get(r) is None]
        if missing:
            raise ShapeError(f"{self.name}: missing required operand {missing[0]} (operands: {self.signature})")
        optionals = tuple(o for o in self.optional if named.get(o) is not None)
        return tuple(named[o] for o in self.required + optionals), optionals

    def normalize_attrs(self, attrs: Mapping[str, Any], node: str | None = None) -> dict[str, AttrValue]:
        """Validate ``attrs`` against the spec and fill defaults, in spec order; errors name ``node`` if given."""
        where = f"{self.name} {node}" if node else self.name
        unknown = sorted(set(attrs) - set(self.attrs), key=str)
        if unknown:
            valid = ", ".join(self.attrs) or "none"
            plain = lambda k: isinstance(k, str) and k.isidentifier() and len(k) <= 60
            names = ", ".join(k if plain(k) else short_repr(k) for k in unknown)
            raise ShapeError(f"{where}: unknown attribute(s) {names}; valid attributes: {valid}")
        out: dict[str, AttrValue] = {}
        for key, spec in self.attrs.items():
            if key in attrs:
                try:
                    out[key] = spec.check(attrs[key])
                except ValueError as exc:
                    raise ShapeError(f"{where}: attribute {key}: {exc}") from None
            elif spec.required:
                raise ShapeError(f"{where}: missing required attribute {key} ({spec.kind})")
            else:
                out[key] = spec.default
        return out

    def result_type(
        self,
        operand_types: Sequence[TensorType],
        attrs: Mapping[str, Any],
        *,
        optionals: Sequence[str] = (),
        normalized: bool = False,
    ) -> TensorType:
        """Check the operands (the required ones, then the named ``optionals``) and the attributes (skipped when
        already ``normalized``), then apply the shape rule."""
        self.check_operands(len(operand_types), optionals)
        types = list(operand_types) if self.variadic else list(self.bind(operand_types, optionals).values())
        return self.infer(types, **(attrs if normalized else self.normalize_attrs(attrs)))


_REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    """Add an op to the registry; a name can be registered once."""
    if opdef.name in _REGISTRY:
        raise ValueError(f"op {opdef.name!r} is already registered")
    _REGISTRY[opdef.name] = opdef
    return opdef


def get_op(name: str) -> OpDef:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ShapeError(f"unknown op {name!r}; registered ops: {', '.join(sorted(_REGISTRY))}") from None


def registered_ops() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def encode_attr(value: AttrValue) -> Any:
    """A JSON-safe form of an attribute value (tuples become lists; non-finite floats are tagged)."""
    if isinstance(value, DType):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if isinstance(value, (tuple, list)):
        return [encode_attr(v) for v in value]
    return value


def decode_attr(value: Any) -> AttrValue:
    """Inverse of :func:`encode_attr`; the op's ``normalize_attrs`` then validates the result."""
    if isinstance(value, list):
        return tuple(decode_attr(v) for v in value)
    if isinstance(value, dict):
        if set(value) == {"float"} and value["float"] in ("inf", "-inf", "nan"):
            return float(value["float"])
        raise ValueError(f"unexpected attribute object {short_repr(value)}")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"unexpected attribute value {short_repr(value)}")
