"""A test's own first-use self-check state (torch_fa4/self_check.py): no verdicts, warnings or check
count from earlier tests, none from the environment, and verdicts written to (and read from) a
cache folder of the test's own, so each test sees every variant checked anew."""

from torch_fa4 import self_check


def forget_verdicts(monkeypatch, cache_dir):
    monkeypatch.setenv("TORCH_FA4_CACHE_DIR", str(cache_dir))
    monkeypatch.delenv(self_check.ENV, raising=False)
    monkeypatch.setattr(self_check, "_verdicts", {})
    monkeypatch.setattr(self_check, "_warned", set())
    monkeypatch.setattr(self_check, "checks_run", 0)
