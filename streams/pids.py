"""Pid files of the long-lived processes rlstream starts, so a supervisor can stop exactly those.

When `RLSTREAM_PID_DIR` is set (`.ci/run` sets it), every broker JVM and every Ray instance this
code starts leaves `<name>-<pid>.pid` there, and removes it again when it stops the process; the
supervisor stops those pids and nothing else, never matching processes by name.
"""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path

PID_DIR_ENV = "RLSTREAM_PID_DIR"
_PR_SET_PDEATHSIG = 1


def _pid_file(name: str, pid: int) -> Path | None:
    where = os.environ.get(PID_DIR_ENV)
    return Path(where) / f"{name}-{pid}.pid" if where else None


def record_pid(name: str, pid: int) -> None:
    """Leave a pid file for `pid` when a pid directory is configured; a no-op otherwise."""
    path = _pid_file(name, pid)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{pid}\n")


def forget_pid(name: str, pid: int) -> None:
    """Remove the pid file `record_pid(name, pid)` left, once the process is stopped; a no-op otherwise."""
    path = _pid_file(name, pid)
    if path is not None:
        path.unlink(missing_ok=True)


def die_with_parent() -> None:
    """In a child before exec (`preexec_fn`): SIGTERM it when its parent dies, even by SIGKILL (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); look at its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def reap(pid: int) -> None:
    """Collect `pid`'s exit status if it is an exited child of this process; a no-op otherwise."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def runs_main_class(pid: int, main_class: str) -> bool:
    """Whether `pid` is a JVM running `main_class` (its command line has that argument).

    Where it cannot be told (no /proc, not readable) the answer is yes: the caller's signal decides.
    """
    try:
        return main_class.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # gone; or no /proc at all (not Linux)
    except OSError:
        return True
