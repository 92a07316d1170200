"""``optimize`` on tensor-parallel sharded models over 2 ranks of ``mx.distributed`` (ring backend, localhost).

``mlx.launch --backend ring --hosts 127.0.0.1 -n 2`` runs tests/backends/mlx_backend/distributed_rank.py on two local
processes (free ports, bounded time): a tiny llama loaded by mlx-lm's ``sharded_load`` (``model.shard``), a
tiny qwen3 given ``model.shard(group)``, the sharded llama over a quantized KV cache (``kv_bits=8``), and
mlx-vlm's tiny Qwen4-Exp with its QSA layers' heads sharded by hand (it has no ``shard()``). On every rank the
greedy tokens under ``optimize(model, min_keys=0)`` must be the plain sharded model's, the ranks must agree, and
every attention call must be routed (none declined), over the cache the case names.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import requires

pytestmark = requires("mlx.core", "mlx_lm", "mlx_vlm")

TIMEOUT = 300  # seconds for all four cases on both ranks (about 30 s on 2 shared cores)
RANK = Path(__file__).resolve().parent / "distributed_rank.py"
LAUNCH = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"  # mlx.launch
CASES = {  # case -> the cache classes its optimized run decodes over (per layer)
    "llama-sharded-load": {"KVCache"},
    "qwen3-shard": {"KVCache"},
    "llama-kv-bits-8": {"QuantizedKVCache"},
    "qwen4-exp-qsa": {"ArraysCache", "QSAKVCache"},
}


def free_ports(count: int) -> int:
    """A port with ``count`` free ones from it (the ring backend listens on port + rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            start = s.getsockname()[1]
        if start + count < 65536 and all(_free(start + i) for i in range(count)):
            return start
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def ranks(saved_lm_dir) -> dict[str, list[dict]]:
    """case -> the JSON line of each rank."""
    command = [sys.executable, "-c", LAUNCH, "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2"]
    command += ["--starting-port", str(free_ports(2)), "--python", sys.executable, str(RANK), str(saved_lm_dir), *CASES]
    # a session of its own: on a timeout the launcher and both ranks are killed together
    launched = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = launched.communicate(timeout=TIMEOUT)
    finally:
        if launched.poll() is None:
            os.killpg(launched.pid, signal.SIGKILL)
    assert launched.returncode == 0, out[-3000:] + err[-3000:]
    found: dict[str, list[dict]] = {case: [] for case in CASES}
    for line in out.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            found[result["case"]].append(result)
    return found


@pytest.fixture(scope="module")
def saved_lm_dir(tmp_path_factory) -> Path:
    from attnpass.models import save_tiny_lm

    return save_tiny_lm(tmp_path_factory.mktemp("distributed") / "llama", dtype="float32")


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_decodes_the_plain_sharded_models_tokens_with_every_call_routed(ranks, case):
    results = sorted(ranks[case], key=lambda r: r["rank"])
    assert [(r["rank"], r["size"]) for r in results] == [(0, 2), (1, 2)], results
    for result in results:
        assert len(result["plain"]) == 12 and result["optimized"] == result["plain"], result
        assert result["routed"] > 0 and result["declined"] == {} and result["traces"] > 0, result
        assert set(result["caches"]) == CASES[case], result
    assert results[0]["plain"] == results[1]["plain"]  # the ranks compute the same model
