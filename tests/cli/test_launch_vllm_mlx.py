"""``attnpass vllm-mlx serve``, ``ATTNPASS_OPTIMIZE=1 attnpass exec vllm-mlx serve`` and, with ``attnpass hook
install``, ``ATTNPASS_OPTIMIZE=1 vllm-mlx serve`` (cli/launch.py, cli/startup.py) beside plain vllm-mlx, with the
official ``openai`` client.

vllm-mlx pins mlx-lm 0.31 and pulls torch: its tests run in their own venv (``make test-servers``,
``.venv-servers``); elsewhere they skip. The tiny float32 llama of :func:`attnpass.models.tiny_lm.save_tiny_lm`
(float32: vllm-mlx's batched bf16 answers differ from run to run) is served on 127.0.0.1 (free ports, an API key) by
plain vllm-mlx and through attnpass at once, in each engine mode: the default SimpleEngine (its lock admission
set to ``wait``: else a concurrent request is answered 503) through ``attnpass vllm-mlx --min-keys 0 serve``, and
``--continuous-batching`` (mlx-lm's ``BatchGenerator``, vllm-mlx's prefix cache) through ``attnpass exec``; in both
modes also through the startup hook, installed into this venv for the test (and removed after it, unless it was
there before), with the unchanged ``vllm-mlx serve`` command line. In the batched mode plain is that same command
line without the switch, which imports no attnpass module (its ``-X importtime`` log names none).
Each gets 16 concurrent chat completions, then the same 16 streamed (the prefix cache meets them), then the first
burst again: every answer is plain vllm-mlx's, ``GET /attnpass/summary`` counts routed calls (refused without the
key), SIGTERM prints the summary and ends with status 143, and no log has a traceback. ``--mllm`` on the tiny
Qwen4-Exp of :func:`attnpass.models.tiny_vlm.save_tiny_vlm` is compared one request at a time: its concurrent answers
depend on how vllm-mlx batched them, plain's too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.servers import LoggedServer, assert_ended_cleanly, startup_hook
from tests.util import requires

API_KEY = "attnpass-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BURST = 16
MAX_TOKENS = 8
# a shared prefix, then a tail of each request's own (the tiny tokenizer's words t0 .. t511; no EOS)
PROMPTS = [" ".join([f"t{i}" for i in range(40, 72)] + [f"t{100 + 7 * n + j}" for j in range(4)]) for n in range(BURST)]
MODES = {"simple": [], "batched": ["--continuous-batching"]}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from attnpass.models.tiny_lm import save_tiny_lm

    return save_tiny_lm(tmp_path_factory.mktemp("vllm_mlx") / "llama", "llama", dtype="float32")


class Server(LoggedServer):
    """vllm-mlx's server on 127.0.0.1, started by ``launcher`` (a command line before ``serve``), its log in a file."""

    def __init__(self, launcher: list[str], model: Path, flags: list[str], log: Path, env: dict[str, str]) -> None:
        self.launcher, self.model, self.flags = launcher, model, flags
        environment = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPASS_")}
        environment |= {"VLLM_MLX_SIMPLE_ENGINE_LOCK_ADMISSION": "wait", "HF_HUB_OFFLINE": "1"} | env
        environment["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environment.get('PATH', '')}"
        super().__init__(log, environment)

    def command(self) -> list[str]:
        served = [str(self.model), "--host", "127.0.0.1", "--port", str(self.port), "--api-key", API_KEY]
        return [*self.launcher, "serve", *served, *self.flags]

    def wait_ready(self, timeout: float = 240.0) -> None:
        self.wait_until(lambda: self.get("/health", AUTH)[0], timeout, 0.5)


@requires("mlx.core", "vllm_mlx", "openai")
@pytest.mark.parametrize("mode", MODES)
def test_vllm_mlx_answers_as_plain_with_its_calls_routed_and_ends_on_sigterm(model, mode, tmp_path):
    import json

    attnpass = [sys.executable, "-m", "attnpass.cli"]
    script = [str(Path(sys.executable).parent / "vllm-mlx")]
    # the switch on an unchanged vllm-mlx command line, by the startup hook, in both modes
    hooked = (script, {"ATTNPASS_OPTIMIZE": "1", "ATTNPASS_MIN_KEYS": "0"})
    if mode == "simple":  # the row's command beside vllm-mlx's module
        launchers = {
            "plain": ([sys.executable, "-m", "vllm_mlx.cli"], {}),
            "optimize": ([*attnpass, "vllm-mlx", "--min-keys", "0"], {}),
            "hook": hooked,
        }
    else:  # the switch by attnpass exec too; plain is the hook's command line with the switch unset
        launchers = {
            "plain": (script, {"PYTHONPROFILEIMPORTTIME": "1"}),
            "optimize": ([*attnpass, "exec", "--min-keys", "0", "vllm-mlx"], {"ATTNPASS_OPTIMIZE": "1"}),
            "hook": hooked,
        }
    with startup_hook():
        servers = {
            name: Server(launcher, model, MODES[mode], tmp_path / f"{name}.log", env)
            for name, (launcher, env) in launchers.items()
        }
        try:
            for server in servers.values():  # all start at once
                server.wait_ready()
            answers = {
                name: [
                    server.burst(str(model), PROMPTS, stream=stream, max_tokens=MAX_TOKENS, api_key=API_KEY)
                    for stream in (False, True, False)
                ]
                for name, server in servers.items()
            }
            refused, _ = servers["optimize"].get("/attnpass/summary")
            summaries = {name: servers[name].get("/attnpass/summary", AUTH) for name in servers}
        finally:
            ended = {name: server.stop() for name, server in servers.items()}
    plain = answers["plain"]
    for name in servers:
        assert answers[name] == plain, (name, plain, answers[name])
    assert all(reason == "length" and text for burst in plain for text, reason in burst), plain
    assert plain[2] == plain[0] and [text for text, _ in plain[1]] == [text for text, _ in plain[0]], plain
    assert refused == 401 and summaries.pop("plain")[0] == 404, (refused, summaries)
    for name, (status, body) in summaries.items():
        summary = json.loads(body)
        assert status == 200 and summary["command"] == "vllm-mlx serve", (name, summary)
        [loaded] = summary["models"]
        assert loaded["model"] == str(model) and loaded["routed"] > 0 and loaded["traces"] > 0, (name, loaded)
        assert_ended_cleanly({"plain": ended["plain"], "optimize": ended[name]}, loaded)
    if mode == "batched":
        imports = [line for line in ended["plain"][1].splitlines() if line.startswith("import time:")]
        ours = [line for line in imports if re.search(r"\|\s*attnpass", line)]
        assert len(imports) > 100 and not ours, (len(imports), ours)


@requires("mlx.core", "vllm_mlx", "openai", "mlx_vlm")
def test_vllm_mlx_mllm_qwen4_exp_answers_one_request_at_a_time_as_plain_with_its_qsa_calls_routed(tmp_path):
    """``--mllm`` (mlx-vlm's loader, vllm-mlx's MLLM batch generator) on the tiny Qwen4-Exp: its concurrent answers
    depend on how vllm-mlx batched the requests, plain too (docs/cli.md), so the requests go one at a time, streamed
    and not: every answer plain's, QSA calls routed, clean ends."""
    import json

    from attnpass.models.tiny_vlm import save_tiny_vlm

    model = save_tiny_vlm(tmp_path / "qwen4_exp", "qwen4_exp")
    flags = ["--continuous-batching", "--mllm"]
    launchers = {"plain": [sys.executable, "-m", "vllm_mlx.cli"],
                 "optimize": [sys.executable, "-m", "attnpass.cli", "vllm-mlx", "--min-keys", "0"]}  # fmt: skip
    servers = {
        name: Server(launcher, model, flags, tmp_path / f"{name}.log", {}) for name, launcher in launchers.items()
    }
    prompts = ["".join(chr(97 + (7 * n + 3 * i) % 26) for i in range(48 + 8 * n)) for n in range(3)]  # 48-64 bytes
    try:
        for server in servers.values():
            server.wait_ready()
        answers = {
            name: [
                server.burst(str(model), [text], stream=stream, max_tokens=MAX_TOKENS, api_key=API_KEY)[0]
                for text in prompts
                for stream in (False, True)
            ]
            for name, server in servers.items()
        }
        status, body = servers["optimize"].get("/attnpass/summary", AUTH)
    finally:
        ended = {name: server.stop() for name, server in servers.items()}
    assert answers["optimize"] == answers["plain"], answers
    assert all(reason == "length" for _, reason in answers["plain"]), answers["plain"]
    [loaded] = json.loads(body)["models"]
    assert status == 200 and loaded["model"] == str(model) and loaded["routed"] > 0, (status, loaded)
    assert "qsa_attention" in loaded["report"], loaded["report"]  # the QSA layers' calls, not only the others'
    assert_ended_cleanly(ended, loaded)


@requires("vllm_mlx")
def test_the_switch_off_runs_vllm_mlx_itself_and_on_refuses_a_command_it_has_no_row_for(tmp_path):
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    attnpass = [sys.executable, "-m", "attnpass.cli", "exec"]

    def run(*argv: str, **switch: str) -> subprocess.CompletedProcess:
        return subprocess.run([*argv], capture_output=True, text=True, timeout=120, env=env | switch, check=False)

    plain = run(str(Path(sys.executable).parent / "vllm-mlx"), "serve", "--help")
    off = run(*attnpass, "vllm-mlx", "serve", "--help", ATTNPASS_OPTIMIZE="0")
    assert plain.returncode == off.returncode == 0 and off.stdout == plain.stdout, (plain, off)
    assert off.stderr == "attnpass: ATTNPASS_OPTIMIZE=0: vllm-mlx runs plain\n", off.stderr
    bench = run(*attnpass, "vllm-mlx", "bench", "M", ATTNPASS_OPTIMIZE="1")
    assert (bench.returncode, bench.stdout) == (1, "") and bench.stderr.startswith(
        "attnpass: error: exec: vllm-mlx bench (vllm_mlx.cli:main) is none of attnpass's commands: mlx-lm generate"
    ), bench.stderr
