"""A dependency-free progress line for long-running commands: redrawn in place on a terminal, periodic otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable


class Progress:
    """Shows produced/finalized/consumed counts against a total; `log` receives periodic lines when not a TTY."""

    def __init__(self, total: int, log: Callable[[str], None], *, width: int = 24, every_s: float = 2.0):
        self.total = max(total, 1)
        self._log = log
        self._width = width
        self._every = every_s
        self._last = 0.0
        self._tty = sys.stderr.isatty()
        self._line = ""

    def _bar(self, done: int) -> str:
        filled = min(self._width, int(self._width * done / self.total))
        return "#" * filled + "." * (self._width - filled)

    def update(self, *, produced: int, finalized: int, consumed: int, evicted: int, dead: int, version: int) -> None:
        done = consumed + evicted + dead
        self._line = (
            f"[{self._bar(done)}] produced {produced}/{self.total}  finalized {finalized}  "
            f"consumed {consumed}  evicted {evicted}  dead-lettered {dead}  trainer v{version}"
        )
        now = time.monotonic()
        if self._tty:
            sys.stderr.write("\r" + self._line)
            sys.stderr.flush()
        elif now - self._last >= self._every:
            self._log(self._line)
            self._last = now

    def close(self) -> None:
        if self._tty:
            sys.stderr.write("\n")
        elif self._line:
            self._log(self._line)
