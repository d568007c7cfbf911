"""Whether a worker may still write to TQ train: the zombie guard Kafka cannot give for TQ.

A worker frozen past its session timeout (SIGSTOP, a paused VM, a long stop-the-world pause) has
lost its partitions to a successor without knowing it. Kafka fences its transaction, but a TQ put it
makes on waking would still land: over rows the successor committed, or recreating rows a trainer
already released, which nobody would clear. Nothing in TQ can refuse a put by owner, so the worker
refuses it itself when it cannot be sure it still owns its partitions:

- **A freeze**: a watch thread ticks every `tick_s`; a gap between ticks of at least half the
  session timeout means the whole process was stopped. Puts are refused for a session timeout after
  it, by which time the consumer has heard from the coordinator and dropped revoked partitions.
- **A slow step**: more than 3/4 of `max.poll.interval.ms` since the last poll, after which the
  consumer leaves its group even though it kept heartbeating.

What remains is a freeze that starts after the check and before the put's first byte lands: a
window of microseconds against one as long as the whole step before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Lease:
    """Freeze and poll-interval watch of one worker process."""

    def __init__(
        self,
        session_timeout_s: float,
        max_poll_interval_s: float,
        *,
        tick_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        watch: bool = True,
    ):
        self.session_timeout_s = session_timeout_s
        self.max_poll_interval_s = max_poll_interval_s
        self._clock = clock
        self._tick_s = tick_s
        self._last_tick = self._polled = clock()
        self._refuse_until = float("-inf")
        self._freeze_s = 0.0
        self._stop = threading.Event()
        if watch:
            threading.Thread(target=self._watch, name="rlstream-lease", daemon=True).start()

    def polled(self) -> None:
        self._polled = self._clock()

    def tick(self) -> None:
        """One tick of the watch: notes a freeze since the previous one."""
        now = self._clock()
        self._note(now - self._last_tick, now)
        self._last_tick = now

    def _note(self, gap: float, now: float) -> None:
        if gap >= self.session_timeout_s / 2:
            self._freeze_s = max(self._freeze_s, gap)
            self._refuse_until = max(self._refuse_until, now + self.session_timeout_s)

    def _watch(self) -> None:
        while not self._stop.wait(self._tick_s):
            self.tick()

    def expired(self) -> str | None:
        """Why a put now could be a zombie's, or None."""
        now = self._clock()
        # A freeze the watch thread has not ticked through yet (the caller woke first).
        self._note(now - self._last_tick - self._tick_s, now)
        if now < self._refuse_until:
            return f"the process was frozen for {self._freeze_s:.1f}s (session timeout {self.session_timeout_s:.0f}s)"
        since_poll = now - self._polled
        if since_poll >= self.max_poll_interval_s * 0.75:
            return f"{since_poll:.1f}s since the last poll (max.poll.interval {self.max_poll_interval_s:.0f}s)"
        return None

    def close(self) -> None:
        self._stop.set()
