"""Static-shape tensor types, dtypes, source locations and the error hierarchy."""

from __future__ import annotations

import enum
import keyword
import re
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
        shape = tuple(self.shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ShapeError(f"shape must be a tuple of non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))
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
        where = f"{self.file}:{self.line}"
        return f"{where} in {self.function}" if self.function else where


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def check_identifier(name: object, what: str = "name") -> str:
    """Return ``name`` if it is a safe identifier (used verbatim in text and generated code)."""
    if not isinstance(name, str) or not _IDENT.match(name) or keyword.iskeyword(name):
        raise GraphFormatError(
            f"invalid {what} {name!r}: must match [A-Za-z_][A-Za-z0-9_]* and not be a Python keyword"
        )
    return name
