"""A server run as a subprocess on 127.0.0.1 for the launcher tests: its log in a file, polled until it answers,
asked with urllib or the official ``openai`` client, stopped by SIGTERM (tests/cli/test_launch_mlx_vlm.py,
test_launch_vllm_mlx.py, test_launch_mlx_openai_server.py); the startup hook installed for a test's while."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LoggedServer:
    """``command`` as a subprocess (``env``: its environment, None: this one's), stdout and stderr in ``log``;
    ``port`` is a free port, chosen before the command is made (:meth:`command`)."""

    def __init__(self, log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log = log
        self._log = log.open("w")
        self.process = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def command(self) -> list[str]:
        """The command line that serves on :attr:`port`."""
        raise NotImplementedError

    def wait_until(self, status: Callable[[], int], timeout: float, interval: float) -> None:
        """Until ``status()`` (a health request) is 200; the server's exit or the timeout raises, with its log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if status() == 200:
                    return
            except OSError:
                pass
            time.sleep(interval)
        raise TimeoutError(f"the server on port {self.port} did not answer in {timeout} s:\n{self.log.read_text()}")

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        """``GET path``: its status and body (an HTTP error's too)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def burst(
        self, model: str, prompts: Sequence[str], *, stream: bool, max_tokens: int, api_key: str = "none"
    ) -> list[tuple[str, str]]:
        """``prompts`` as chat completions at once by the ``openai`` client (greedy, ``max_tokens`` each, streamed
        or not): each answer's text and finish reason."""
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, timeout=120, max_retries=0)

        def ask(prompt: str) -> tuple[str, str]:
            asked = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                     "temperature": 0}  # fmt: skip
            if not stream:
                choice = client.chat.completions.create(**asked).choices[0]
                return choice.message.content, choice.finish_reason
            text, reason = [], None
            for chunk in client.chat.completions.create(**asked, stream=True):
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                    reason = choice.finish_reason or reason
            return "".join(text), reason

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(ask, prompts))

    def stop(self, timeout: float = 60.0) -> tuple[int, str]:
        """SIGTERM, then its exit status and its whole log."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            status = self.process.wait()
        self._log.close()
        return status, self.log.read_text()


@contextmanager
def startup_hook() -> Iterator[None]:
    """``attnpass hook install`` into this venv while the block runs (a server's unchanged command line then runs
    through attnpass with ``ATTNPASS_OPTIMIZE=1``); removed after it unless it was there before, so the venv is left
    as it was found."""
    import sys

    def hook(action: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "attnpass.cli", "hook", action]
        return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

    before = hook("status").returncode == 0
    installed = hook("install")
    assert installed.returncode == 0 and hook("status").returncode == 0, installed
    try:
        yield
    finally:
        if not before:
            removed = hook("remove")
            assert removed.returncode == 0 and hook("status").returncode == 1, (removed, hook("status"))


def assert_ended_cleanly(ended: dict[str, tuple[int, str]], loaded: dict) -> None:
    """The plain and the attnpass server (``ended``: each :meth:`LoggedServer.stop`'s status and log) logged no
    traceback, error or warning; attnpass's exited 143 on SIGTERM, its log ending with the summary of the calls it
    routed (at least the ``loaded`` model's count its summary endpoint reported), plain's with 0 or SIGTERM."""
    import re

    (plain_status, plain_log), (status, log) = ended["plain"], ended["optimize"]
    for text in (plain_log, log):
        assert "Traceback" not in text and "attnpass: error" not in text and "attnpass: warning" not in text, text
    assert status == 128 + signal.SIGTERM and plain_status in (0, -signal.SIGTERM), (plain_log[-2000:], log[-2000:])
    lines = log.splitlines()
    assert lines[-1] == "attnpass: terminated by SIGTERM", log[-2000:]
    [printed] = [line for line in lines if line.startswith("attnpass: optimize(")]
    routed = int(re.search(r"routed (\d+) attention call", printed)[1])
    assert routed >= loaded["routed"], (printed, loaded)
