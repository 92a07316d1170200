"""A server run as a subprocess on 127.0.0.1 for the launcher tests: its log in a file, polled until it answers,
stopped by SIGTERM (tests/cli/test_launch_mlx_vlm.py, test_launch_vllm_mlx.py)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable
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
