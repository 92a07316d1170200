"""``attnpass hook install|remove|status`` (cli/hook.py) and what its ``.pth`` line imports (cli/startup.py).

The hook's file goes to a temporary folder here, never to this venv's site-packages (the end-to-end run, the hook
installed into a real venv and an unchanged ``vllm-mlx serve`` started, is tests/cli/test_launch_vllm_mlx.py's, in
``.venv-servers``). Interpreter start is replayed in a subprocess in its order: ``sys.argv`` set to a console
script's command line, then ``site.addsitedir`` of the folder (``site`` runs the ``.pth`` line), then the script
run as ``__main__``. The script is pip's form for mlx-lm's ``generate`` (a row of ENTRY_POINTS): with
``ATTNPASS_OPTIMIZE=1`` its stdout is plain mlx-lm's and stderr has attnpass's summary with calls routed; without
the switch no attnpass module is imported at all; a bad option variable is one warning line, and the program runs
plain.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from attnpass.cli import hook, startup
from attnpass.ir.core.switches import OFF, ON, parse_switch
from tests.util import requires

SCRIPT = """#!{python}
# -*- coding: utf-8 -*-
import re
import sys
from {module} import {name}
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit({name}())
"""
# interpreter start in its order: argv, then site's .pth processing, then the script; at exit, attnpass's modules
REPLAY = (
    "import atexit, runpy, site, sys; "
    "atexit.register(lambda: print('modules:', sorted(m for m in sys.modules if m.startswith('attnpass')), "
    "file=sys.stderr)); "
    "sys.argv = sys.argv[1:]; site.addsitedir(sys.argv.pop(0)); runpy.run_path(sys.argv[0], run_name='__main__')"
)


def script(folder: Path, target: str) -> Path:
    module, name = target.split(":")
    path = folder / "console-script"
    path.write_text(SCRIPT.format(python=sys.executable, module=module, name=name))
    return path


def test_the_switch_reads_the_words_as_the_library_does():
    for word in (*ON, *OFF, " On ", "FALSE", "", "2", "enable", "flase"):
        assert startup._switch(word) is parse_switch(word), word


def test_script_target_reads_pips_console_script_and_nothing_else(tmp_path):
    assert startup.script_target(str(script(tmp_path, "vllm_mlx.cli:main"))) == "vllm_mlx.cli:main"
    uv_like = tmp_path / "uv"
    uv_like.write_text("#!/usr/bin/python\nimport sys\nfrom mlx_lm.server import main\nsys.exit(main())\n")
    assert startup.script_target(str(uv_like)) == "mlx_lm.server:main"
    cases = {
        "no shebang": "import sys\nfrom a.b import main\nsys.exit(main())\n",
        "two imports": "#!/p\nimport sys\nfrom a import main\nfrom b import run\nsys.exit(main())\n",
        "no exit": "#!/p\nfrom a import main\nmain()\n",
        "too long": "#!/p\nimport sys\nfrom a import main\nsys.exit(main())\n" + "#" * startup.SCRIPT_BYTES,
    }
    for why, text in cases.items():
        (tmp_path / "s").write_text(text)
        assert startup.script_target(str(tmp_path / "s")) is None, why
    (tmp_path / "binary").write_bytes(b"#!\xff\xfe" + bytes(range(256)))
    for path in (tmp_path / "binary", tmp_path / "missing", tmp_path, "-c", ""):
        assert startup.script_target(str(path)) is None, path


def test_env_options_are_the_launcher_options_and_a_bad_value_names_its_variable():
    env = {"ATTNPASS_MIN_KEYS": "0", "ATTNPASS_PIPELINE": "dce", "ATTNPASS_STRICT": "yes",
           "ATTNPASS_SUMMARY_EVERY": "2.5"}  # fmt: skip
    assert startup.env_options(env) == ["--pipeline", "dce", "--min-keys", "0", "--strict", "--summary-every", "2.5"]
    assert startup.env_options({"ATTNPASS_STRICT": "off", "ATTNPASS_MIN_KEYS": " "}) == []
    bad = {"ATTNPASS_MIN_KEYS": "-1", "ATTNPASS_STRICT": "maybe", "ATTNPASS_SUMMARY_EVERY": "0"}
    for variable, value in bad.items():
        with pytest.raises(ValueError, match=f"^{variable}='{value}': give "):
            startup.env_options({variable: value})


def test_start_acts_only_for_a_row_s_console_script_with_the_switch_on(tmp_path, monkeypatch, capsys):
    vllm = str(script(tmp_path, "vllm_mlx.cli:main"))
    other = tmp_path / "other"
    other.write_text(SCRIPT.format(python=sys.executable, module="pytest", name="console_main"))
    finders = list(sys.meta_path)
    for argv, env in (
        ([vllm, "serve", "M"], {}),
        ([vllm, "serve", "M"], {"ATTNPASS_OPTIMIZE": "0"}),
        ([str(other)], {"ATTNPASS_OPTIMIZE": "1"}),
        (["-c"], {"ATTNPASS_OPTIMIZE": "1"}),
    ):
        assert startup.start(argv, env) is False, (argv, env)
    assert capsys.readouterr().err == ""
    assert startup.start([vllm, "serve", "M"], {"ATTNPASS_OPTIMIZE": "perhaps"}) is False
    assert startup.start([vllm, "serve", "M"], {"ATTNPASS_OPTIMIZE": "1", "ATTNPASS_MIN_KEYS": "x"}) is False
    err = capsys.readouterr().err.splitlines()
    assert err == [
        (
            "attnpass: warning: ATTNPASS_OPTIMIZE='perhaps' is not a recognised value (1/on/yes/true or "
            "0/off/no/false): console-script runs plain"
        ),
        (
            "attnpass: warning: ATTNPASS_OPTIMIZE: console-script runs plain: ValueError: ATTNPASS_MIN_KEYS='x': "
            "give an int >= 0 (the fewest key rows a routed call has)"
        ),
    ], err
    assert sys.meta_path == finders
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    assert startup.start([vllm, "serve", "M"], {"ATTNPASS_OPTIMIZE": "on"}) is True
    [finder] = [f for f in sys.meta_path if f not in finders]
    assert (finder.module, finder.name) == ("vllm_mlx.cli", "main")


def test_the_replaced_main_runs_the_row_by_attnpass_s_command_line_or_plain(monkeypatch, capsys):
    module = types.SimpleNamespace()
    calls = []

    def main(*args):
        calls.append(("plain", args))
        return 5

    module.main = main
    rows = [("vllm-mlx", "serve", ("serve",))]
    run = startup._replacement(module, main, "main", rows=rows, options=["--min-keys", "0"], program="vllm-mlx")
    cli_main = sys.modules["attnpass.cli.main"]  # (the package's name main is the function)
    monkeypatch.setattr(cli_main, "main", lambda argv: calls.append(("attnpass", argv)) or 7)
    monkeypatch.setattr(sys, "argv", ["vllm-mlx", "serve", "M", "--port", "1"])
    assert run() == 7 and module.main is main
    assert calls == [("attnpass", ["vllm-mlx", "--min-keys", "0", "serve", "M", "--port", "1"])]
    monkeypatch.setattr(sys, "argv", ["vllm-mlx", "bench", "M"])
    calls.clear()
    assert run() == 5 and calls == [("plain", ())]
    assert capsys.readouterr().err == (
        "attnpass: warning: ATTNPASS_OPTIMIZE: vllm-mlx bench is none of attnpass's commands (vllm-mlx serve): it "
        "runs plain\n"
    )


def test_install_status_remove(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNPASS_OPTIMIZE", raising=False)
    path = tmp_path / hook.PTH_NAME
    absent = f"attnpass: the startup hook is not installed ({path} does not exist): attnpass hook install"
    assert hook.status(tmp_path) == (False, absent)
    assert hook.install(tmp_path).startswith(f"attnpass: installed the startup hook: {path}; in {sys.prefix}, ")
    assert path.read_text() == hook.PTH_LINE and hook.PTH_LINE.count("\n") == 1 and hook.PTH_LINE.startswith("import ")
    assert hook.install(tmp_path) == f"attnpass: the startup hook is already installed: {path}"
    installed, line = hook.status(tmp_path)
    assert installed and "ATTNPASS_OPTIMIZE is unset here" in line, line
    path.write_text("import os\n")
    foreign = f"attnpass: {path} is not this attnpass's startup hook: attnpass hook install rewrites it"
    assert hook.status(tmp_path) == (False, foreign)
    assert hook.remove(tmp_path) == f"attnpass: removed the startup hook: {path}" and not path.exists()
    assert hook.remove(tmp_path) == f"attnpass: no startup hook to remove: {path} does not exist"
    assert hook.hook_path() == Path(__import__("sysconfig").get_paths()["purelib"]) / hook.PTH_NAME


def test_the_pth_line_of_a_missing_attnpass_is_one_warning_and_the_program_runs(tmp_path):
    site = tmp_path / "lib"
    site.mkdir()
    hook.install(site)
    (tmp_path / "lib64").symlink_to(site)  # a venv's site-packages read twice, as lib and lib64
    code = (
        "import site, sys; sys.modules['attnpass'] = None; site.addsitedir(sys.argv[1]); site.addsitedir(sys.argv[2]); "
        "print('ran')"
    )
    env = os.environ | {"ATTNPASS_OPTIMIZE": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(site), str(tmp_path / "lib64")], capture_output=True,
                          text=True, env=env, timeout=60, check=False)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "ran\n"), done
    [line] = done.stderr.splitlines()
    assert line.startswith("attnpass: warning: ATTNPASS_OPTIMIZE: the startup hook failed (ModuleNotFoundError: "), line
    assert line.endswith("); this program runs plain"), line


@requires("mlx.core", "mlx_lm")
def test_an_unchanged_mlx_lm_generate_runs_as_attnpass_s_when_switched_on(tmp_path, saved_lm):
    model, _ = saved_lm
    hook.install(tmp_path)
    generate = script(tmp_path, "mlx_lm.generate:main")
    argv = [str(generate), "--model", str(model), "--prompt", "t1 t2 t3 t4 t5", "--max-tokens", "6"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPASS_")}

    def replay(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", REPLAY, str(tmp_path), *argv], capture_output=True, text=True,
                              env=base | env, timeout=300, check=False)  # fmt: skip

    plain = replay()
    on = replay(ATTNPASS_OPTIMIZE="1", ATTNPASS_MIN_KEYS="0")
    bad = replay(ATTNPASS_OPTIMIZE="1", ATTNPASS_MIN_KEYS="many")
    for done in (plain, on, bad):
        assert done.returncode == 0, done.stderr
    text = [line for line in plain.stdout.splitlines() if "tokens-per-sec" not in line and "GB" not in line]
    assert (
        text and [line for line in on.stdout.splitlines() if "tokens-per-sec" not in line and "GB" not in line] == text
    )
    assert plain.stderr.splitlines()[-1] == "modules: []", plain.stderr
    summary = [line for line in on.stderr.splitlines() if line.startswith("attnpass: optimize(Model)")]
    assert len(summary) == 1 and " declined: none" in summary[0], on.stderr
    assert int(summary[0].split("routed ")[1].split()[0]) > 0, summary
    assert "'attnpass.cli.startup'" in on.stderr.splitlines()[-1]
    warning = "attnpass: warning: ATTNPASS_OPTIMIZE: console-script runs plain: ValueError: ATTNPASS_MIN_KEYS='many'"
    assert bad.stderr.startswith(warning) and "attnpass: optimize(" not in bad.stderr, bad.stderr
    assert bad.stdout.splitlines()[: len(text)] == plain.stdout.splitlines()[: len(text)]


def test_attnpass_exec_reads_the_option_variables_and_its_own_options_win(monkeypatch, cli):
    seen = []
    monkeypatch.setattr("attnpass.cli.launch.exec_script", lambda script, argv, options, on: seen.append(options) or 0)
    monkeypatch.setenv("ATTNPASS_MIN_KEYS", "0")
    monkeypatch.setenv("ATTNPASS_STRICT", "on")
    monkeypatch.setenv("ATTNPASS_PIPELINE", "dce")
    assert cli("exec", "vllm-mlx", "serve")[0] == 0
    assert cli("exec", "--min-keys", "5", "--pipeline", "head-chunk", "vllm-mlx", "serve")[0] == 0
    assert [(o.min_keys, o.strict, o.pipeline) for o in seen] == [(0, True, "dce"), (5, True, "head-chunk")]
    monkeypatch.setenv("ATTNPASS_SUMMARY_EVERY", "-1")
    status, out, err = cli("exec", "vllm-mlx", "serve")
    assert (status, out, err) == (1, "", "attnpass: error: ATTNPASS_SUMMARY_EVERY='-1': give a number of seconds > 0\n")
