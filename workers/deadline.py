"""One bound for a sequence of waits: each wait takes what is left of it, not a bound of its own.

`resume` waits for several things in turn (a dead job's members to leave their groups, its open
transactions to end, offsets a transaction left pending, the rollout workers' feed to take a
commit); a bound per wait made the real bound several times the one asked for.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Deadline:
    """`seconds` from now, on `clock` (monotonic by default)."""

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic):
        self.seconds = seconds
        self._clock = clock
        self._start = clock()

    def elapsed(self) -> float:
        return self._clock() - self._start

    def left(self) -> float:
        """Seconds left, 0 once passed."""
        return max(0.0, self.seconds - self.elapsed())

    def passed(self) -> bool:
        return self.elapsed() > self.seconds

    def within(self, most_s: float) -> Deadline:
        """A deadline of at most `most_s` from now that never passes this one."""
        return Deadline(min(most_s, self.left()), clock=self._clock)
