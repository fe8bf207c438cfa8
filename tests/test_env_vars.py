"""torch_fa4.env_vars: the per-call environment reads agree with os.environ after every kind of
change (set, changed, removed, set through monkeypatch), and a Snapshot tells settings apart."""

import os

from torch_fa4 import env_vars

NAME = "TORCH_FA4_TEST_ENV_VARS_KNOB"
OTHER = "TORCH_FA4_TEST_ENV_VARS_OTHER"


def test_get_follows_os_environ(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env_vars.get(NAME) is None and env_vars.get(NAME, "d") == "d"
    monkeypatch.setenv(NAME, "1")
    assert env_vars.get(NAME) == "1"
    os.environ[NAME] = "two words é"  # non-ASCII survives the encoded table
    assert env_vars.get(NAME, "d") == os.environ.get(NAME) == "two words é"
    del os.environ[NAME]
    assert env_vars.get(NAME, "") == ""


def test_snapshot_tells_settings_apart(monkeypatch):
    for name in (NAME, OTHER):
        monkeypatch.delenv(name, raising=False)
    snap = env_vars.Snapshot((NAME, OTHER))
    unset = snap()
    assert unset == (None, None) and snap() == unset
    monkeypatch.setenv(NAME, "3")
    first = snap()
    assert first != unset
    monkeypatch.setenv(NAME, "4")
    assert snap() not in (unset, first)
    monkeypatch.setenv(NAME, "3")
    assert snap() == first
    monkeypatch.setenv(OTHER, "3")
    assert snap() != first


def test_fallback_without_the_table(monkeypatch):
    """Where os.environ has no table of encoded names, the reads go through os.environ.get."""
    monkeypatch.setenv(NAME, "5")
    monkeypatch.setattr(env_vars, "_table", lambda: None)
    assert env_vars.get(NAME) == "5" and env_vars.get(OTHER + "_UNSET", "x") == "x"
    assert env_vars.Snapshot((NAME,))() == ("5",)
