"""Program artifacts: saved state that can only be restored into the program that produced it.

File layout: one JSON header line, then the tensor payload (``.npz`` bytes)::

    {"format": "attnpass.artifact", "version": 1, "identity": ..., "target": ..., "graph": {...},
     "state": {"name": {"dtype": "bfloat16", "shape": [...]}, ...}}\\n
    <npz bytes>

:func:`load_artifact` reads the header line from an unbuffered file and checks
the identity (docs/semantics.md §2.7, "State identity") before a single payload byte is read,
so a mismatched artifact fails fast with :class:`IdentityMismatch` whatever
its tensor data holds. The identity is :func:`program_identity` of the
*rewritten* graph: a pass pipeline that changed nothing keeps it.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from attnpass.ir import AttnpassError, DType, Graph, GraphFormatError, TensorType
from attnpass.ir.core.serialize import check_envelope, graph_from_doc, read_json
from attnpass.ir.core.types import printable, short_repr, type_str

from .errors import LoweringError
from .program import IdentityMismatch, Program, lower, program_identity
from .registry import get_target

FORMAT = "attnpass.artifact"
VERSION = 1
MAX_HEADER_BYTES = 64 << 20
NPY_HEADER_BYTES = 1 << 16  # what an .npy member may hold beyond its array's bytes


class ArtifactError(AttnpassError):
    """An artifact file is malformed (header or tensor payload)."""


@dataclass(frozen=True)
class Artifact:
    """A loaded artifact: the program's identity, target and graph, and its state arrays."""

    identity: str
    target: str
    graph: Graph
    state: Mapping[str, np.ndarray]

    def lower(self) -> Program:
        """Re-lower the saved graph; the program's identity equals :attr:`identity`."""
        return lower(self.graph, self.target)


def save_artifact(path: str | os.PathLike, program: Program, state: Mapping[str, np.ndarray] | None = None) -> None:
    """Write ``program``'s identity, target and graph, then ``state`` (arrays of IR dtypes)."""
    state = {name: np.asarray(a) for name, a in (state or {}).items()}
    manifest = {}
    for name, a in state.items():
        try:
            manifest[name] = {"dtype": DType.from_numpy(a.dtype).value, "shape": list(a.shape)}
        except AttnpassError:
            valid = ", ".join(d.value for d in DType)
            raise ArtifactError(f"state {name!r}: dtype {a.dtype} is not an IR dtype ({valid})") from None
    header = {
        "format": FORMAT,
        "version": VERSION,
        "identity": program.identity,
        "target": program.target.name,
        "graph": json.loads(program.graph.to_json()),
        "state": manifest,
    }
    payload = io.BytesIO()
    # npz has no bfloat16: store its bits; the manifest restores the dtype.
    np.savez(payload, **{n: a.view(np.uint16) if a.dtype == DType.bfloat16.numpy else a for n, a in state.items()})
    with open(path, "wb") as f:
        f.write(json.dumps(header, allow_nan=False).encode() + b"\n")
        f.write(payload.getvalue())


def read_header(f: io.RawIOBase) -> dict[str, Any]:
    """Read and validate the header line of an unbuffered binary file (no payload byte is read)."""
    line = f.readline(MAX_HEADER_BYTES + 1)
    if not line.endswith(b"\n"):
        raise ArtifactError(f"artifact header: no header line within {MAX_HEADER_BYTES} bytes")
    header = read_json(line, "artifact header", ArtifactError)
    check_envelope(header, FORMAT, VERSION, "artifact", ArtifactError)
    for key, kind in (("identity", str), ("target", str), ("graph", dict), ("state", dict)):
        if not isinstance(header.get(key), kind):
            raise ArtifactError(f"artifact header: field {key!r} is missing or not a {kind.__name__}")
    identity = header["identity"]
    if len(identity) != 64 or any(c not in "0123456789abcdef" for c in identity):
        raise ArtifactError(f"artifact header: identity {short_repr(identity)} is not a sha256 hex digest")
    return header


def load_artifact(path: str | os.PathLike, expected_identity: str) -> Artifact:
    """Load an artifact saved for the program whose identity is ``expected_identity``.

    Raises IdentityMismatch, before reading any tensor data, when the header's
    identity differs from ``expected_identity`` or is not the identity of the
    header's own graph and target under the installed backend; ArtifactError
    when the file is malformed.
    """
    with open(path, "rb", buffering=0) as f:
        header = read_header(f)
        found, target = header["identity"], printable(header["target"][:40])
        if found != expected_identity:
            raise IdentityMismatch(
                f"artifact {os.fspath(path)!r} belongs to program {found[:16]}… ({target}), "
                f"expected {expected_identity[:16]}…; its state cannot be restored into this program"
            )
        try:
            get_target(header["target"])
        except LoweringError as exc:
            valid = str(exc).rsplit("; ", 1)[-1]  # the registry's "valid targets: ..."
            raise ArtifactError(f"artifact header: unknown target {short_repr(header['target'])}; {valid}") from None
        try:
            graph = graph_from_doc(header["graph"])
        except GraphFormatError as exc:
            raise ArtifactError(f"artifact header: {exc}") from None
        if program_identity(graph, header["target"]) != found:
            raise IdentityMismatch(
                f"artifact {os.fspath(path)!r}: its graph and target do not produce its recorded identity "
                "(edited header, or saved under another backend version)"
            )
        payload = f.read()
    return Artifact(found, header["target"], graph, _decode_state(payload, header["state"]))


def _manifest_types(manifest: Mapping[str, Any]) -> dict[str, TensorType]:
    """The header's state entries as types (each one checked: a known dtype, a shape in range)."""
    types = {}
    for name, entry in manifest.items():
        try:
            types[name] = TensorType(tuple(entry["shape"]), DType.parse(entry["dtype"]))
        except (AttnpassError, KeyError, TypeError):
            raise ArtifactError(
                f"artifact header: malformed state entry {short_repr(name)}: {short_repr(entry)}"
            ) from None
    return types


def _decode_state(payload: bytes, manifest: Mapping[str, Any]) -> dict[str, np.ndarray]:
    types = _manifest_types(manifest)
    try:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:  # sizes first: no member inflates past its type
            sizes = {info.filename.removesuffix(".npy"): info.file_size for info in archive.infolist()}
        if set(sizes) != set(types):
            raise ArtifactError(
                f"artifact payload holds {short_repr(sorted(sizes))}, its header lists {short_repr(sorted(types))}"
            )
        for name, size in sizes.items():
            if size > types[name].nbytes + NPY_HEADER_BYTES:
                raise ArtifactError(f"artifact state {short_repr(name)}: {size} bytes for type {types[name]}")
        with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ArtifactError(f"artifact tensor payload is unreadable: {exc}") from None
    state = {}
    for name, raw in arrays.items():
        dtype = types[name].dtype.numpy
        stored = np.dtype(np.uint16) if dtype == DType.bfloat16.numpy else dtype
        if raw.dtype != stored or raw.shape != types[name].shape:
            found = type_str(raw.shape, types[name].dtype if raw.dtype == stored else raw.dtype)
            raise ArtifactError(f"artifact state {short_repr(name)}: payload {found} != header {types[name]}")
        state[name] = raw.view(dtype)
    return state


__all__ = ["Artifact", "ArtifactError", "load_artifact", "read_header", "save_artifact"]
