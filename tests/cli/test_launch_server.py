"""mlx-lm's server under load through ``attnpass mlx-lm server`` (cli/launch.py), against the plain server.

Two servers on 127.0.0.1 (free ports) serve the saved tiny float32 llama: ``python -m mlx_lm server`` and
``python -m attnpass.cli mlx-lm --min-keys 0 server`` (tiny contexts route). Both get the same bursts from 16
concurrent clients (benchmarks/mlx_lm_server.py's client): completions and chats, streamed and not, prompts of
4 to 19 tokens and up to 16 generated tokens, greedy, some streams hung up after 2 chunks. Every response of
the optimized server must be the plain one's (text; not streamed: the token ids and their log-probabilities,
equal as JSON floats, i.e. bit for bit), its RSS after two more bursts within 10% of its RSS after two
warm-up bursts (which build the signatures and fill the buffer pools: RSS grows ~10% there, plain mlx-lm's
too), its log free of exceptions other than the broken pipes of
the clients that hung up (plain mlx-lm logs those too), and its summary (``GET /attnpass/summary`` and the
line printed when SIGTERM stops it) must count the routed calls.
"""

from __future__ import annotations

import re
import runpy
import signal
import time
from pathlib import Path

import pytest

from tests.util import requires

pytestmark = requires("mlx.core", "mlx_lm")

CLIENTS, REQUESTS, MAX_TOKENS = 16, 16, 16
WARM_UP, BURSTS = 2, 2  # bursts before RSS is read, then between the two readings
BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "mlx_lm_server.py"
CLIENT_HUNG_UP = {"BrokenPipeError", "ConnectionResetError"}


@pytest.fixture(scope="module")
def client() -> dict:
    return runpy.run_path(str(BENCHMARK))


@pytest.fixture(scope="module")
def servers(saved_lm, client, tmp_path_factory):
    """{"plain": Server, "optimize": Server}, ready; stopped (SIGTERM) at the end if a test did not."""
    logs = tmp_path_factory.mktemp("server_logs")
    Server = client["Server"]
    found = {
        "plain": Server(saved_lm[0], optimized=False, log=logs / "plain.log"),
        "optimize": Server(saved_lm[0], optimized=True, attnpass=("--min-keys", "0"), log=logs / "optimize.log"),
    }
    try:
        for server in found.values():
            server.wait_ready()
        yield found
    finally:
        for server in found.values():
            server.stop()


def exceptions(log: str) -> tuple[set[str], int]:
    """The exception classes a server's log names and its number of tracebacks (the handler threads' tracebacks
    interleave, so they are not parsed one by one)."""
    names = set(re.findall(r"\b(\w+(?:Error|Exception))\b", log)) - {"Exception"}  # "Exception occurred during ..."
    return names, log.count("Traceback (most recent call last)")


@pytest.fixture(scope="module")
def bursts(servers, client) -> tuple[list, dict, dict]:
    """The same bursts to each server: (the requests, server -> its answers to each burst, warm-up ones first,
    server -> its RSS after the warm-up and after the measured bursts)."""
    batch = client["requests"](REQUESTS, MAX_TOKENS, cancel_every=2)
    answers, rss = {}, {}
    for name, server in servers.items():
        # warm-up: the first bursts build the optimized model's signatures and fill both servers' buffer pools
        # and prompt caches (RSS grows ~10% in each, plain mlx-lm's included)
        answers[name] = [client["burst"](server.port, batch, CLIENTS)[0] for _ in range(WARM_UP)]
        time.sleep(0.5)
        rss[name] = [server.rss()]
        answers[name] += [client["burst"](server.port, batch, CLIENTS)[0] for _ in range(BURSTS)]
        time.sleep(0.5)
        rss[name].append(server.rss())
    return batch, answers, rss


def test_concurrent_requests_are_answered_as_the_plain_server_answers_them(servers, bursts, saved_lm):
    batch, answers, _ = bursts
    cancelled = sum(r.cancel_after is not None for r in batch)
    assert cancelled == 4 and sum(r.stream for r in batch) == 8 and sum(r.chat for r in batch) == 8
    for name, found in answers.items():
        assert all(a == found[0] for a in found), name  # a repeated burst is answered the same
    for request, plain, optimized in zip(batch, answers["plain"][0], answers["optimize"][0]):
        assert optimized == plain, request
        if request.cancel_after is None:
            assert plain.tokens >= request.max_tokens // 2 and plain.text, request
        if not request.stream:
            assert len(plain.logprobs) == plain.tokens == len(plain.ids), request
    summary = servers["optimize"].summary()
    [model] = summary["models"]
    assert summary["command"] == "mlx-lm server" and model["model"] == str(saved_lm[0]), summary
    assert model["routed"] > 0 and model["traces"] > 0 and "routed" in model["report"], summary


def test_the_optimized_servers_rss_stays_within_10_percent_after_the_warm_up(bursts):
    _, _, rss = bursts
    before, after = rss["optimize"]
    assert after <= 1.10 * before, f"RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB (plain: {rss['plain']})"


def test_sigterm_prints_the_summary_and_the_logs_hold_only_hung_up_clients(servers):
    served = servers["optimize"].summary()["models"][0]
    logs = {}
    for name, server in servers.items():
        status, logs[name] = server.stop()
        if name == "optimize":
            assert status == 128 + signal.SIGTERM, logs[name][-2000:]
    for name, log in logs.items():
        names, tracebacks = exceptions(log)
        assert names <= CLIENT_HUNG_UP, (name, names)
        assert tracebacks <= (WARM_UP + BURSTS) * 4, (name, tracebacks)  # at most the streams hung up, 4 per burst
    log = logs["optimize"]
    [line] = [line for line in log.splitlines() if line.startswith("attnpass: optimize(")]
    routed = int(re.search(r"routed (\d+) attention call", line)[1])
    assert routed == served["routed"] > 0, (line, served)
    assert log.rstrip().endswith("attnpass: terminated by SIGTERM") and "attnpass: error" not in log, log[-2000:]
