"""Program artifacts: identity follows the rewritten graph; a mismatch fails before tensor data is read."""

from __future__ import annotations

import io
import json
import re

import ml_dtypes
import numpy as np
import pytest

from attnpass.ir import TensorSpec, ops, trace
from attnpass.lowering import (
    ArtifactError,
    IdentityMismatch,
    Program,
    load_artifact,
    lower,
    program_identity,
    save_artifact,
)
from attnpass.lowering import artifact as artifact_module
from attnpass.passes import HeadChunkSDPA
from tests.util import requires, target_params


def compile_verify(q_len: int, chunk: bool, target: str = "mlx") -> Program:
    """A 24q/2kv verify step lowered to ``target`` (mlx by default: its tests carry requires("mlx.core"))."""

    def attention(q, k, v):
        return ops.sdpa(q, k, v, scale=1 / 16)

    kv = TensorSpec((1, 2, 32, 64), "bf16")
    graph = trace(attention, TensorSpec((1, 24, q_len, 64), "bf16"), kv, kv)
    return lower(HeadChunkSDPA(enabled=chunk)(graph).graph, target)


def state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "k_cache": rng.standard_normal((1, 2, 32, 64)).astype(ml_dtypes.bfloat16),
        "offset": np.array([32], dtype=np.int32),
        "seen": np.array([True, False]),
        "scores": rng.standard_normal((3, 5)).astype(np.float16),
    }


@pytest.mark.parametrize("target", target_params("mlx", "jax", "numpy"))
def test_policy_changes_identity_only_when_it_rewrote_something(target):
    def identity(q_len: int, chunk: bool) -> str:
        return compile_verify(q_len, chunk, target).identity

    assert identity(2, chunk=True) == identity(2, chunk=False)  # nothing rewritten
    assert identity(4, chunk=True) != identity(4, chunk=False)


@requires("mlx.core")
def test_round_trip_is_bit_exact(tmp_path):
    program = compile_verify(4, chunk=True)
    path = tmp_path / "state.attnpass"
    save_artifact(path, program, state())
    loaded = load_artifact(path, program.identity)
    assert loaded.identity == program.identity and loaded.target == "mlx" and loaded.graph == program.graph
    assert loaded.lower().identity == program.identity
    assert sorted(loaded.state) == sorted(state())
    for name, array in state().items():
        got = loaded.state[name]
        assert got.dtype == array.dtype and got.shape == array.shape
        assert got.tobytes() == array.tobytes()


@requires("mlx.core")
def test_header_is_one_json_line_then_npz(tmp_path):
    program = compile_verify(4, chunk=True)
    path = tmp_path / "a.attnpass"
    save_artifact(path, program, state())
    raw = path.read_bytes()
    line, payload = raw.split(b"\n", 1)
    header = json.loads(line)
    assert header["identity"] == program.identity and header["target"] == "mlx"
    assert header["state"]["k_cache"] == {"dtype": "bfloat16", "shape": [1, 2, 32, 64]}
    assert payload[:2] == b"PK"  # a zip (npz) archive


def edit_header(path, change) -> None:
    """Rewrite the header line in place with ``change(header)``; the payload stays as saved."""
    line, payload = path.read_bytes().split(b"\n", 1)
    header = json.loads(line)
    change(header)
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)


def corrupt_payload(path) -> None:
    line, payload = path.read_bytes().split(b"\n", 1)
    path.write_bytes(line + b"\n" + b"\x00garbage, not an npz archive" * 8)


@requires("mlx.core")
def test_mismatch_fails_before_reading_tensor_data(tmp_path, monkeypatch):
    """A policy change that rewrote the graph: the unchunked program's state must not load into the
    chunked program. With an unreadable payload the identity error still comes first, and the payload
    decoder is never reached; a matching header does go on to the payload."""
    old = compile_verify(4, chunk=False)
    new = compile_verify(4, chunk=True)
    path = tmp_path / "old.attnpass"
    save_artifact(path, old, state())
    corrupt_payload(path)
    decoded = []
    real_decode = artifact_module._decode_state
    monkeypatch.setattr(artifact_module, "_decode_state", lambda *a: decoded.append(a) or real_decode(*a))

    with pytest.raises(IdentityMismatch, match="cannot be restored"):
        load_artifact(path, new.identity)
    assert decoded == []
    with pytest.raises(ArtifactError, match="payload is unreadable"):
        load_artifact(path, old.identity)
    assert len(decoded) == 1


@requires("mlx.core")
def test_mismatch_never_reads_past_the_header_line(tmp_path, monkeypatch):
    """Record the file position when load_artifact closes its (unbuffered) file."""
    old, new = compile_verify(5, chunk=False), compile_verify(5, chunk=True)
    path = tmp_path / "old.attnpass"
    save_artifact(path, old, state())
    header_len = path.read_bytes().index(b"\n") + 1
    positions = []

    class Recording(io.FileIO):
        def close(self):
            if not self.closed:
                positions.append(self.tell())
            super().close()

    monkeypatch.setattr(artifact_module, "open", lambda file, mode, buffering: Recording(file, mode), raising=False)
    with pytest.raises(IdentityMismatch):
        load_artifact(path, new.identity)
    load_artifact(path, old.identity)
    assert positions == [header_len, path.stat().st_size]


@requires("mlx.core")
def test_unchanged_policy_identity_loads_across_policies(tmp_path):
    """q_len 2: the pass rewrote nothing, so state saved with the policy off restores with it on."""
    path = tmp_path / "short.attnpass"
    save_artifact(path, compile_verify(2, chunk=False), state())
    assert load_artifact(path, compile_verify(2, chunk=True).identity).state.keys() == state().keys()


@requires("mlx.core")
def test_edited_header_graph_is_rejected(tmp_path):
    program = compile_verify(4, chunk=True)
    path = tmp_path / "edited.attnpass"
    save_artifact(path, program, {})

    def drop_concat(header):  # a different graph that still claims the real program's identity
        header["graph"]["outputs"] = ["sdpa_c0"]
        header["graph"]["nodes"] = [n for n in header["graph"]["nodes"] if n["name"] != "sdpa_heads"]

    edit_header(path, drop_concat)
    with pytest.raises(IdentityMismatch, match="do not produce its recorded identity"):
        load_artifact(path, program.identity)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "no header line"),
        (b"not json\n", "artifact header: malformed JSON"),
        (b'{"format": "other"}\n', "not an attnpass artifact"),
        (b'{"format": "attnpass.artifact", "version": 9}\n', "unsupported artifact version"),
        (b'{"format": "attnpass.artifact", "version": 1, "identity": 3}\n', "field 'identity'"),
    ],
)
def test_malformed_headers(tmp_path, content, message):
    path = tmp_path / "bad.attnpass"
    path.write_bytes(content)
    with pytest.raises(ArtifactError, match=message):
        load_artifact(path, "0" * 64)


@requires("mlx.core")
@pytest.mark.parametrize(
    "field, value, message", [("target", "tpu", "unknown target"), ("graph", {}, "not an attnpass graph")]
)
def test_malformed_header_fields_behind_a_matching_identity(tmp_path, field, value, message):
    program = compile_verify(4, chunk=True)
    path = tmp_path / "a.attnpass"
    save_artifact(path, program, {})
    edit_header(path, lambda header: header.update({field: value}))
    with pytest.raises(ArtifactError, match=message):
        load_artifact(path, program.identity)


@requires("mlx.core")
def test_payload_must_match_the_manifest(tmp_path):
    program = compile_verify(4, chunk=True)
    path = tmp_path / "a.attnpass"
    save_artifact(path, program, {"x": np.zeros((2, 3), np.float32)})
    edit_header(path, lambda header: header["state"]["x"].update(shape=[3, 2]))
    with pytest.raises(ArtifactError, match=re.escape("payload f32[2,3] != header f32[3,2]")):
        load_artifact(path, program.identity)


@requires("mlx.core")
def test_state_dtypes_must_be_ir_dtypes(tmp_path):
    with pytest.raises(ArtifactError, match="not an IR dtype"):
        save_artifact(tmp_path / "x", compile_verify(4, chunk=True), {"x": np.zeros(3, np.int64)})


@requires("mlx.core")
def test_identity_is_program_identity_of_the_rewritten_graph():
    program = compile_verify(4, chunk=True)
    assert program.identity == program_identity(program.graph, "mlx")
