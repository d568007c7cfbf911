"""Every CLI test runs with no RLSTREAM_* variable of the caller and a log directory of its own."""

import pytest


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    import os

    for name in list(os.environ):
        if name.startswith("RLSTREAM_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "rlstream" / "log" / "rlstream.log"
