"""Issue 32 item 5: the CLI names an unknown option and lists the commands, refuses a negative --width,
and prints each pass's first sentence whole."""

from __future__ import annotations

import pytest

from attnpass.cli.main import main
from attnpass.models import verify_step
from attnpass.passes import available_passes


def test_an_unknown_option_is_named_with_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--bogus-flag"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "unrecognized arguments: --bogus-flag" in err and "one of show, run, explain" in err


def test_a_negative_width_is_a_usage_error(tmp_path, capsys):
    graph = tmp_path / "g.json"
    graph.write_text(verify_step(4, 64).to_json())
    with pytest.raises(SystemExit) as info:
        main(["run", "-p", "dce", str(graph), "--width", "-3"])
    assert info.value.code == 2 and "argument --width: must be an int >= 0, got '-3'" in capsys.readouterr().err


def test_passes_prints_whole_first_sentences(cli):
    status, out, _ = cli("passes")
    assert status == 0
    summaries = [
        line.strip() for line in out.splitlines() if line.startswith("    ") and not line.startswith("    option")
    ]
    assert len(summaries) == len(available_passes())
    assert all(s.endswith(".") for s in summaries), summaries
    assert any("concatenated along the rows; valid IR in, valid IR out." in s for s in summaries)
