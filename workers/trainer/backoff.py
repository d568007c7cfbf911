"""How long the trainer's consumer waits before asking the broker again after a call that failed.

A fetch of committed offsets, a read of the standing commit, or a write of progress entries can fail for
a while (the coordinator or a partition leader moving). Each such call may block a poll for seconds, so
asking again on every poll would stall the trainer for as long as the broker is away: a failure waits
`first_s`, doubling to `most_s`, and the delay goes back to `first_s` only once the call succeeds.
"""

from __future__ import annotations

from collections.abc import Callable


class Backoff:
    """When a call that failed may be made again; `clock` is monotonic seconds (a test's moves when it says)."""

    def __init__(self, clock: Callable[[], float], first_s: float, most_s: float):
        self._clock = clock
        self._first_s, self._most_s = first_s, most_s
        self._failures = 0
        self._next_try = 0.0

    def due(self) -> bool:
        """Whether the call may be made now."""
        return self._clock() >= self._next_try

    def failed(self) -> float:
        """The call failed: the delay before the next one, doubled from the last."""
        delay = min(self._first_s * 2**self._failures, self._most_s)
        self._failures += 1
        self._next_try = self._clock() + delay
        return delay

    def succeeded(self) -> None:
        """The call succeeded: the next failure waits `first_s` again."""
        self._failures = 0
        self._next_try = 0.0

    def now(self) -> None:
        """Something new to ask about (a partition assigned): ask at once, keeping the count of failures."""
        self._next_try = 0.0
