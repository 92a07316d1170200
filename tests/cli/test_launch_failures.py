"""``attnpass mlx-lm``'s mistakes and failures (cli/launch.py): each one line on stderr naming what is valid.

mlx-lm's server exits by itself, non-zero and within 5 s (its address and a local model folder are checked before
mlx-lm, which imports transformers and torch, is imported), on a used port or a model folder that cannot be loaded,
before it listens; a
running server (127.0.0.1, a free port) names mlx-lm's warnings as mlx-lm's, prints its summary periodically when
asked, answers the short and the full report, and ends on SIGTERM without an error. attnpass's own options given
after the command, a missing ``--prompt-cache-file``, an exception of mlx-lm's own and a draft model that cannot
be loaded are one line; ``attnpass passes`` describes every option of the built-in passes.
"""

from __future__ import annotations

import http.client
import importlib
import json
import re
import runpy
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.util import requires

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "mlx_lm_server.py"
EXIT_WITHIN = 5.0  # seconds from the command's start


def one_line_error(result, *fragments: str) -> str:
    status, out, err = result
    assert status == 1 and out == "", (status, out, err)
    assert err.startswith("attnpass: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "unexpected" not in err and "usage:" not in err, err
    for fragment in fragments:
        assert fragment in err, err
    return err


def serve(*argv: str) -> tuple[int, str, str, float]:
    """``attnpass mlx-lm server ARGS`` to its end (bounded): its status, stdout, stderr and seconds."""
    start = time.monotonic()
    command = [sys.executable, "-m", "attnpass.cli", "mlx-lm", "server", *argv]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - start


@requires("mlx.core", "mlx_lm")
def test_a_used_port_ends_the_server_with_one_line_naming_it(saved_lm):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        status, out, err, seconds = serve("--model", str(saved_lm[0]), "--host", "127.0.0.1", "--port", str(port))
    assert status == 1 and out == "", (status, out, err)
    assert err == (
        f"attnpass: error: mlx-lm server: cannot listen on 127.0.0.1:{port}: address already in use "
        f"(another process listens on port {port}: give --port a free one)\n"
    )
    assert seconds < EXIT_WITHIN, seconds


@requires("mlx.core", "mlx_lm")
def test_a_model_that_cannot_be_loaded_ends_the_server_before_it_listens(saved_lm, tmp_path):
    broken = tmp_path / "no-config"
    broken.mkdir()
    for file in saved_lm[0].iterdir():  # the weights and the tokenizer, no config.json
        if file.name != "config.json":
            (broken / file.name).write_bytes(file.read_bytes())
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    status, out, err, seconds = serve("--model", str(broken), "--host", "127.0.0.1", "--port", str(port))
    # one line, and nothing of the server's: no warning, no "Starting httpd", no generation thread's traceback
    assert status == 1 and out == "", (status, out, err)
    assert err == (
        f"attnpass: error: mlx-lm server: cannot load '{broken}': the folder has no config.json; a model folder "
        "holds config.json, its *.safetensors weights and its tokenizer files (as mlx_lm.convert writes them)\n"
    )
    assert seconds < EXIT_WITHIN, seconds


@requires("mlx.core", "mlx_lm")
def test_a_running_server_reports_and_ends_on_sigterm_without_an_error(saved_lm, tmp_path):
    Server = runpy.run_path(str(BENCHMARK))["Server"]
    server = Server(saved_lm[0], optimized=True, attnpass=("--summary-every", "0.2"), log=tmp_path / "server.log")
    try:
        server.wait_ready(timeout=60)  # one request: 3 traces of the default bound's declines
        time.sleep(0.6)  # a periodic summary line
        reports = {}
        for query in ("", "?full=1"):
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            connection.request("GET", "/attnpass/summary" + query)
            [model] = json.loads(connection.getresponse().read())["models"]
            reports[query] = model["report"]
    finally:
        status, log = server.stop(timeout=30)
    assert status == 128 + signal.SIGTERM, log[-2000:]
    assert model["summary"].startswith(f"optimize(Model) {saved_lm[0]}: routed 0 attention call(s)"), model
    assert "short_context (under 192 key rows in float32; --min-keys 0 routes them)" in model["summary"], model
    short, full = reports[""], reports["?full=1"]
    assert "nothing to rewrite for mla-absorb, qsa-gather, dsa-gather" in short and "[qsa-gather]" not in short, short
    assert "signature(s) cached" in full and "[qsa-gather] declined" in full and len(full) > len(short), full
    lines = log.splitlines()
    summaries = [i for i, line in enumerate(lines) if line.startswith("attnpass: optimize(Model)")]
    assert len(summaries) >= 2 and summaries[0] < lines.index("attnpass: terminated by SIGTERM") - 1, log
    assert "mlx-lm: warning: mlx_lm.server is not recommended for production" in log, log
    assert "attnpass: warning" not in log and "attnpass: error" not in log and "Traceback" not in log, log
    assert lines[-1] == "attnpass: terminated by SIGTERM", log[-2000:]


@requires("mlx.core", "mlx_lm")
@pytest.mark.parametrize(
    ("given", "moved"),
    [
        (["--min-keys", "0"], "attnpass mlx-lm --min-keys 0 generate ..."),
        (["--explain"], "attnpass mlx-lm --explain generate ..."),
        (["--summary-every=5"], "attnpass mlx-lm --summary-every=5 generate ..."),
    ],
)
def test_attnpass_options_after_the_command_are_named_with_where_they_go(saved_lm, cli, given, moved):
    option = given[0].split("=")[0]
    err = one_line_error(
        cli("mlx-lm", "generate", "--model", saved_lm[0], *given, "--prompt", "t1"),
        f"mlx-lm generate: {option} is an option of attnpass, not of mlx-lm generate: give it before the command",
    )
    assert err.rstrip().endswith(moved), err
    # mlx-lm's own mistakes stay its parser's: its usage and status 2
    status, _, err = cli("mlx-lm", "generate", "--model", saved_lm[0], "--no-such-flag")
    assert status == 2 and "usage: attnpass mlx-lm generate" in err and "--no-such-flag" in err, err


@requires("mlx.core", "mlx_lm")
def test_a_missing_prompt_cache_file_and_mlx_lms_own_exceptions_are_one_line(saved_lm, cli, tmp_path):
    flags = ["--model", saved_lm[0], "--prompt", "t1", "--max-tokens", "2"]
    missing = tmp_path / "missing.safetensors"
    one_line_error(
        cli("mlx-lm", "generate", *flags, "--prompt-cache-file", missing),
        f"mlx-lm generate: --prompt-cache-file '{missing}': no such file; give a prompt cache .safetensors file "
        "written by mlx_lm.cache_prompt",
    )
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    err = one_line_error(cli("mlx-lm", "generate", *flags, "--prompt-cache-file", garbage))
    assert re.match(r"attnpass: error: mlx-lm generate failed: \w+: ", err), err  # mlx-lm's error, by its type


@requires("mlx.core", "mlx_lm")
def test_a_draft_model_that_cannot_be_loaded_is_one_line_without_a_summary(saved_lm, cli, tmp_path):
    missing = tmp_path / "nonexistent"
    one_line_error(
        cli("mlx-lm", "generate", "--model", saved_lm[0], "--draft-model", missing, "--prompt", "t1"),
        f"mlx-lm generate: cannot load '{missing}' (no such local path",
    )  # the model loaded before it ran no attention call: no summary line for it


def test_warnings_are_named_by_the_package_that_gave_them(capsys):
    from attnpass.backends.specialize import FallbackWarning

    cli_main = importlib.import_module("attnpass.cli.main")  # the module (attnpass.cli.main is also its function)

    shown = warnings.showwarning
    warnings.showwarning = cli_main._show_warning
    try:
        import json.decoder as foreign  # any imported module that is not attnpass's

        warnings.warn_explicit("theirs\nsecond line", UserWarning, foreign.__file__, 1)
        warnings.warn_explicit("ours", FallbackWarning, foreign.__file__, 1)  # attnpass's category, any file
        warnings.warn_explicit("ours too", UserWarning, cli_main.__file__, 1)
    finally:
        warnings.showwarning = shown
    assert capsys.readouterr().err.splitlines() == [
        "json: warning: theirs",
        "attnpass: warning: ours",
        "attnpass: warning: ours too",
    ]


def test_passes_describes_every_option_of_the_built_in_passes(cli):
    from attnpass.passes import available_passes, get_pass
    from attnpass.passes.analysis.devices import DEVICES
    from attnpass.passes.infra.pipeline_text import pass_options

    status, out, _ = cli("passes")
    assert status == 0
    lines = out.splitlines()
    for name in available_passes():
        cls = get_pass(name)
        at = lines.index(f"{name}  ({cls.__module__}.{cls.__qualname__})")
        for option in pass_options(cls):
            if not option.kinds:  # not settable from text
                continue
            row = next(i for i in range(at, len(lines)) if lines[i] == f"    option {option}")
            described = lines[row + 1]
            assert described.startswith("        ") and len(described.split()) >= 5, (name, option.name, described)
    assert f"one of {', '.join(DEVICES)}" in out and "ATTNPASS_SDPA_HEAD_CHUNK" in out
    assert "one of mlx, jax, or none" in out and "one of exact, reference" in out and "one of pooled, keys" in out


def test_an_exception_of_the_library_is_named_as_its_own_and_one_of_attnpass_stays_unexpected():
    from attnpass.cli import commands, launch
    from attnpass.ir import AttnpassError

    with pytest.raises(AttnpassError, match=r"^mlx-lm generate failed: ValueError: invalid literal for int"):
        launch._status("mlx-lm generate", lambda: int("x"))  # raised outside attnpass: the library's
    with pytest.raises(AttributeError) as raised:  # raised in attnpass's own code: a bug, shown as unexpected
        launch._status("mlx-lm generate", lambda: commands.first_sentence(None))
    assert not isinstance(raised.value, AttnpassError)
