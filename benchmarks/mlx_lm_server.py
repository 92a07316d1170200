"""Benchmark (not a test): mlx-lm's server, plain and under ``attnpass mlx-lm server``, with concurrent clients.

Model: :func:`attnpass.models.save_tiny_lm` (llama, 24 query / 2 KV heads of dim 128, 2 layers, hidden 384),
saved to a temporary directory in ``--dtype``. Two servers on 127.0.0.1 (free ports): ``python -m mlx_lm
server`` and ``python -m attnpass.cli mlx-lm [--min-keys N] server`` with the same flags. For each
``--clients`` count, each server gets the same burst (one server, then the other, then again in the other
order: ``--rounds`` pairs, medians reported): ``--requests`` OpenAI-style requests from that many concurrent
clients, alternating ``/v1/completions`` and ``/v1/chat/completions``, streaming and not, prompts of 4 to
``4 + --requests`` tokens and ``max_tokens`` from ``--max-tokens``/2 to ``--max-tokens`` (:func:`requests`),
greedy (temperature 0). The table reports requests/s and generated tokens/s of each, their ratio, whether every
response was the same on both servers, and each server's RSS after the run. The first burst of each server
(which builds the optimized model's signatures) is a warm-up, not timed. mlx-lm's server batches concurrent
requests (``BatchKVCache``): the optimized one routes its batched decode calls. On a shared machine compare
the ratios, not the rates. The test of the server under load (tests/cli/test_launch_server.py) reuses
:class:`Server`, :func:`requests` and :func:`burst`.

    python benchmarks/mlx_lm_server.py [--clients 4 16] [--requests 32] [--max-tokens 64] [--rounds 2]
        [--dtype float32] [--min-keys 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Request:
    """One client request: ``chat`` or completion, streamed or not, and after how many streamed chunks the client
    hangs up (None: reads to the end)."""

    prompt: str
    max_tokens: int
    chat: bool = False
    stream: bool = False
    cancel_after: int | None = None

    def body(self) -> dict:
        body = {"max_tokens": self.max_tokens, "temperature": 0.0, "stream": self.stream}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        else:
            body["logprobs"] = True
        return body


@dataclass(frozen=True)
class Response:
    """What a client got: the text, the tokens generated (usage; a cancelled stream: its chunks) and, not
    streamed, the tokens' ids and log-probabilities; ``retries``: connections the server reset before answering
    (not compared)."""

    text: str
    tokens: int
    ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    retries: int = field(default=0, compare=False)


# mlx-lm's server is an http.server.ThreadingHTTPServer, which listens with a backlog of 5 connections: with more
# clients connecting at once than it accepts, the kernel resets some (plain mlx-lm as well). A client retries
# those, as the OpenAI client does by default (2 retries); the request never reached the server.
RETRIES = 5


def requests(count: int, max_tokens: int, *, cancel_every: int = 0) -> list[Request]:
    """``count`` requests of different lengths: prompts of 4 to ``4 + count`` tokens, ``max_tokens`` from half
    of it up, completions and chats, streamed and not in turn; every ``cancel_every``-th streamed one (0: none)
    hangs up after 2 chunks."""
    found = []
    for i in range(count):
        prompt = " ".join(f"t{(7 * i + j) % 500 + 1}" for j in range(4 + i))
        stream = i % 4 >= 2
        cancel = 2 if stream and cancel_every and (i // 4) % cancel_every == 0 else None
        found.append(Request(prompt, max_tokens // 2 + i * max_tokens // (2 * count), i % 2 == 1, stream, cancel))
    return found


# the launcher tests' server process (tests/cli/servers.py), loaded by path as a registered module (no sys.path edit)
if "attnpass_test_servers" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "attnpass_test_servers", Path(__file__).resolve().parents[1] / "tests" / "cli" / "servers.py"
    )
    sys.modules["attnpass_test_servers"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["attnpass_test_servers"])
LoggedServer = sys.modules["attnpass_test_servers"].LoggedServer


class Server(LoggedServer):
    """An mlx-lm server process on 127.0.0.1 (``optimized``: through ``attnpass mlx-lm``), its log in a file."""

    def __init__(self, model: Path, *, optimized: bool, attnpass: tuple[str, ...] = (), log: Path) -> None:
        self.model, self.optimized, self.attnpass = model, optimized, attnpass
        super().__init__(log)

    def command(self) -> list[str]:
        flags = ["--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port)]
        launcher = (
            [sys.executable, "-m", "attnpass.cli", "mlx-lm", *self.attnpass]
            if self.optimized
            else [sys.executable, "-m", "mlx_lm"]
        )
        return [*launcher, "server", *flags]

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the model is loaded: a first tiny request has an answer."""
        self.wait_until(lambda: call(self.port, Request("t1", 1)) and 200, timeout, 0.2)

    def rss(self) -> int:
        """The server process's resident set size in bytes (Linux: /proc)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc/PID/status")

    def summary(self) -> dict:
        """``GET /attnpass/summary`` (the optimized server only)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        connection.request("GET", "/attnpass/summary")
        return json.loads(connection.getresponse().read())


def call(port: int, request: Request, timeout: float = 300.0) -> Response:
    """Send ``request`` and read its answer (a stream chunk by chunk; a cancelled one: hang up early)."""
    path = "/v1/chat/completions" if request.chat else "/v1/completions"
    connection, answer, retries = _open(port, path, request, timeout)
    try:
        if answer.status != 200:
            raise RuntimeError(f"{path}: HTTP {answer.status}: {answer.read()[:200]!r}")
        if request.stream:
            return dataclasses.replace(_read_stream(answer, request), retries=retries)
        choice = json.loads(answer.read())
        usage, choice = choice["usage"], choice["choices"][0]
        text = choice["message"]["content"] if request.chat else choice["text"]
        content = choice.get("logprobs", {}).get("content", [])
        ids, logprobs = tuple(c["id"] for c in content), tuple(c["logprob"] for c in content)
        return Response(text, usage["completion_tokens"], ids, logprobs, retries)
    finally:
        connection.close()


def _open(port: int, path: str, request: Request, timeout: float) -> tuple:
    """The connection, the answer's head and the retries: a connection reset before the answer began is tried
    again (:data:`RETRIES`)."""
    retries = 0
    while True:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            connection.request("POST", path, json.dumps(request.body()), {"Content-Type": "application/json"})
            return connection, connection.getresponse(), retries
        except (ConnectionResetError, http.client.RemoteDisconnected):
            connection.close()
            if retries == RETRIES:
                raise
            retries += 1
            time.sleep(0.05 * retries)


def _read_stream(answer: http.client.HTTPResponse, request: Request) -> Response:
    text, chunks, tokens = [], 0, None
    for line in answer:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage") and not event.get("choices"):
            tokens = event["usage"]["completion_tokens"]
            continue
        choice = event["choices"][0]
        text.append(choice["delta"].get("content") or "" if request.chat else choice.get("text") or "")
        chunks += 1
        if request.cancel_after is not None and chunks >= request.cancel_after:
            break  # hang up mid-stream: the caller closes the connection
    return Response("".join(text), chunks if tokens is None else tokens)


def burst(port: int, batch: list[Request], clients: int) -> tuple[list[Response], float]:
    """``batch`` sent by ``clients`` concurrent clients: the responses (in order) and the wall seconds."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        responses = list(pool.map(lambda r: call(port, r), batch))
    return responses, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--min-keys", type=int, default=None, help="attnpass mlx-lm --min-keys (default: optimize's)")
    args = parser.parse_args()
    from attnpass.models import save_tiny_lm

    attnpass = () if args.min_keys is None else ("--min-keys", str(args.min_keys))
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_lm(Path(tmp) / "model", dtype=args.dtype)
        servers = {
            "plain": Server(model, optimized=False, log=Path(tmp) / "plain.log"),
            "optimize": Server(model, optimized=True, attnpass=attnpass, log=Path(tmp) / "optimize.log"),
        }
        try:
            for server in servers.values():
                server.wait_ready()
            print(f"load average {os.getloadavg()[0]:.2f}; {args.requests} requests, max_tokens <= {args.max_tokens}")
            print(
                f"{'clients':>7} {'plain req/s':>11} {'opt req/s':>9} {'plain tok/s':>11} {'opt tok/s':>9} {'ratio':>6} same"
            )
            for clients in args.clients:
                _row(servers, requests(args.requests, args.max_tokens), clients, args.rounds)
            summary = servers["optimize"].summary()["models"][0]
            rss = ", ".join(f"{name} {server.rss() / 2**20:.0f} MiB" for name, server in servers.items())
            print(f"optimize: routed {summary['routed']}, {summary['traces']} trace(s), declined {summary['declined']}")
            print(f"RSS after the run: {rss}; load average {os.getloadavg()[0]:.2f}")
        finally:
            for server in servers.values():
                server.stop()


def _row(servers: dict[str, Server], batch: list[Request], clients: int, rounds: int) -> None:
    """One table row: ``rounds`` pairs of timed bursts after an untimed one per server, medians."""
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
    answers = {name: burst(server.port, batch, clients)[0] for name, server in servers.items()}  # warm-up
    for round_ in range(rounds):
        for name in list(servers)[:: 1 if round_ % 2 == 0 else -1]:
            responses, seconds = burst(servers[name].port, batch, clients)
            rates[name].append((len(batch) / seconds, sum(r.tokens for r in responses) / seconds))
    same = answers["plain"] == answers["optimize"]
    plain, opt = ([statistics.median(r[i] for r in rates[name]) for i in (0, 1)] for name in servers)
    print(
        f"{clients:>7} {plain[0]:>11.2f} {opt[0]:>9.2f} {plain[1]:>11.1f} {opt[1]:>9.1f} {opt[1] / plain[1]:>6.2f} {same}"
    )


if __name__ == "__main__":
    main()
