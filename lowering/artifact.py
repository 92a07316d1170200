"""Program artifacts: saved state that can only be restored into the program that produced it.

File layout: one JSON header line, then the tensor payload (``.npz`` bytes)::

    {"format": "attnpass.artifact", "version": 1, "identity": ..., "target": ..., "graph": {...},
     "state": {"name": {"dtype": "bfloat16", "shape": [...]}, ...}}\\n
    <npz bytes>

:func:`load_artifact` reads the header line from an unbuffered file and checks
the identity (SPEC §2 "state identity") before a single payload byte is read,
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

from attnpass.ir import AttnpassError, DType, Graph, GraphFormatError

from .codegen import LoweringError
from .program import IdentityMismatch, Program, lower, program_identity
from .registry import get_target

FORMAT = "attnpass.artifact"
VERSION = 1
MAX_HEADER_BYTES = 64 << 20


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
    try:
        header = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"artifact header is not JSON: {exc}") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ArtifactError(f'not an attnpass artifact: expected a header with "format": "{FORMAT}"')
    if header.get("version") != VERSION:
        raise ArtifactError(f"unsupported artifact version {header.get('version')!r}; this library reads {VERSION}")
    for key, kind in (("identity", str), ("target", str), ("graph", dict), ("state", dict)):
        if not isinstance(header.get(key), kind):
            raise ArtifactError(f"artifact header: field {key!r} is missing or not a {kind.__name__}")
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
        found = header["identity"]
        if found != expected_identity:
            raise IdentityMismatch(
                f"artifact {os.fspath(path)!r} belongs to program {found[:16]}… ({header['target']}), "
                f"expected {expected_identity[:16]}…; its state cannot be restored into this program"
            )
        try:
            get_target(header["target"])
        except LoweringError as exc:
            raise ArtifactError(f"artifact header: {exc}") from None
        try:
            graph = Graph.from_json(json.dumps(header["graph"]))
        except GraphFormatError as exc:
            raise ArtifactError(f"artifact header: {exc}") from None
        if program_identity(graph, header["target"]) != found:
            raise IdentityMismatch(
                f"artifact {os.fspath(path)!r}: its graph and target do not produce its recorded identity "
                "(edited header, or saved under another backend version)"
            )
        payload = f.read()
    return Artifact(found, header["target"], graph, _decode_state(payload, header["state"]))


def _decode_state(payload: bytes, manifest: Mapping[str, Any]) -> dict[str, np.ndarray]:
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ArtifactError(f"artifact tensor payload is unreadable: {exc}") from None
    if set(arrays) != set(manifest):
        raise ArtifactError(f"artifact payload holds {sorted(arrays)}, its header lists {sorted(manifest)}")
    state = {}
    for name, raw in arrays.items():
        entry = manifest[name]
        try:
            dtype = DType.parse(entry["dtype"]).numpy
            shape = list(entry["shape"])
        except (AttnpassError, KeyError, TypeError):
            raise ArtifactError(f"artifact header: malformed state entry {name!r}: {entry!r}") from None
        stored = np.dtype(np.uint16) if dtype == DType.bfloat16.numpy else dtype
        if raw.dtype != stored or list(raw.shape) != shape:
            raise ArtifactError(f"artifact state {name!r}: payload {raw.dtype}{list(raw.shape)} != header {entry}")
        state[name] = raw.view(dtype)
    return state


__all__ = ["Artifact", "ArtifactError", "load_artifact", "read_header", "save_artifact"]
