"""``attnpass mlx-lm|mlx-vlm COMMAND ARGS...`` (cli/launch.py): the library's own command, its models optimized.

Tiny random models saved to a temporary directory in the libraries' formats (a float32 llama, a one-layer
draft llama, a Qwen4-Exp with its QSA indexer) run through mlx-lm's ``generate`` and ``chat`` and mlx-vlm's
``generate``, plainly (the library's ``main`` with the same flags) and through the launcher with
``--min-keys 0`` (tiny contexts route): stdout must be the plain command's (its timing figures aside), the
summary on stderr must count routed calls and no declined ones, and every patch must be undone afterwards.
Bad input is one line on stderr; SIGTERM and SIGINT stop a generation with the summary and status 143 and 130.
"""

from __future__ import annotations

import importlib.util
import io
import re
import signal
import subprocess
import sys
import time

import pytest

from attnpass.cli import launch
from tests.util import requires

pytestmark = requires("mlx.core", "mlx_lm")

PROMPT = "t1 t2 t3 t4 t5"
CHAT = "t5 t6 t7\nt8 t9\nq\n"  # two turns, then q(uit)
SUMMARY = re.compile(
    r"^attnpass: optimize\((\w+)\) (\S+): routed (\d+) attention call\(s\), (\d+) trace\(s\) in [\d.]+ s "
    r"\(counted in the command's timings\); declined: (.*)$"
)
TIMINGS = re.compile(r"[\d.]+ (tokens-per-sec|GB|tok/s)")


def plain(monkeypatch, capsys, main: str, argv: list[str]) -> str:
    """The library's own ``main`` (``"module:main"``) with ``argv``: its stdout."""
    monkeypatch.setattr(sys, "argv", [main, *argv])
    launch._resolve(main)()
    return capsys.readouterr().out


def summaries(err: str) -> list[tuple[str, str, int, int, str]]:
    found = [SUMMARY.match(line) for line in err.splitlines()]
    return [(m[1], m[2], int(m[3]), int(m[4]), m[5]) for m in found if m]


def untimed(out: str) -> str:
    return TIMINGS.sub(r"N \1", out)


def assert_restored() -> None:
    from mlx_lm import utils
    from mlx_lm.models import base, llama

    assert sys.modules["mlx_lm.generate"].load is utils.load  # (mlx_lm.generate is also a function's name)
    assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


@pytest.mark.parametrize(
    "extra",
    [[], ["--draft-model", "DRAFT", "--num-draft-tokens", "3"], ["--kv-bits", "8", "--quantized-kv-start", "0"]],
    ids=["greedy", "speculative", "kv-bits-8"],
)
def test_generate_prints_mlx_lms_text_and_a_summary_of_routed_calls(saved_lm, cli, monkeypatch, capsys, extra):
    model, draft = saved_lm
    flags = ["--model", str(model), "--prompt", PROMPT, "--max-tokens", "12", "--ignore-chat-template"]
    flags += [str(draft) if f == "DRAFT" else f for f in extra]
    expected = plain(monkeypatch, capsys, "mlx_lm.generate:main", flags)
    status, out, err = cli("mlx-lm", "--min-keys", "0", "generate", *flags)
    assert status == 0, err
    assert untimed(out) == untimed(expected) and out.count("t") >= 12, (out, expected)
    found = summaries(err)
    loaded = [str(model)] + ([str(draft)] if extra[:1] == ["--draft-model"] else [])
    assert [source for _, source, *_ in found] == loaded, err
    for name, _, routed, traces, declined in found:
        assert name == "Model" and routed > 0 and traces > 0 and declined == "none", err
    assert_restored()


def test_chat_answers_as_mlx_lms_chat(saved_lm, cli, monkeypatch, capsys):
    model, _ = saved_lm
    flags = ["--model", str(model), "--max-tokens", "6", "--temp", "0"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(CHAT))
    expected = plain(monkeypatch, capsys, "mlx_lm.chat:main", flags)
    monkeypatch.setattr(sys, "stdin", io.StringIO(CHAT))
    status, out, err = cli("mlx-lm", "--min-keys", "0", "chat", *flags)
    assert status == 0, err
    assert untimed(out) == untimed(expected), (out, expected)
    # it read q(uit): mlx-lm 0.32's chat (its cli_ui) says bye; 0.31's ends after its third prompt, silently
    ended = "bye" in out if importlib.util.find_spec("mlx_lm.cli_ui") else out.endswith(">> ") and out.count(">> ") == 3
    assert ended, out
    [(_, _, routed, _, declined)] = summaries(err)
    assert routed > 0 and declined == "none", err


@requires("mlx_vlm")
def test_mlx_vlm_generate_prints_its_text_with_the_qsa_calls_routed(tmp_path, cli, monkeypatch, capsys):
    from attnpass.models.tiny_vlm import save_tiny_vlm

    model = save_tiny_vlm(tmp_path / "qwen4", "qwen4_exp")
    # 60 prompt bytes: more than 4 complete blocks of 4, so the indexer's selection is sparse from the prompt on
    prompt = "a prompt long enough to pass the QSA indexer's budget of 16 :)"
    flags = ["--model", str(model), "--prompt", prompt, "--max-tokens", "8", "--temperature", "0"]
    expected = plain(monkeypatch, capsys, "mlx_vlm.generate.dispatch:main", flags)
    status, out, err = cli("mlx-vlm", "--min-keys", "0", "generate", *flags)
    assert status == 0, err
    assert untimed(out) == untimed(expected), (out, expected)
    [(_, _, routed, traces, declined)] = summaries(err)
    assert routed >= 2 * 8 and traces > 0 and declined == "none", err  # 2 QSA layers: prefill and each decode
    from mlx_vlm.models.qwen4_exp import language, qsa_kernel

    assert language.dispatch_qsa_attention is qsa_kernel.dispatch_qsa_attention


def test_explain_prints_optimizes_report_and_no_summary_prints_nothing(saved_lm, cli):
    flags = ["--model", str(saved_lm[0]), "--prompt", PROMPT, "--max-tokens", "3", "--verbose", "False"]
    status, out, err = cli("mlx-lm", "--min-keys", "0", "--explain", "generate", *flags)
    assert status == 0 and out.strip(), err
    # the short report: decisions grouped by kind, the passes with nothing to rewrite in a llama on one line
    assert f"attnpass: {saved_lm[0]}:" in err and "program attention: " in err and "decompose-sdpa" in err, err
    [idle] = [line for line in err.splitlines() if "nothing to rewrite for" in line]
    assert all(name in idle for name in ("mla-absorb", "qsa-gather", "dsa-gather")), err
    assert not any(
        line.lstrip().startswith(("[mla-absorb]", "[qsa-gather]", "[dsa-gather]")) for line in err.splitlines()
    )
    cut = [line for line in err.splitlines() if not line.startswith(("optimize(", "  program "))]  # cut to 120
    assert max(map(len, cut)) <= 120, err
    assert "signature(s) cached" not in err and "(--explain-full: every signature" in err, err
    status, _, full = cli("mlx-lm", "--min-keys", "0", "--explain-full", "generate", *flags)
    assert status == 0 and "signature(s) cached" in full and "[mla-absorb] declined" in full, full
    status, _, err = cli("mlx-lm", "--min-keys", "0", "--no-summary", "generate", *flags)
    assert status == 0 and err == "", err


def test_the_pipeline_and_min_keys_reach_optimize(saved_lm, cli):
    flags = ["--model", str(saved_lm[0]), "--prompt", PROMPT, "--max-tokens", "3", "--verbose", "False"]
    # the default bound on CPU (float32: 192 key rows) declines these short contexts by name, and the summary
    # names the bound and the option that moves it
    status, _, err = cli("mlx-lm", "generate", *flags)
    [(_, _, routed, traces, declined)] = summaries(err)
    assert status == 0 and routed == 0 and traces >= 1, err
    bound = r"\d+ x short_context \(under 192 key rows in float32; --min-keys 0 routes them\)"
    assert re.fullmatch(bound, declined), err
    status, _, err = cli(
        "mlx-lm", "--min-keys", "0", "--pipeline", "raise-attention,head-chunk", "--explain", "generate", *flags
    )
    assert status == 0 and "pipeline raise-attention,head-chunk\n" in err and "decompose-sdpa" not in err, err


def one_line_error(result, *fragments: str) -> None:
    status, out, err = result
    assert status == 1 and out == "", (status, out, err)
    assert err.startswith("attnpass: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_bad_input_is_one_line(saved_lm, cli, tmp_path):
    missing = tmp_path / "no-such-model"
    one_line_error(
        cli("mlx-lm", "generate", "--model", missing, "--prompt", "t1"),
        f"mlx-lm generate: cannot load '{missing}'",
        "no such local path",
    )
    one_line_error(
        cli("mlx-lm", "convert", "--model", missing),
        "mlx-lm: no command 'convert'; its commands: generate, chat, server",
    )
    one_line_error(
        cli("mlx-lm", "-p", "head-chunk{budget=x}", "generate", "--model", saved_lm[0]), "head-chunk", "budget"
    )
    # mlx-lm's own flags are its parser's: its usage, under our name, and its exit status
    status, _, err = cli("mlx-lm", "generate", "--max-tokens", "many")
    assert status == 2 and "usage: attnpass mlx-lm generate" in err and "invalid int value: 'many'" in err, err
    assert_restored()


def test_a_model_that_cannot_be_optimized_runs_plain_with_a_warning_or_fails_when_strict():
    session = launch.Session("mlx-lm generate", launch.Options())
    with pytest.warns(UserWarning, match=r"mlx-lm generate: somewhere runs plain, not optimized: optimize: expected"):
        session.optimize("somewhere", object())
    assert session.models() == [] and session.lines() == []
    strict = launch.Session("mlx-lm generate", launch.Options(strict=True))
    from attnpass.ir import AttnpassError

    with pytest.raises(AttnpassError, match=r"somewhere cannot be optimized \(--strict\)"):
        strict.optimize("somewhere", object())


@pytest.mark.parametrize(("signum", "said"), [(signal.SIGTERM, "terminated"), (signal.SIGINT, "interrupted")])
def test_a_signal_stops_a_generation_with_the_summary(saved_lm, signum, said):
    flags = ["--model", str(saved_lm[0]), "--prompt", PROMPT, "--max-tokens", "100000", "--ignore-chat-template"]
    command = [sys.executable, "-m", "attnpass.cli", "mlx-lm", "--min-keys", "0", "generate", *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.read(12).startswith("=========="), "generation never started"
        time.sleep(1.0)  # decoding tokens
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signum, err
    [(_, _, routed, _, declined)] = summaries(err)
    assert routed > 0 and declined == "none", err
    assert err.rstrip().endswith(f"attnpass: {said} by {signum.name}") and "Traceback" not in err, err
    assert "error" not in err, err  # a signal is how a command is stopped, not a failure
