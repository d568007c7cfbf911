"""Drills: a worker configured with a crash point SIGKILLs itself there, as a real crash would end it;
one configured with a stop point SIGSTOPs itself there, as a paused VM or a debugger would freeze it."""

from __future__ import annotations

import os
import signal


def crash_here(configured: str | None, point: str) -> None:
    """Die at once, without cleanup, when `point` is the configured crash point."""
    if configured == point:
        os.kill(os.getpid(), signal.SIGKILL)


def stop_here(configured: str | None, point: str) -> None:
    """Stop this process (SIGSTOP) when `point` is the configured stop point: a zombie, until SIGCONT."""
    if configured == point:
        os.kill(os.getpid(), signal.SIGSTOP)
