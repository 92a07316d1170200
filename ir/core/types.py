"""Static-shape tensor types, dtypes, source locations and the error hierarchy."""

from __future__ import annotations

import enum
import keyword
import re
import reprlib
from dataclasses import dataclass
from math import prod

import numpy as np


class AttnpassError(Exception):
    """Base class of every error this library raises on purpose."""


class ShapeError(AttnpassError):
    """An op was applied to operands or attributes its shape/dtype rule rejects."""


class VerifyError(AttnpassError):
    """A graph violates a structural or typing invariant."""


class GraphFormatError(AttnpassError):
    """A serialized graph (JSON or text) is malformed."""


MAX_DIM = 2**31 - 1  # the largest dimension a shape may have (what MLX and int32 indexing take)
MAX_ELEMENTS = 2**62  # the most elements a tensor may have (int64 sizes, in bytes too)
MAX_NAME = 256  # the longest identifier (graph, input, value name)
_SHORT_REPR = reprlib.Repr()
for _key, _limit in {"maxlevel": 3, "maxtuple": 8, "maxlist": 8, "maxdict": 4, "maxstring": 60, "maxlong": 40}.items():
    setattr(_SHORT_REPR, _key, _limit)


def short_repr(value: object) -> str:
    """``repr(value)``, bounded (long strings, numbers and lists elided with ``...``): quoted user input stays short."""
    try:
        return _SHORT_REPR.repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit, a self-referencing container
        return f"<{type(value).__name__}>"


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1b``), so it stays on one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def native_dtype_name(dtype: object) -> str:
    """A framework dtype's name (numpy, JAX, MLX): its ``name``, else the last part of its text
    (``mlx.core.bfloat16`` -> ``bfloat16``); a :class:`DType`'s value for the IR's dtypes."""
    return getattr(dtype, "name", None) or str(dtype).rsplit(".", 1)[-1]


class DType(enum.Enum):
    """Element types of the IR. The value is the canonical (numpy-style) name."""

    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    int32 = "int32"
    bool = "bool"

    @property
    def short(self) -> str:
        """The short name used in printed types (``bf16[1,24,5,256]``)."""
        return _SHORT[self]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in FLOAT_DTYPES

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype (bfloat16 through ``ml_dtypes``)."""
        if self is DType.bfloat16:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.value)

    @property
    def finfo(self) -> np.finfo:
        """Machine limits of a float dtype (``min``, ``max``, ``eps``, ``tiny``); bfloat16 included.

        The one dtype query for limits: ``np.finfo`` rejects bfloat16, ``ml_dtypes.finfo`` takes all three.
        """
        if not self.is_float:
            raise ShapeError(f"finfo: {self.value} is not a float dtype")
        import ml_dtypes

        return ml_dtypes.finfo(self.numpy)

    @staticmethod
    def parse(value: "DType | str") -> "DType":
        """Accept a DType, a canonical name (``"bfloat16"``) or a short name (``"bf16"``)."""
        if isinstance(value, DType):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            if key in DType.__members__:
                return DType[key]
            for dtype, short in _SHORT.items():
                if short == key:
                    return dtype
        valid = ", ".join(d.value for d in DType)
        raise ShapeError(f"unsupported dtype {value!r}; valid dtypes: {valid}")

    @staticmethod
    def from_numpy(dtype: np.dtype) -> "DType":
        name = np.dtype(dtype).name
        return DType.parse(name)

    def __repr__(self) -> str:
        return f"DType.{self.name}"


FLOAT_DTYPES = (DType.float32, DType.float16, DType.bfloat16)  # the one float-dtype set
_SHORT = {
    DType.float32: "f32",
    DType.float16: "f16",
    DType.bfloat16: "bf16",
    DType.int32: "i32",
    DType.bool: "bool",
}
_ITEMSIZE = {DType.float32: 4, DType.float16: 2, DType.bfloat16: 2, DType.int32: 4, DType.bool: 1}


@dataclass(frozen=True)
class TensorType:
    """A static shape and a dtype. Printed like a jaxpr type: ``bf16[1,24,5,256]``."""

    shape: tuple[int, ...]
    dtype: DType

    def __post_init__(self) -> None:
        shape = self.shape
        if type(shape) is tuple and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
            if prod(shape) <= MAX_ELEMENTS and type(self.dtype) is DType:  # the common case, already normal
                return
        shape = tuple(shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ShapeError(f"shape must be a tuple of non-negative ints, got {short_repr(self.shape)}")
        shape = tuple(int(d) for d in shape)
        if any(d > MAX_DIM for d in shape) or prod(shape) > MAX_ELEMENTS:
            raise ShapeError(
                f"shape {short_repr(list(shape))} is out of range: dims at most {MAX_DIM} (2**31 - 1), "
                f"at most 2**62 elements"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", DType.parse(self.dtype))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype.short}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class SourceLoc:
    """Where a node came from in user code."""

    file: str
    line: int
    function: str = ""

    def __str__(self) -> str:
        """``file:line in function``; control characters in the strings are escaped (one line, always)."""
        where = f"{printable(self.file)}:{self.line}"
        return f"{where} in {printable(self.function)}" if self.function else where


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_identifier(name: object, what: str = "name") -> str:
    """Return ``name`` if it is a safe identifier (used verbatim in text and generated code)."""
    if not isinstance(name, str) or not _IDENT.match(name) or keyword.iskeyword(name) or len(name) > MAX_NAME:
        raise GraphFormatError(
            f"invalid {what} {short_repr(name)}: must match [A-Za-z_][A-Za-z0-9_]*, have at most {MAX_NAME} "
            "characters and not be a Python keyword"
        )
    return name


def type_str(shape: "tuple[int, ...] | list[int]", dtype: "DType | str | object") -> str:
    """A type in the IR's one notation (``bf16[1,24,4,256]``), also for a foreign dtype name (``float64[2,3]``)."""
    try:
        name = DType.parse(dtype).short
    except AttnpassError:
        name = str(getattr(dtype, "name", None) or dtype)
    return f"{name}[{','.join(str(int(d)) for d in shape)}]"
