"""``attnpass mlx-openai-server launch`` (cli/launch.py's row) beside plain mlx-openai-server, with the official
``openai`` client.

mlx-openai-server 1.8.1 pins mlx-lm 0.31 and mlx-vlm 0.4 and pulls torch: its tests run in their own venv (``make
test-mlx-openai-server``, ``.venv-mlx-openai-server``, mlx 0.31.2); elsewhere they skip. It loads each model in a
spawned handler process, where the row's loader is wrapped; that process's counts reach the command's
``GET /attnpass/summary`` and its summary line. The tiny float32 llama of
:func:`attnpass.models.tiny_lm.save_tiny_lm` is served on 127.0.0.1 (free ports) by plain mlx-openai-server and
through ``attnpass mlx-openai-server --min-keys 0 launch`` and through the startup hook (``attnpass hook install``
into this venv for the test, removed after it unless it was there before; the unchanged ``mlx-openai-server launch``
with ``ATTNPASS_OPTIMIZE=1``; plain is that command line with the switch unset) at once. Each gets 16 concurrent
chat completions, then the same 16 streamed, then the first burst again: every answer is plain mlx-openai-server's,
the summaries count routed calls (plain has no summary route), SIGTERM prints the summary and ends with status 143,
and no log has a traceback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.cli.servers import LoggedServer, assert_ended_cleanly, startup_hook
from tests.util import requires

BURST = 16
MAX_TOKENS = 8
# a shared prefix, then a tail of each request's own (the tiny tokenizer's words t0 .. t511; no EOS)
PROMPTS = [" ".join([f"t{i}" for i in range(40, 72)] + [f"t{100 + 7 * n + j}" for j in range(4)]) for n in range(BURST)]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from attnpass.models.tiny_lm import save_tiny_lm

    return save_tiny_lm(tmp_path_factory.mktemp("mlx_openai_server") / "llama", "llama", dtype="float32")


class Server(LoggedServer):
    """mlx-openai-server on 127.0.0.1 serving ``model``, started by ``launcher`` (a command line before ``launch``)."""

    def __init__(self, launcher: list[str], model: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.launcher, self.model = launcher, model
        environment = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPASS_")}
        environment |= {"HF_HUB_OFFLINE": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"} | (env or {})
        super().__init__(log, environment)

    def command(self) -> list[str]:
        served = [
            "--model-path",
            str(self.model),
            "--model-type",
            "lm",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        return [*self.launcher, "launch", *served, "--no-log-file"]

    def wait_ready(self, timeout: float = 300.0) -> None:
        self.wait_until(lambda: self.get("/health")[0], timeout, 0.5)


@requires("mlx.core", "app.server", "openai")
def test_mlx_openai_server_answers_as_plain_with_its_calls_routed_and_ends_on_sigterm(model, tmp_path):
    launchers = {
        "plain": ([str(BIN / "mlx-openai-server")], {}),  # the startup hook installed, the switch unset
        "optimize": ([sys.executable, "-m", "attnpass.cli", "mlx-openai-server", "--min-keys", "0"], {}),
        # the unchanged command line through the startup hook
        "hook": ([str(BIN / "mlx-openai-server")], {"ATTNPASS_OPTIMIZE": "1", "ATTNPASS_MIN_KEYS": "0"}),
    }
    with startup_hook():
        servers = {name: Server(launcher, model, tmp_path / f"{name}.log", env)
                   for name, (launcher, env) in launchers.items()}  # fmt: skip
        try:
            for server in servers.values():  # all start at once
                server.wait_ready()
            served = {
                name: json.loads(server.get("/v1/models")[1])["data"][0]["id"] for name, server in servers.items()
            }
            answers = {
                name: [
                    server.burst(served[name], PROMPTS, stream=stream, max_tokens=MAX_TOKENS)
                    for stream in (False, True, False)
                ]
                for name, server in servers.items()
            }
            summaries = {name: _summary(servers[name]) for name in ("optimize", "hook")}
            absent = servers["plain"].get("/attnpass/summary")[0]
        finally:
            ended = {name: server.stop() for name, server in servers.items()}
    plain = answers["plain"]
    for name in ("optimize", "hook"):
        assert answers[name] == plain, (name, plain, answers[name])
    # MAX_TOKENS words each (one a token; no EOS), finished "stop": mlx-openai-server 1.8.1's reason at max_tokens
    assert all(reason == "stop" and len(text.split()) == MAX_TOKENS for burst in plain for text, reason in burst), plain
    assert plain[2] == plain[0] and [text for text, _ in plain[1]] == [text for text, _ in plain[0]], plain
    assert absent == 404, absent
    for name, (status, summary) in summaries.items():
        assert status == 200 and summary["command"] == "mlx-openai-server launch", (name, summary)
        [loaded] = summary["models"]
        assert loaded["model"] == str(model) and loaded["routed"] > 0 and loaded["traces"] > 0, (name, loaded)
        assert_ended_cleanly({"plain": ended["plain"], "optimize": ended[name]}, loaded)


def _summary(server: Server) -> tuple[int, dict]:
    """``GET /attnpass/summary`` once the handler process has written its counts (within a quarter second)."""
    deadline = time.monotonic() + 5
    while True:
        status, body = server.get("/attnpass/summary")
        summary = json.loads(body) if status == 200 else {}
        if status != 200 or summary["models"] and summary["models"][0]["routed"] or time.monotonic() > deadline:
            return status, summary
        time.sleep(0.25)


def attnpass(*argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnpass.cli", *argv], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"} | env,
                          check=False)  # fmt: skip


@requires("app.server")
@pytest.mark.parametrize("switch", ["row", "exec"])
def test_a_used_port_ends_it_with_one_line_before_mlx_openai_server_is_imported(model, switch):
    """The row's command and the switch on mlx-openai-server's own command line (``attnpass exec``) alike."""
    launcher = ["mlx-openai-server"] if switch == "row" else ["exec", "mlx-openai-server"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = attnpass(*launcher, "launch", "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
                        ATTNPASS_OPTIMIZE="1")  # fmt: skip
    assert (done.returncode, done.stdout) == (1, ""), done
    assert (
        done.stderr.startswith(
            f"attnpass: error: mlx-openai-server launch: cannot listen on 127.0.0.1:{port}: address already in use"
        )
        and len(done.stderr.splitlines()) == 1
    ), done.stderr


@pytest.mark.skipif(find_spec("app") is not None, reason="mlx-openai-server (its package app) is installed here")
def test_without_mlx_openai_server_one_line_names_the_pip_command():
    done = attnpass("mlx-openai-server", "launch", "--help")
    assert (done.returncode, done.stdout) == (1, ""), done
    assert done.stderr == (
        f"attnpass: error: mlx-openai-server launch: mlx-openai-server is not installed here: {sys.executable} -m pip "
        "install mlx-openai-server\n"
    ), done.stderr
