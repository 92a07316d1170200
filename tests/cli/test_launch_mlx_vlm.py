"""``attnpass mlx-vlm generate|server`` (cli/launch.py) with tiny mlx-vlm models of ordinary families.

Tiny random float32 models saved by :func:`attnpass.models.tiny_vlm.save_tiny_vlm`: a Qwen2-VL (plain
``KVCache``\\ s, mRoPE) and a Gemma 3 (a sliding-window layer with a ``RotatingKVCache`` of 16 tokens, which the
60-byte prompt rotates, and a global one), each loading back as built. mlx-vlm's ``generate`` through the
launcher with ``--min-keys 0`` prints mlx-vlm's own text (greedy) with calls routed. mlx-vlm's server (a FastAPI
app run by uvicorn) on 127.0.0.1, plain and through the launcher at once (free ports, an API key): the same chat
completion from each model (the second request switches the server to the other one), ``GET /attnpass/summary``
counting the routed calls of both (refused without the key), SIGTERM printing the summary and ending with status
143, no traceback; a used port and a folder without config.json end it with one line before mlx-vlm is imported.
The :class:`~attnpass.cli.launch.AppHooks` row itself is checked on a plain FastAPI app, without mlx-vlm.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from attnpass.cli import launch
from tests.cli.servers import LoggedServer, free_port
from tests.cli.test_launch import plain, summaries, untimed
from tests.util import requires

FAMILIES = ("qwen2_vl", "gemma3")
PROMPT = "a prompt long enough to rotate gemma 3's window of 16 tokens"  # 60 bytes, one token each
API_KEY = "attnpass-test-key"
NAMES = ("plain", "optimize")
ROUTED_DECLINES = re.compile(r"none|\d+ x fused_kernel_serves")  # a prefill kept as MLX's fused call


@pytest.fixture(scope="module")
def saved_vlms(tmp_path_factory) -> dict[str, Path]:
    from attnpass.models.tiny_vlm import save_tiny_vlm

    root = tmp_path_factory.mktemp("saved_vlm")
    return {family: save_tiny_vlm(root / family, family) for family in FAMILIES}


@requires("mlx.core", "mlx_vlm")
@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_tiny_model_loads_back_as_built_with_its_caches(saved_vlms, family):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm import load
    from mlx_vlm.models.cache import make_prompt_cache

    from attnpass.models.tiny_vlm import tiny_vlm

    loaded, processor = load(str(saved_vlms[family]))
    built, found = dict(tree_flatten(tiny_vlm(family).parameters())), dict(tree_flatten(loaded.parameters()))
    assert built.keys() == found.keys() and all(mx.array_equal(built[k], found[k]).item() for k in built)
    assert len(processor.tokenizer.encode(PROMPT, add_special_tokens=False)) == len(PROMPT) == 60
    caches = [type(c).__name__ for c in make_prompt_cache(loaded.language_model)]
    assert caches == {"qwen2_vl": ["KVCache"] * 2, "gemma3": ["RotatingKVCache", "KVCache"]}[family]


@requires("mlx.core", "mlx_vlm")
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_prints_mlx_vlms_text_with_the_calls_routed(saved_vlms, family, cli, monkeypatch, capsys):
    flags = ["--model", str(saved_vlms[family]), "--prompt", PROMPT, "--max-tokens", "8", "--temperature", "0"]
    expected = plain(monkeypatch, capsys, "mlx_vlm.generate.dispatch:main", [*flags, "--verbose"])
    status, out, err = cli("mlx-vlm", "--min-keys", "0", "generate", *flags, "--verbose")
    assert status == 0, err
    assert untimed(out) == untimed(expected) and "Generation: 8 tokens" in out, (out, expected)
    [(_, source, routed, traces, declined)] = summaries(err)
    assert source == str(saved_vlms[family]) and traces > 0, err
    assert routed >= 2 * 8 and ROUTED_DECLINES.fullmatch(declined), err  # 2 layers: each decode step
    from mlx_vlm.generate import dispatch
    from mlx_vlm.utils import load

    assert dispatch.load is load


# ----------------------------------------------------------------------------- the server


class Server(LoggedServer):
    """mlx-vlm's server on 127.0.0.1 (``optimized``: through ``attnpass mlx-vlm --min-keys 0``), its log in a file."""

    def __init__(self, model: Path, log: Path, *, optimized: bool) -> None:
        self.model, self.optimized = model, optimized
        super().__init__(log)

    def command(self) -> list[str]:
        launcher = ["-m", "attnpass.cli", "mlx-vlm", "--min-keys", "0"] if self.optimized else ["-m", "mlx_vlm"]
        flags = ["--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port), "--api-key", API_KEY]
        return [sys.executable, *launcher, "server", *flags]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until ``/health`` answers: uvicorn listens once the app's startup has loaded ``--model``."""
        self.wait_until(lambda: self.request("GET", "/health")[0], timeout, 0.2)

    def request(self, method: str, path: str, body: dict | None = None, *, key: bool = True) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {API_KEY}"} if key else {})
        connection.request(method, path, json.dumps(body) if body is not None else None, headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read())


def chat(server: Server, model: Path) -> dict:
    """A greedy chat completion of ``model`` (the server loads it when it serves another): its choices and usage."""
    body = {"model": str(model), "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0}
    status, answer = server.request("POST", "/v1/chat/completions", body)
    assert status == 200, answer
    return {"choices": answer["choices"], "usage": answer["usage"]}


@requires("mlx.core", "mlx_vlm")
def test_the_server_answers_as_mlx_vlms_reports_its_routed_calls_and_ends_on_sigterm(saved_vlms, tmp_path):
    first, second = (saved_vlms[family] for family in FAMILIES)
    servers = {name: Server(first, tmp_path / f"{name}.log", optimized=name == "optimize") for name in NAMES}
    try:
        for server in servers.values():  # both start at once
            server.wait_ready()
        answers = {name: [chat(server, first), chat(server, second)] for name, server in servers.items()}
        refused, _ = servers["optimize"].request("GET", "/attnpass/summary", key=False)
        status, summary = servers["optimize"].request("GET", "/attnpass/summary")
    finally:
        ended = {name: server.stop() for name, server in servers.items()}
    assert answers["optimize"] == answers["plain"], answers
    assert all(a["usage"]["completion_tokens"] == 8 for a in answers["plain"]), answers
    assert refused == 401 and status == 200 and summary["command"] == "mlx-vlm server", summary
    assert [m["model"] for m in summary["models"]] == [str(first), str(second)], summary
    for model in summary["models"]:
        assert model["routed"] >= 2 * 8 and model["traces"] > 0 and set(model["declined"]) <= {"fused_kernel_serves"}
    (plain_status, plain_log), (status, log) = ended["plain"], ended["optimize"]
    # plain: uvicorn shuts down, then raises SIGTERM again with its default action (killed by it); attnpass: the
    # summary, then the shell's status of a command that SIGTERM stopped
    assert (plain_status, status) == (-signal.SIGTERM, 128 + signal.SIGTERM), (plain_log[-2000:], log[-2000:])
    assert "Traceback" not in log and "attnpass: error" not in log and "attnpass: warning" not in log, log
    lines = log.splitlines()
    assert lines[-1] == "attnpass: terminated by SIGTERM", log[-2000:]
    printed = [line for line in lines if line.startswith("attnpass: optimize(")]
    routed = [int(re.search(r"routed (\d+) attention call", line)[1]) for line in printed]
    assert routed == [m["routed"] for m in summary["models"]], (printed, summary)


def serve(*argv: str) -> tuple[int, str, str, float, float]:
    """``attnpass mlx-vlm server ARGS`` to its end (bounded): status, stdout, stderr, seconds and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    command = [sys.executable, "-m", "attnpass.cli", "mlx-vlm", "server", *argv]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return done.returncode, done.stdout, done.stderr, seconds, cpu


@requires("mlx_vlm")
def test_a_used_port_and_a_folder_without_config_end_the_server_with_one_line_before_mlx_vlm_loads(tmp_path):
    folder = tmp_path / "no-config"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        used = serve("--model", str(folder), "--host", "127.0.0.1", "--port", str(port))
    missing = serve("--model", str(folder), "--host", "127.0.0.1", "--port", str(free_port()))
    taken_line = (
        f"attnpass: error: mlx-vlm server: cannot listen on 127.0.0.1:{port}: address already in use (another "
        f"process listens on port {port}: give --port a free one)\n"
    )
    missing_line = (
        f"attnpass: error: mlx-vlm server: cannot load '{folder}': the folder has no config.json; a model folder "
        "holds config.json, its *.safetensors weights and its tokenizer files (as mlx_vlm.convert writes them)\n"
    )
    assert used[:3] == (1, "", taken_line) and missing[:3] == (1, "", missing_line), (used, missing)
    # attnpass's own start, not mlx-vlm's (seconds: transformers, torch); on a loaded machine the wall time is not it
    assert used[4] < 1.0 and missing[4] < 1.0 and used[3] < 5.0 and missing[3] < 5.0, (used, missing)


def test_reload_is_refused_with_one_line(cli):
    status, out, err = cli("mlx-vlm", "server", "--model", "M", "--reload")
    assert (status, out) == (1, "") and err == (
        "attnpass: error: mlx-vlm server: attnpass cannot run it with --reload: uvicorn then serves the app from a "
        "new process, which attnpass does not reach; leave --reload out\n"
    )


# ----------------------------------------------------------------------------- an ASGI app's row, without mlx-vlm

APP = SimpleNamespace()  # the fake row's FastAPI app, what it is asked and what it answered (set by the test)


try:  # the guard is a FastAPI dependency, given the request as it declares it
    from starlette.requests import Request
except ImportError:  # no FastAPI: the test skips
    Request = None


def refuse_without_key(request: Request) -> None:
    from fastapi import HTTPException

    if request.headers.get("x-key") != "k":
        raise HTTPException(status_code=401, detail="no key")


def fake_main() -> None:
    """The fake row's command: the app answers GET requests (as uvicorn would pass them); the answers are kept."""
    APP.answers = [asyncio.run(get(APP.app, path, headers)) for path, headers in APP.requests]


def fake_stop() -> None:
    APP.stopped = True


async def get(app, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """``app``'s answer to ``GET path`` (an ASGI call by hand): its status and body."""
    target, _, query = path.partition("?")
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": target, "raw_path": target.encode(), "query_string": query.encode(), "root_path": "",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()], "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }  # fmt: skip
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@requires("mlx_vlm")  # FastAPI: mlx-vlm's dependency
def test_an_asgi_apps_row_adds_the_summary_route_ahead_of_its_own_guards_it_and_undoes_it(monkeypatch):
    from fastapi import FastAPI

    app = FastAPI()

    @app.get("/{anything:path}")  # a catch-all route of the app's own
    def catch_all(anything: str) -> dict:
        return {"caught": anything}

    here = __name__
    row = launch.EntryPoint(
        f"{here}:fake_main", (), server=launch.AppHooks(f"{here}:APP.app", f"{here}:refuse_without_key",
                                                        f"{here}:fake_stop")
    )  # fmt: skip
    monkeypatch.setitem(launch.ENTRY_POINTS, "fake", {"server": row})
    monkeypatch.setattr(APP, "app", app, raising=False)
    monkeypatch.setattr(APP, "stopped", False, raising=False)
    monkeypatch.setattr(APP, "requests", [("/attnpass/summary", {"x-key": "k"}), ("/attnpass/summary?full=1", {}),
                                          ("/other", {})], raising=False)  # fmt: skip
    routes = list(app.router.routes)
    assert launch.run("fake", "server", [], launch.Options()) == 0
    (status, body), (refused, _), (other, caught) = APP.answers
    assert (status, json.loads(body)) == (200, {"command": "fake server", "models": []})
    assert refused == 401 and (other, json.loads(caught)) == (200, {"caught": "other"})
    assert APP.stopped and app.router.routes == routes
