"""One reading of on/off words everywhere: textual pipeline bools, pass policies and the runtime checks agree.

The oracle is the documented word lists written out here, not the module's own
sets; each consumer is driven through its public entry point.
"""

from __future__ import annotations

import os
import warnings

import pytest

from attnpass.ir.core import switches
from attnpass.lowering.checks import ENV_VAR as CHECKS_VAR
from attnpass.lowering.checks import env_checks
from attnpass.passes import HeadChunkSDPA, PipelineError, parse_pipeline

ON_WORDS = ["true", "TRUE", " On ", "yes\n", "1", "\t1 "]
OFF_WORDS = ["false", "Off", " no ", "0", "NO\t"]
OTHER = ["", " ", "flase", "enabled", "00", "2", "y", "n", "-1", "onn"]


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(switches, "_WARNED", set())
    monkeypatch.delenv(CHECKS_VAR, raising=False)
    monkeypatch.delenv(HeadChunkSDPA.env_var, raising=False)


def expected(text: str) -> bool | None:
    word = text.strip().lower()
    return True if word in ("true", "on", "yes", "1") else False if word in ("false", "off", "no", "0") else None


@pytest.mark.parametrize("text", ON_WORDS + OFF_WORDS + OTHER)
def test_every_consumer_reads_a_word_the_same_way(text, monkeypatch):
    want = expected(text)
    assert switches.parse_switch(text) is want
    # the textual pipeline: a bool option takes exactly the recognised words
    if want is None:
        with pytest.raises(PipelineError, match="enabled: expected bool or none"):
            parse_pipeline(f"head-chunk{{enabled={text}}}")
    else:
        assert parse_pipeline(f"head-chunk{{enabled={text}}}")[0].enabled is want
    monkeypatch.setenv(HeadChunkSDPA.env_var, text)
    monkeypatch.setenv(CHECKS_VAR, text)
    before = dict(os.environ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", switches.SwitchWarning)
        # a pass policy: on unless an off word; the runtime checks: off unless an on word
        assert (HeadChunkSDPA().disabled() is None) is (want is not False)
        assert env_checks() is (want is True)
    assert dict(os.environ) == before  # read, never written


def test_an_explicit_value_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(HeadChunkSDPA.env_var, "off")
    assert HeadChunkSDPA(enabled=True).disabled() is None
    monkeypatch.setenv(HeadChunkSDPA.env_var, "on")
    assert HeadChunkSDPA(enabled=False).disabled() == "disabled by HeadChunkSDPA(enabled=False)"
    assert switches.env_switch(CHECKS_VAR, False, default=False, subject="x") == (False, "enabled=False")


def test_an_unrecognised_value_warns_once_per_variable_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv(CHECKS_VAR, "flase")
    message = (
        f"{CHECKS_VAR}='flase' is not a recognised value, so runtime checking stays off; "
        "accepted: true/on/yes/1 turn it on, false/off/no/0 (or unset) leave it off"
    )
    with pytest.warns(switches.SwitchWarning) as caught:
        assert env_checks() is False
    assert [str(w.message) for w in caught] == [message]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert env_checks() is False  # the second time: silent
    unset = "ATTNPASS_TEST_UNSET_SWITCH"
    assert switches.env_switch(unset, None, default=True, subject="x") == (True, f"{unset} unset")
