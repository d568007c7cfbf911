"""Pid files of the long-lived processes rlstream starts, so a supervisor can stop exactly those.

When `RLSTREAM_PID_DIR` is set (`.ci/run` sets it), every broker JVM and every Ray instance this
code starts leaves `<name>-<pid>.pid` there; the supervisor stops those pids and nothing else,
never matching processes by name.
"""

from __future__ import annotations

import os
from pathlib import Path

PID_DIR_ENV = "RLSTREAM_PID_DIR"


def record_pid(name: str, pid: int) -> None:
    """Leave a pid file for `pid` when a pid directory is configured; a no-op otherwise."""
    where = os.environ.get(PID_DIR_ENV)
    if not where:
        return
    path = Path(where)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}-{pid}.pid").write_text(f"{pid}\n")
