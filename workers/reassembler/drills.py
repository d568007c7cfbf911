"""Crash drills: a worker configured with a crash point SIGKILLs itself there, as a real crash would end it."""

from __future__ import annotations

import os
import signal


def crash_here(configured: str | None, point: str) -> None:
    """Die at once, without cleanup, when `point` is the configured crash point."""
    if configured == point:
        os.kill(os.getpid(), signal.SIGKILL)
